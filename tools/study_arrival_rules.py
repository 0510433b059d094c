"""Study PACI's arrival rules on uneven and noisy stages in the simulator; print the tables.

Runs every rule of `megatron.pipeline.schedules.paci.ARRIVAL_RULES` over the grid of
`megatron.benchmarks.arrival_study` (which defines every figure), prints markdown
tables (noiseless pace per case; per noise level, mean/worst pace and the default rule's
shortfall against the best) and a JSON summary; ``--output`` also writes every run as JSON.

    python tools/study_arrival_rules.py --cvs 0,0.1,0.2,0.3 --seeds 1,2,3 --jobs 2
"""

import argparse
import json
import multiprocessing
import sys
import time

from megatron.benchmarks import arrival_study
from megatron.common.errors import run_tool
from megatron.pipeline.schedules.paci import DEFAULT_ARRIVAL_RULE


def number_list(cast):
    def parse(text: str):
        try:
            return tuple(cast(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}") from None

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--stages", type=number_list(int), default=(4, 8))
    add("--accumulations", type=number_list(int), default=(1, 4, 8))
    add("--factors", type=number_list(float), default=(1.2, 1.5, 2.0, 3.0),
        help="slow stage's cost over the others'")  # fmt: skip
    add("--cvs", type=number_list(float), default=(0.0, 0.1, 0.2, 0.3),
        help="coefficients of variation of every action's cost")  # fmt: skip
    add("--seeds", type=number_list(int), default=(1, 2, 3))
    add("--microbatches", type=int, default=96, help="per run")
    add("--jobs", type=int, default=1, help="worker processes")
    add("--output", default=None, help="write every run and the summary here (JSON)")
    options = parser.parse_args(argv)
    if min(options.stages) < 2 or min(options.accumulations) < 1 or options.microbatches < 8:
        parser.error("--stages >= 2, --accumulations >= 1, --microbatches >= 8")
    if min(options.factors) < 1 or min(options.cvs) < 0:
        parser.error("--factors must be >= 1 and --cvs >= 0")
    return options


def main(argv=None) -> int:
    options = parse_args(argv)
    cases = arrival_study.grid(
        options.stages, options.accumulations, options.factors, options.cvs, options.seeds
    )
    started = time.perf_counter()
    with multiprocessing.Pool(options.jobs) as pool:
        rows = arrival_study.run_study(cases, microbatches=options.microbatches, pool=pool)
    summary = arrival_study.summarize(rows, DEFAULT_ARRIVAL_RULE)
    summary["simulations"] = len(rows)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print("Pace relative to the slowest stage's bound, no noise:\n")
    print(arrival_study.noiseless_table(rows) + "\n")
    print("Pace per noise level (cases averaged over seeds):\n")
    print(arrival_study.noise_table(summary) + "\n")
    print(json.dumps(summary, indent=2))
    if options.output:
        with open(options.output, "w") as f:
            json.dump({"summary": summary, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
