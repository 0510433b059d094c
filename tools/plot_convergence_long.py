"""Validation loss against tokens for the long-horizon study (docs/convergence.md): per
configuration the median over seeds, with the range over seeds shaded.

    .venv/bin/python tools/plot_convergence_long.py --output runs/tta_long --seeds 1,2,3 \
        --config "flush, AdamW=flush-adam-lr3e-3" --config "PACI, AdamW=paci-adam-lr3e-3" \
        --png docs/convergence_long.png

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

from megatron.studies import time_to_accuracy as tta  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/tta_long")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--config", action="append", required=True, help="LABEL=RUN NAME")
    parser.add_argument("--png", default="docs/convergence_long.png")
    parser.add_argument("--title", default="Validation loss, median and range over seeds")
    options = parser.parse_args(argv)
    seeds = [int(s) for s in options.seeds.split(",")]
    figure, axes = plt.subplots(figsize=(8, 5))
    for spec in options.config:
        label, _, name = spec.rpartition("=")  # a label may hold "=", a run name not
        done = [s for s in seeds if os.path.exists(os.path.join(
            tta.run_directory(options.output, name, s), "summary.json"))]  # fmt: skip
        if not done:
            continue  # not run yet: a partial study plots what it has
        runs = [tta._read_run(options.output, name, seed) for seed in done]
        tokens = runs[0].tokens
        losses = list(zip(*[[loss for _, loss in run.validation] for run in runs]))
        middle = [statistics.median(values) for values in losses]
        (line,) = axes.plot(tokens, middle, label=f"{label} ({len(runs)} seeds)")
        axes.fill_between(tokens, [min(v) for v in losses], [max(v) for v in losses],
                          color=line.get_color(), alpha=0.2)  # fmt: skip
    axes.set_xlabel("tokens")
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
    sys.exit(main())
