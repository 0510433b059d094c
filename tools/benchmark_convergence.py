"""Does PACI converge like 1F1B-flush? Train both on the default corpus and compare.

Runs `examples/paci/demo_cpu.sh`'s model (4 stages, 4 processes, gloo, a = 4) for the given
number of iterations with each schedule, on the same data in the same order, then prints one
JSON object: the loss of each run averaged over windows of iterations (same tokens for both),
the relative gap of PACI over flush on the last window and on the validation loss, and the
per-stage drift PACI measured.

    .venv/bin/python tools/benchmark_convergence.py --iterations 300 [--output runs/convergence] \
        [-- --lr 1e-3 --min-lr 1e-4]

This is a benchmark, not a test: a few hundred iterations take several minutes on 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys

from megatron.common.errors import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_schedule(schedule: str, iterations: int, output: str, extra: list[str]) -> dict:
    """Train with the demo's flags and one schedule; return its summary.json."""
    environment = {**os.environ, "ITERS": str(iterations), "OUT": output, "OMP_NUM_THREADS": "1"}
    script = os.path.join(REPO, "examples", "paci", "demo_cpu.sh")
    command = ["bash", script, "--only", schedule, *extra]
    completed = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{schedule} run failed:\n{(completed.stdout + completed.stderr)[-4000:]}"
        )
    return json.load(open(os.path.join(output, schedule, "summary.json")))


def window_means(losses: list[float], window: int) -> list[float]:
    return [
        sum(losses[i : i + window]) / len(losses[i : i + window])
        for i in range(0, len(losses), window)
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--output", default=os.path.join(REPO, "runs", "convergence"))
    parser.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags, after --")
    options = parser.parse_args(argv)
    summaries = {
        schedule: run_schedule(schedule, options.iterations, options.output, options.extra)
        for schedule in ("1f1b", "paci")
    }
    flush, paci = summaries["1f1b"], summaries["paci"]
    curves = {name: window_means(s["loss"], options.window) for name, s in summaries.items()}
    last_gap = curves["paci"][-1] / curves["1f1b"][-1] - 1.0
    report = {
        "iterations": options.iterations,
        "tokens_per_iteration": flush["global_batch_size"] * flush["seq_length"],
        "window": options.window,
        "loss_by_window": curves,
        "relative_gap_last_window": last_gap,
        "validation": {name: s["validation"][-1]["lm loss"] for name, s in summaries.items()},
        "paci_max_drift_by_stage": [stage["max_drift"] for stage in paci["stages"]],
        "paci_mean_drift_by_stage": [stage["mean_drift"] for stage in paci["stages"]],
        "within_2_percent": abs(last_gap) <= 0.02,
    }
    report["relative_gap_validation"] = (
        report["validation"]["paci"] / report["validation"]["1f1b"] - 1.0
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
