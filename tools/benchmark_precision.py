"""Does a bf16 run (fp32 main weights and gradient accumulation) track the fp32 run?

Trains `examples/paci/demo_cpu.sh`'s model (4 stages, 4 processes, gloo, default corpus) with
one schedule in fp32 and again with `--bf16` (plus any flags after `--`), same data in the
same order, and prints one JSON object: both loss curves' means over windows of iterations,
the largest per-iteration relative gap, the gap of the last window's mean and of the
validation loss, and each run's training time.

    .venv/bin/python tools/benchmark_precision.py --iterations 100 --schedule 1f1b \
        [--output runs/precision] [-- --use-distributed-optimizer]

A benchmark, not a test: 100 iterations of both runs take a few minutes on 2 cores.
"""

import argparse
import json
import os
import sys

from benchmark_convergence import run_schedule  # the demo's flags, one schedule, its summary

from megatron.common.errors import run_tool


def window_means(losses: list[float], window: int) -> list[float]:
    return [
        round(sum(losses[i : i + window]) / len(losses[i : i + window]), 4)
        for i in range(0, len(losses), window)
    ]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def compare(fp32: dict, bf16: dict, window: int) -> dict:
    a, b = fp32["loss"], bf16["loss"]
    last_a, last_b = sum(a[-window:]) / window, sum(b[-window:]) / window
    result = {
        "iterations": len(a),
        "fp32_window_means": window_means(a, window),
        "bf16_window_means": window_means(b, window),
        "max_relative_gap_per_iteration": max(relative(y, x) for x, y in zip(a, b)),
        "relative_gap_last_window": relative(last_b, last_a),
        "fp32_train_s": round(fp32["elapsed_s"], 1),
        "bf16_train_s": round(bf16["elapsed_s"], 1),
    }
    if fp32.get("validation") and bf16.get("validation"):
        va, vb = fp32["validation"][-1]["lm loss"], bf16["validation"][-1]["lm loss"]
        result.update(
            fp32_validation=va, bf16_validation=vb, relative_gap_validation=relative(vb, va)
        )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "paci"])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--output", default="runs/precision")
    parser.add_argument("extra", nargs="*", help="flags for both runs (after --)")
    options = parser.parse_args(argv)
    runs = {}
    for name, flags in (("fp32", []), ("bf16", ["--bf16"])):
        output = os.path.join(options.output, name)
        runs[name] = run_schedule(
            options.schedule, options.iterations, output, flags + options.extra
        )
    result = {"schedule": options.schedule, "extra_flags": options.extra}
    result.update(compare(runs["fp32"], runs["bf16"], options.window))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
