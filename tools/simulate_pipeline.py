"""Simulate a pipeline schedule and print what it does with given stage costs, as one JSON object.

The simulator (`megatron.pipeline.simulator`) runs the very schedule definitions the runtime
runs; see its docstring for the execution model and the exact meaning of every metric.

Examples::

    python tools/simulate_pipeline.py --schedule 1f1b --stages 8 --microbatches 8
    python tools/simulate_pipeline.py --schedule paci --stages 8 --microbatches 4 \\
        --fwd 1,1,1,3,1,1,1,1 --bwd 2 --timeline paci.json --plot paci.png
    python tools/simulate_pipeline.py --schedule zb-h1 --stages 4 --microbatches 8 \\
        --fwd 1 --bwd 1 --wgrad 1
    python tools/simulate_pipeline.py --schedule paci --stages 8 --microbatches 8 \\
        --calibration calib.json --micro-batch-size 4

Costs are durations in seconds (any unit works; ``microbatches_per_second`` is then per that
unit): ``--fwd`` per forward, ``--bwd`` per backward, ``--wgrad`` per weight-gradient pass,
``--step-cost`` per optimizer step, each one number for every stage or a comma list with one
number per stage. Schedules without a split backward pay ``bwd + wgrad`` per backward; ZB-H1
runs B (input gradient, ``--bwd``) and W (weight gradient, ``--wgrad``) separately.
``--microbatches`` is m per step for the flush schedules and the accumulation factor a for PACI
(and 2BW); a step is one call of the schedule, i.e. one training iteration.

Calibration file (``--calibration FILE.json``, instead of ``--fwd/--bwd/--wgrad/--step-cost``)::

    {
      "format": "pipeline-calibration", "version": 1,          (optional)
      "model": {"num_layers": 24, "hidden_size": 1024, ...},   (optional, informational)
      "device": "cpu",                                         (optional, informational)
      "p2p_s": 0.0002,                                         (optional: default --p2p)
      "profiles": [                                            (one per micro-batch size)
        {
          "micro_batch_size": 4,
          "layer": {"forward_s": 0.010, "backward_s": 0.020},  (a uniform transformer layer)
          "num_layers": 24,
          "embedding": {"forward_s": 0.001, "backward_s": 0.002},   (optional: first stage)
          "output": {"forward_s": 0.004, "backward_s": 0.008}       (optional: last stage,
        }                                                            output layer and loss)
      ]
    }

A profile gives its costs in one of three forms: ``"stages"``, a list with one cost entry per
pipeline stage (it must match ``--stages``); ``"layers"``, a list with one entry per layer; or
``"layer"`` with ``"num_layers"`` (identical layers). Layers are split into ``--stages`` equal
contiguous blocks (the layer count must divide evenly), as Megatron does by default. A cost
entry is ``{"forward_s": F, "backward_s": B, "weight_grad_s": W, "step_s": S}``, seconds per
microbatch of the profile's size (W and S optional, default 0; give W only when B is the
input-gradient part alone). A profile may carry its own ``"p2p_s"``. Without ``"profiles"``
the top-level object is the single profile. ``--micro-batch-size`` picks the profile when
there are several.

Outputs: the JSON object on stdout (the simulator's metrics plus the costs used);
``--timeline FILE`` writes the run in Chrome trace format (open it in https://ui.perfetto.dev
or chrome://tracing); ``--plot FILE.png`` draws a Gantt chart, one row per stage. Bad input
prints one line ``error: ...`` on stderr and exits with status 2.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.pipeline.schedules import SIMULATED_SCHEDULES  # noqa: E402
from megatron.pipeline.simulator import (  # noqa: E402
    SimulationResult,
    StageCosts,
    simulate,
    stage_costs_from_calibration,
)
from megatron.pipeline.trace import write_chrome_trace  # noqa: E402
from megatron.training.errors import UserError  # noqa: E402

DEFAULT_STEPS = 200
DEFAULT_COSTS = {"fwd": 1.0, "bwd": 2.0, "wgrad": 0.0, "step_cost": 0.0}
_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#c9a227", "S": "#c44e52"}
_LABEL_LIMIT = 80  # label boxes with their microbatch when a stage runs at most this many


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, no usage dump
        raise UserError(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", required=True, choices=sorted(SIMULATED_SCHEDULES))
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages N")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="microbatches per step (m; a for PACI)"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (schedule calls)"
    )
    parser.add_argument("--fwd", help="forward cost: a number or per-stage comma list")
    parser.add_argument("--bwd", help="backward cost (input gradient only when --wgrad is set)")
    parser.add_argument("--wgrad", help="weight-gradient cost (ZB-H1's W pass)")
    parser.add_argument("--step-cost", help="optimizer-step cost")
    parser.add_argument("--calibration", metavar="FILE.json", help="per-stage/layer costs")
    parser.add_argument("--micro-batch-size", type=int, help="calibration profile to use")
    parser.add_argument("--p2p", type=float, help="point-to-point latency per transfer")
    parser.add_argument("--timeline", metavar="FILE", help="write a Chrome trace")
    parser.add_argument("--plot", metavar="FILE.png", help="write a Gantt chart")
    return parser.parse_args(argv)


def parse_costs(text: str, name: str, num_stages: int) -> list[float]:
    """'2' or '1,1,3,1' -> one finite, non-negative number per stage."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--{name}: expected a number or a comma list, got {text!r}") from None
    if len(values) == 1:
        values *= num_stages
    if len(values) != num_stages:
        raise UserError(f"--{name}: {len(values)} values for {num_stages} stages")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise UserError(f"--{name}: costs must be finite and >= 0, got {text!r}")
    return values


def load_calibration(path: str, num_stages: int, micro_batch_size: int | None) -> StageCosts:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UserError(f"cannot read calibration {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"calibration {path} is not valid JSON: {e}") from None
    try:
        return stage_costs_from_calibration(data, num_stages, micro_batch_size)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def stage_costs(args: argparse.Namespace) -> StageCosts:
    flags = {"fwd": args.fwd, "bwd": args.bwd, "wgrad": args.wgrad, "step_cost": args.step_cost}
    if args.calibration:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        if given:
            raise UserError(f"give either --calibration or {', '.join(given)}, not both")
        return load_calibration(args.calibration, args.stages, args.micro_batch_size)
    if args.micro_batch_size is not None:
        raise UserError("--micro-batch-size selects a --calibration profile: give the file")
    costs = {
        k: parse_costs(str(DEFAULT_COSTS[k]) if v is None else v, k.replace("_", "-"), args.stages)
        for k, v in flags.items()
    }
    return StageCosts(costs["fwd"], costs["bwd"], costs["wgrad"], costs["step_cost"])


def check_counts(args: argparse.Namespace) -> None:
    counts = {"--stages": args.stages, "--microbatches": args.microbatches, "--steps": args.steps}
    for flag, value in counts.items():
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.p2p is not None and (not math.isfinite(args.p2p) or args.p2p < 0):
        raise UserError(f"--p2p must be finite and >= 0, got {args.p2p}")


def plot_gantt(result: SimulationResult, path: str) -> None:
    """A Gantt chart of the timeline: one row per stage, one box per action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = result.num_stages
    fig, ax = plt.subplots(figsize=(14, 0.5 * n + 1.5))
    per_stage = max((sum(1 for e in result.timeline if e.stage == s) for s in range(n)), default=0)
    for kind, color in _COLORS.items():
        for s in range(n):
            boxes = [
                (e.start_s, e.duration_s)
                for e in result.timeline
                if e.stage == s and e.action.kind.value == kind
            ]
            if boxes:
                ax.broken_barh(boxes, (s - 0.4, 0.8), facecolors=color, edgecolors="white")
    if per_stage <= _LABEL_LIMIT:
        for e in result.timeline:
            if e.action.microbatch is not None:
                x = e.start_s + e.duration_s / 2
                ax.text(x, e.stage, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n), [f"stage {s}" for s in range(n)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan or 1)
    ax.set_xlabel("time (s)")
    ax.set_title(
        f"{result.schedule}: N={n}, m={result.microbatches_per_step}, steps={result.steps}, "
        f"bubble {result.bubble_fraction:.3f}, throughput vs ideal {result.throughput_vs_ideal:.3f}",
        loc="right",
        fontsize=10,
    )
    kinds = {e.action.kind.value for e in result.timeline if e.duration_s > 0}
    names = {"F": "forward", "B": "backward", "W": "weight grad", "S": "optimizer step"}
    ax.legend(
        handles=[Patch(color=c, label=names[k]) for k, c in _COLORS.items() if k in kinds],
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=4,
        frameon=False,
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    check_counts(args)
    schedule = SIMULATED_SCHEDULES[args.schedule]
    costs = stage_costs(args)
    latency = args.p2p if args.p2p is not None else (costs.p2p_latency or 0.0)
    result = simulate(
        schedule,
        num_stages=args.stages,
        microbatches_per_step=args.microbatches,
        steps=args.steps,
        p2p_latency=latency,
        record_timeline=bool(args.timeline or args.plot),
        **costs.simulate_kwargs(),
    )
    report = result.to_dict()
    report["costs"] = {
        "forward": costs.forward,
        "backward": costs.backward,
        "weight_grad": costs.weight_grad,
        "step": costs.step,
        "p2p_latency": latency,
        "source": args.calibration or "flags",
    }
    try:
        if args.timeline:
            write_chrome_trace(args.timeline, result.timeline, process_name=args.schedule)
            report["timeline"] = args.timeline
        if args.plot:
            plot_gantt(result, args.plot)
            report["plot"] = args.plot
    except OSError as e:
        raise UserError(f"cannot write {e.filename}: {e.strerror or e}") from None
    return report


def main(argv=None) -> int:
    try:
        report = run(parse_args(argv))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
