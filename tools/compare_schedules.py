"""Every pipeline schedule side by side on one model (projected with the simulator).

    python tools/compare_schedules.py --model gpt2-medium --microbatches 8,16,32
    python tools/compare_schedules.py --model llama-70b --microbatches 8,16,32,64 --stage-costs

Prints a markdown table per model: pace as a fraction of the physical limit, peak activations
per rank, weight copies, drift and staleness, per schedule and microbatch count
(`megatron/pipeline/simulation/comparison.py` defines every figure); with --stage-costs also
the per-stage forward and backward costs of the one-chunk layout (relative units, one layer's
forward = 1), for the emulated-runtime check.
"""

import argparse
import sys

from megatron.pipeline.simulation.comparison import MODELS, markdown, table, virtual_stage_costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append", required=True)
    parser.add_argument("--microbatches", default="8,16,32", help="comma list of m per step")
    parser.add_argument("--stage-costs", action="store_true")
    args = parser.parse_args(argv)
    try:
        counts = [int(m) for m in args.microbatches.split(",")]
    except ValueError:
        parser.error(f"--microbatches: a comma list of integers, got {args.microbatches!r}")
    if any(m < 1 for m in counts):
        parser.error("--microbatches: every count must be >= 1")
    for name in args.model:
        model = MODELS[name]
        print(markdown(model, table(model, counts)))
        if args.stage_costs:
            forward, backward, wgrad = virtual_stage_costs(model, 1, "interleaved")
            print("\nper-stage forward:", ",".join(f"{f:.3f}" for f in forward))
            print("per-stage backward (input + weight gradient):",
                  ",".join(f"{b + w:.3f}" for b, w in zip(backward, wgrad)))  # fmt: skip
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
