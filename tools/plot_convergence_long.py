"""Validation loss against tokens for the long-horizon study (docs/convergence_long.md): per
configuration the median over seeds, with the range over seeds shaded.

    .venv/bin/python tools/plot_convergence_long.py --output runs/tta_long --seeds 1,2,3 \
        --config "flush, AdamW=flush-adam-lr3e-3" --config "PACI, AdamW=paci-adam-lr3e-3" \
        --png docs/convergence_long.png

`--x time --calibration FILE.json` plots against projected seconds instead (the simulator's pace
for each run's pipeline with the file's per-stage costs, `time_to_accuracy.simulated_times`).

Each --config is LABEL=RUN NAME (the name under --output, without -seedN); seeds not run yet
are left out, and the legend gives each curve's number of seeds.
"""

import argparse
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from megatron.common.errors import run_tool
from megatron.studies import time_to_accuracy as tta  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/tta_long")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--config", action="append", required=True, help="LABEL=RUN NAME")
    parser.add_argument("--png", default="docs/convergence_long.png")
    parser.add_argument("--title", default="Validation loss, median and range over seeds")
    parser.add_argument("--x", choices=("tokens", "time"), default="tokens",
                        help="time: projected seconds (needs --calibration)")  # fmt: skip
    parser.add_argument("--calibration", default=None, metavar="FILE.json",
                        help="per-stage costs for --x time (a simulated pace)")  # fmt: skip
    options = parser.parse_args(argv)
    if options.x == "time" and not options.calibration:
        parser.error("--x time needs --calibration")
    seeds = [int(s) for s in options.seeds.split(",")]
    figure, axes = plt.subplots(figsize=(8, 5))
    for spec in options.config:
        label, _, name = spec.rpartition("=")  # a label may hold "=", a run name not
        done = [s for s in seeds if os.path.exists(os.path.join(
            tta.run_directory(options.output, name, s), "summary.json"))]  # fmt: skip
        if not done:
            continue  # not run yet: a partial study plots what it has
        runs = [tta._read_run(options.output, name, seed) for seed in done]
        if options.x == "time":  # every seed of a configuration has the same pace
            xs = [t for t, _ in tta.by_projected_time(runs[0], options.calibration)]
        else:
            xs = runs[0].tokens
        losses = list(zip(*[[loss for _, loss in run.validation] for run in runs]))
        middle = [statistics.median(values) for values in losses]
        (line,) = axes.plot(xs, middle, label=f"{label} ({len(runs)} seeds)")
        axes.fill_between(xs, [min(v) for v in losses], [max(v) for v in losses],
                          color=line.get_color(), alpha=0.2)  # fmt: skip
    axes.set_xlabel("tokens" if options.x == "tokens" else
                    "projected time, s (simulated pace, calibrated per-stage costs)")  # fmt: skip
    axes.set_ylabel("validation loss")
    axes.set_title(options.title)
    finals = [v for line in axes.get_lines() for v in line.get_ydata()[-4:]]
    axes.set_ylim(min(finals) - 0.1, min(finals) + 1.2)  # the end of training, where they differ
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(options.png, dpi=110)
    print(options.png)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
