"""Real-compute benchmark: the GPT model on 2 pipeline stages, 1F1B-flush vs PACI, interleaved.

`megatron.benchmarks.real_compute` defines every figure. Runs, for each m, `--pairs`
pairs of flush and PACI runs (order alternating) in one torchrun launch with one thread per
process; then proposes the `--decoder-last-pipeline-num-layers` that balances the stages (from
the PACI runs' per-stage costs) and repeats with it. Prints one JSON object (also written to
``OUTPUT/report.json``), with the 1-minute load average before and after each launch.

    python tools/real_compute_benchmark.py --microbatches 2,4,8 --pairs 3

With ``--vocab-split`` the pairs are PACI with the output layer whole on the last stage and PACI
with it split over the two ranks (--enable-vocab-parallel), on the even layer split:

    python tools/real_compute_benchmark.py --vocab-split --num-layers 4 --microbatches 4,8
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from megatron.benchmarks import real_compute as rc
from megatron.common.errors import run_tool


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--microbatches", default="2,4,8", help="comma list of m (microbatches per step)")
    add("--pairs", type=int, default=3, help="flush/PACI pairs per m")
    add("--num-layers", type=int, default=8)
    add("--hidden-size", type=int, default=128)
    add("--num-attention-heads", type=int, default=4)
    add("--seq-length", type=int, default=128)
    add("--micro-batch-size", type=int, default=2)
    add("--microbatches-per-run", type=int, default=24, help="steps = this / m (at least 4)")
    add("--data-path", default="data/stdlib_text_document")
    add("--tokenizer-model", default="data/tokenizer/stdlib.model")
    add("--no-balanced", action="store_true", help="skip the balanced-split repeat")
    add("--vocab-split", action="store_true",
        help="pairs of PACI with the output layer whole and split over the ranks (no "
        "balanced repeat)")  # fmt: skip
    add("--no-pin", action="store_true", help="do not pin local rank r to core r")
    add("--output", default=None)
    add("--timeout", type=float, default=1200.0, help="per launch, seconds")
    options = parser.parse_args(argv)
    try:
        options.microbatches = [int(m) for m in options.microbatches.split(",")]
    except ValueError:
        parser.error("--microbatches: expected a comma list of integers")
    if options.pairs < 1 or min(options.microbatches) < 1 or options.num_layers % 2:
        parser.error("--pairs and m must be >= 1, --num-layers even")
    return options


def measure(cases, output: str, label: str, options, pair=("1f1b", "paci")) -> dict:
    load_before = os.getloadavg()
    started = time.perf_counter()
    rc.run_cases(cases, output, label, options.timeout, pin=not options.no_pin)
    return {
        "launch_s": round(time.perf_counter() - started, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "ratios": rc.ratios(cases, options.microbatches, pair),
    }


def vocab_split_report(options, output: str) -> dict:
    """PACI whole against PACI split, and each rank's peak memory and parameters."""
    pair = ("paci", "paci" + rc.VOCAB_SPLIT)
    cases = rc.benchmark_cases(options, output, pair=pair)
    report = {"vocab_split": measure(cases, output, "vocab", options, pair)}
    report["vocab_split"]["per_rank"] = {
        schedule: rc.per_rank_memory(next(c for c in cases if c["schedule"] == schedule))
        for schedule in pair
    }
    return report


def proposal(cases, options) -> dict:
    """The balancing split from the even-split PACI runs' per-stage costs (their mean)."""
    per_run = [rc.stage_costs(c) for c in cases if c["schedule"] == "paci"]
    costs = [statistics.fmean(run[s] for run in per_run) for s in range(rc.NUM_STAGES)]
    return rc.balanced_last_layers(costs, *rc.even_split(options.num_layers))


def main(argv=None) -> int:
    options = parse_args(argv)
    output = options.output or tempfile.mkdtemp(prefix="real_compute_")
    os.makedirs(output, exist_ok=True)
    report = {"options": {k: v for k, v in vars(options).items()}, "output_dir": output}
    if options.vocab_split:
        report.update(vocab_split_report(options, output))
        return _write(report, output)
    even_cases = rc.benchmark_cases(options, output)
    report["even_split"] = measure(even_cases, output, "even", options)
    report["balancing"] = proposal(even_cases, options)
    last = report["balancing"]["proposed_last_layers"]
    if not options.no_balanced and last != options.num_layers // 2:
        cases = rc.benchmark_cases(options, output, last_layers=last)
        report["balanced_split"] = {
            "last_layers": last,
            **measure(cases, output, "balanced", options),
        }
        report["balanced_split"]["measured_stage_costs_ms"] = [
            round(1000.0 * statistics.fmean(rc.stage_costs(c)[s] for c in cases
                                            if c["schedule"] == "paci"), 3)
            for s in range(rc.NUM_STAGES)
        ]  # fmt: skip
    return _write(report, output)


def _write(report: dict, output: str) -> int:
    text = json.dumps(report, indent=2)
    with open(os.path.join(output, "report.json"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
