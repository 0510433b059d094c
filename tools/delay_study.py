"""The one-step-delay study on the default corpus, in one process (no pipeline runtime).

For each optimizer: synchronous vs one-step-delayed training (PipeDream-2BW's semantics), with
and without update-level error feedback, and the synchronous run with error feedback as a
control; several seeds (median and range); a momentum sweep and an LR sweep on one seed.
Results go to a JSON-lines file as each run finishes (rerunning resumes); `--report` prints
the Markdown tables and writes the plot.

    .venv/bin/python tools/delay_study.py --output runs/delay_study \
        [--optimizers adam muon ...] [--seeds 1 2 3] [--iterations 60] [--main-only]
    .venv/bin/python tools/delay_study.py --output runs/delay_study --report \
        --plot docs/delay_study.png

This is a benchmark, not a test: the default plan is 154 runs of 60 iterations (20-80 s
each on the shared 2-core machine).
"""

import argparse
import os
import sys

from megatron.common.errors import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_options(argv):
    from megatron.studies.delay_study import BASE_LR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(REPO, "runs", "delay_study"))
    parser.add_argument("--optimizers", nargs="*", default=list(BASE_LR))
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--data-path", default=os.path.join(REPO, "data", "stdlib_text_document"))
    parser.add_argument("--tokenizer-model",
                        default=os.path.join(REPO, "data", "tokenizer", "stdlib.model"))  # fmt: skip
    parser.add_argument("--main-only", action="store_true",
                        help="only the main comparison (4 variants x seeds), no sweeps")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="print tables from the results")
    parser.add_argument("--plot", default=None, help="with --report: write the plot here")
    return parser.parse_args(argv)


def ordered_plan(options):
    """Most informative first, so a study cut short by its time budget still says something:
    every optimizer on one seed, the LR sweep's 3x point, the momentum sweep, a second seed,
    error feedback at 3x the LR, the 9x and 1/3x points, then the remaining seeds."""
    from megatron.studies.delay_study import BASE_LR, plan

    seeds = options.seeds
    runs = plan(options.optimizers, seeds, sweep_seed=seeds[0])
    if options.main_only:
        runs = [run for run in runs if run.purpose == "main"]

    def rank(run):
        if run.purpose == "main":
            return {0: 0, 1: 3}.get(seeds.index(run.seed), 7)
        if run.purpose == "momentum":
            return 2
        factor = run.lr / BASE_LR[run.optimizer]
        if factor > 5:
            return 5
        if factor > 1:
            return 1 if run.variant in ("sync", "delayed") else 4
        return 6

    return sorted(runs, key=rank)  # stable: within a rank, the plan's order


def main(argv=None) -> int:
    options = parse_options(argv)
    os.makedirs(options.output, exist_ok=True)
    results_path = os.path.join(options.output, "results.jsonl")
    if options.report:
        from megatron.studies.delay_study_report import report

        print(report(results_path, options.optimizers, options.seeds[0], options.plot))
        return 0
    import torch

    from megatron.studies.delay_study import reference_flags, run_plan

    torch.set_num_threads(1)

    def flags_for(run):
        return reference_flags(
            run,
            iterations=options.iterations,
            data_prefix=options.data_path,
            tokenizer=options.tokenizer_model,
            data_cache=os.path.join(options.output, "cache"),
            eval_iters=options.eval_iters,
        )

    run_plan(ordered_plan(options), results_path, flags_for, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
