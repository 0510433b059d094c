"""Tied against untied embeddings under PACI, beside tied 1F1B-flush: the CPU demo's run.

    python tools/tied_embedding_study.py [--iters 150] [--seeds 1234,1235,1236] [--output DIR]

Runs examples/paci/demo_cpu.sh's 4-stage model on the default corpus (`make data`) for each
configuration and seed (a run already in DIR is reused), then prints, per configuration, the
median and range over the seeds of the final training loss, the validation loss, the tied
copy's largest lag and the throughput.
"""

import argparse
import json
import os
import statistics
import subprocess

CONFIGURATIONS = {  # name -> (schedule, extra flags)
    "1f1b tied": ("1f1b", []),
    "paci tied": ("paci", []),
    "paci untied": ("paci", ["--untie-embeddings-and-output-weights"]),
}


def run(name: str, seed: int, iters: int, output: str) -> dict:
    schedule, extra = CONFIGURATIONS[name]
    directory = os.path.join(output, f"{name.replace(' ', '_')}_seed{seed}")
    summary = os.path.join(directory, schedule, "summary.json")
    if not os.path.exists(summary):
        env = {**os.environ, "ITERS": str(iters), "OUT": directory}
        command = ["bash", "examples/paci/demo_cpu.sh", "--only", schedule, "--seed", str(seed)]
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "log.txt"), "w") as log:
            completed = subprocess.run(command + extra, env=env, stdout=log, stderr=log)
        if completed.returncode != 0:
            raise SystemExit(f"{name}, seed {seed} failed: see {directory}/log.txt")
    return json.load(open(summary))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} ({min(values):.4f} to {max(values):.4f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--seeds", default="1234,1235,1236")
    parser.add_argument("--output", default="runs/tied_study")
    options = parser.parse_args(argv)
    seeds = [int(s) for s in options.seeds.split(",")]
    print("| configuration | final loss | validation loss | max tied lag | tokens/s |")
    print("|---|---|---|---|---|")
    for name in CONFIGURATIONS:
        runs = [run(name, seed, options.iters, options.output) for seed in seeds]
        final = [r["final_loss"] for r in runs]
        validation = [r["validation"][-1]["lm loss"] for r in runs]
        lags = [r["stages"][-1].get("tied_embedding", {}).get("max_lag", 0) for r in runs]
        speed = [r["tokens_per_second"] for r in runs]
        print(f"| {name} | {spread(final)} | {spread(validation)} | {max(lags)} | "
              f"{statistics.median(speed):.0f} |")  # fmt: skip
    print(f"\n{len(seeds)} seeds ({options.seeds}), {options.iters} iterations; median (range)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
