"""Every pipeline schedule side by side on one model (projected with the simulator).

    python tools/compare_schedules.py --model gpt2-medium --microbatches 8,16,32
    python tools/compare_schedules.py --model llama-70b --microbatches 8,16,32,64 --stage-costs

Prints a markdown table per model: pace as a fraction of the physical limit, peak activations
per rank, weight copies, drift and staleness, per schedule and microbatch count
(`megatron/benchmarks/comparison.py` defines every figure); with --stage-costs also
the per-stage forward and backward costs of the one-chunk layout (relative units, one layer's
forward = 1), for the emulated-runtime check; with --png a figure of pace and peak
activations against m, one row per model.

    python tools/compare_schedules.py --model gpt2-medium --model llama-70b \
        --microbatches 8,16,32,64 --png docs/schedule_comparison.png
"""

import argparse
import dataclasses
import sys

from megatron.benchmarks.comparison import MODELS, markdown, table, virtual_stage_costs
from megatron.common.errors import run_tool
from megatron.pipeline.schedules import SIMULATED_SCHEDULES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append", required=True)
    parser.add_argument("--microbatches", default="8,16,32", help="comma list of m per step")
    parser.add_argument("--stage-costs", action="store_true")
    parser.add_argument(
        "--enable-vocab-parallel",
        action="store_true",
        help="the output layer and loss split by vocabulary over the ranks (even layer split)",
    )
    parser.add_argument("--png", help="write the figure here")
    args = parser.parse_args(argv)
    try:
        counts = [int(m) for m in args.microbatches.split(",")]
    except ValueError:
        parser.error(f"--microbatches: a comma list of integers, got {args.microbatches!r}")
    if any(m < 1 for m in counts):
        parser.error("--microbatches: every count must be >= 1")
    tables = {}
    for name in args.model:
        model = MODELS[name]
        if args.enable_vocab_parallel:
            model = dataclasses.replace(model, vocab_parallel=True)
        tables[name] = table(model, counts)
        print(markdown(model, tables[name]))
        if args.stage_costs:
            forward, backward, wgrad = virtual_stage_costs(model, 1, "interleaved")
            print("\nper-stage forward:", ",".join(f"{f:.3f}" for f in forward))
            print("per-stage backward (input + weight gradient):",
                  ",".join(f"{b + w:.3f}" for b, w in zip(backward, wgrad)))  # fmt: skip
        print()
    if args.png:
        plot(tables, args.png)
        print(f"wrote {args.png}")
    return 0


def plot(tables: dict, path: str) -> None:
    """Per model: pace and peak activations per rank against m, one line per schedule (a
    schedule missing at some m, DualPipeV below 2N, has no point there)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(tables), 2, figsize=(12, 4.2 * len(tables)), squeeze=False)
    for row, (name, rows) in zip(axes, tables.items()):
        schedules = list(dict.fromkeys(r.schedule for r in rows))
        for schedule in schedules:
            points = [r for r in rows if r.schedule == schedule and r.pace is not None]
            style = dict(marker="o", linewidth=2.5 if schedule.startswith("paci") else 1.2,
                         linestyle="--" if SIMULATED_SCHEDULES[schedule].flushes_every_call
                         else "-")  # fmt: skip
            for axis, value in zip(row, ("pace", "peak_activations")):
                axis.plot([r.microbatches for r in points], [getattr(r, value) for r in points],
                          label=schedule, **style)  # fmt: skip
        row[0].set_title(f"{MODELS[name].name}: pace", fontsize=10)
        row[0].set_ylabel("pace (of the physical limit)")
        row[1].set_title(f"{MODELS[name].name}: peak activations", fontsize=10)
        row[1].set_ylabel("per rank, in stage-microbatches (log)")
        row[1].set_yscale("log", base=2)
        counts = sorted({r.microbatches for r in rows})
        for axis in row:
            axis.set_xscale("log", base=2)
            axis.set_xticks(counts, [str(m) for m in counts])
            axis.set_xlabel("microbatches per step (m)")
            axis.grid(alpha=0.3)
        row[0].legend(fontsize=8, ncol=2)
    figure.suptitle("Projected with the simulator (no communication, no optimizer step); "
                    "solid: asynchronous, dashed: synchronous; 2BW and PipeDream lie under PACI",
                    fontsize=10)  # fmt: skip
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(run_tool(main))
