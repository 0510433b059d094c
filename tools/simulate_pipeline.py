"""Simulate a pipeline schedule and print what it does with given stage costs, as one JSON object.

The event engine (`megatron.pipeline.simulation.engine`) runs the very schedule definitions the
runtime runs; its docstring gives the execution model, `results` the meaning of every metric.

Examples::

    python tools/simulate_pipeline.py --schedule 1f1b --stages 8 --microbatches 8
    python tools/simulate_pipeline.py --schedule paci --stages 8 --microbatches 4 \\
        --fwd 1,1,1,3,1,1,1,1 --bwd 2 --timeline paci.json --plot paci.png
    python tools/simulate_pipeline.py --schedule zb-h1 --stages 4 --microbatches 8 \\
        --fwd 1 --bwd 1 --wgrad 1
    python tools/simulate_pipeline.py --schedule paci --stages 8 --microbatches 8 \\
        --calibration calib.json --micro-batch-size 4
    python tools/simulate_pipeline.py --schedule paci --stages 4 --microbatches 2 \\
        --paci-inflight-limit flush
    python tools/simulate_pipeline.py --schedule interleaved-1f1b --stages 8 --microbatches 16 \\
        --virtual-stages 4 --fwd 0.25 --bwd 0.5
    python tools/simulate_pipeline.py --schedule zb-v --stages 8 --microbatches 16 \\
        --fwd 1 --bwd 1 --wgrad 1
    python tools/simulate_pipeline.py --schedule zb-interleaved --stages 8 --microbatches 8 \\
        --steps 1 --fwd 0.5 --bwd 0.5 --wgrad 0.5

Costs are durations in seconds (any unit works; ``microbatches_per_second`` is then per that
unit): ``--fwd`` per forward, ``--bwd`` per backward, ``--wgrad`` per weight-gradient pass,
``--step-cost`` per optimizer step, each one number for every stage or a comma list with one
number per stage. Schedules without a split backward pay ``bwd + wgrad`` per backward; ZB-H1
runs B (input gradient, ``--bwd``) and W (weight gradient, ``--wgrad``) separately.
``--microbatches`` is m per step for the flush schedules and the accumulation factor a for PACI
(and 2BW); a step is one call of the schedule, i.e. one training iteration.

Schedules with virtual stages (interleaved-1f1b, zb-v, dualpipe-v, zb-interleaved) run
``--virtual-stages v`` model chunks on each of the ``--stages`` ranks (default 2; ZB-V and
DualPipeV take exactly 2).
Their ``--fwd``/``--bwd``/``--wgrad`` are per chunk pass (one number, or N * v values by
virtual stage; the same model as a 1F1B run with F costs F/v per chunk), ``--step-cost`` per
rank, and the report adds ``virtual_stages``: the placement, ``bubble_over_ideal`` (idle over
compute time) and the peak activations per rank in chunks and in whole-stage units.

``--calibration FILE.json`` reads the costs from a calibration file instead (its format:
`megatron.benchmarks.calibration_file`; ``--micro-batch-size`` picks its profile).

Outputs: the JSON object on stdout (the simulator's metrics plus the costs used);
``--timeline FILE`` writes the run in Chrome trace format (open it in https://ui.perfetto.dev
or chrome://tracing); ``--plot FILE.png`` draws a Gantt chart, one row per stage. Bad input
prints one line ``error: ...`` on stderr and exits with status 2.
"""

import argparse
import json
import math
import sys

from megatron.benchmarks.calibration_file import load_stage_costs
from megatron.benchmarks.gantt import plot_gantt
from megatron.common.errors import UserError, run_tool
from megatron.pipeline.schedules import SIMULATED_SCHEDULES, paci
from megatron.pipeline.simulation import StageCosts, simulate
from megatron.pipeline.simulation.costs import parse_stage_costs
from megatron.pipeline.trace import write_chrome_trace

DEFAULT_STEPS = 200
DEFAULT_COSTS = {"fwd": 1.0, "bwd": 2.0, "wgrad": 0.0, "step_cost": 0.0}


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
    parser.add_argument("--paci-arrival-rule", choices=list(paci.ARRIVAL_RULES),
                        help="PACI's arrival rule (as in training)")  # fmt: skip
    parser.add_argument("--paci-inflight-limit", choices=list(paci.INFLIGHT_LIMITS),
                        help="PACI's in-flight window: depth (N - s) or flush (min(N - s, m))")  # fmt: skip
    parser.add_argument("--paci-deferred-step", type=int, nargs="?", const=0, default=None,
                        metavar="D", help="PACI: each update lands before the stage's D-th "
                        "backward after its step (without D: the next step's last)")  # fmt: skip
    parser.add_argument("--virtual-stages", type=int, metavar="V",
                        help="model chunks per rank (schedules with virtual stages)")  # fmt: skip
    return parser.parse_args(argv)


def chunks_per_rank(args: argparse.Namespace) -> int:
    """--virtual-stages, checked against the schedule (1: a schedule without virtual stages)."""
    schedule = SIMULATED_SCHEDULES[args.schedule]
    if schedule.placement is None:
        if args.virtual_stages not in (None, 1):
            raise UserError(f"--virtual-stages applies to schedules with model chunks "
                            f"(interleaved-1f1b, zb-v, dualpipe-v, zb-interleaved), not "
                            f"{args.schedule}")  # fmt: skip
        return 1
    v = schedule.default_chunks_per_rank if args.virtual_stages is None else args.virtual_stages
    if v < 1:
        raise UserError(f"--virtual-stages must be at least 1, got {v}")
    return v


def stage_costs(args: argparse.Namespace, chunks: int = 1) -> StageCosts:
    flags = {"fwd": args.fwd, "bwd": args.bwd, "wgrad": args.wgrad, "step_cost": args.step_cost}
    if args.calibration:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        if given:
            raise UserError(f"give either --calibration or {', '.join(given)}, not both")
        if chunks > 1:
            raise UserError("--calibration gives per-stage costs; with virtual stages give "
                            "--fwd/--bwd/--wgrad per chunk")  # fmt: skip
        return load_stage_costs(args.calibration, args.stages, args.micro_batch_size)
    if args.micro_batch_size is not None:
        raise UserError("--micro-batch-size selects a --calibration profile: give the file")
    counts = {"fwd": args.stages * chunks, "bwd": args.stages * chunks,
              "wgrad": args.stages * chunks, "step_cost": args.stages}  # fmt: skip
    costs = {
        k: parse_stage_costs(
            str(DEFAULT_COSTS[k]) if v is None else v, k.replace("_", "-"), counts[k]
        )
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


def run(args: argparse.Namespace) -> dict:
    check_counts(args)
    try:
        schedule = paci.with_paci_options(
            SIMULATED_SCHEDULES[args.schedule], args.paci_arrival_rule, args.paci_inflight_limit
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    chunks = chunks_per_rank(args)
    deferred = args.paci_deferred_step
    if deferred is not None and (args.schedule != "paci" or chunks != 1):
        raise UserError("--paci-deferred-step applies to --schedule paci (one chunk per rank)")
    if deferred is not None and not 0 <= deferred <= args.microbatches:
        raise UserError(f"--paci-deferred-step D needs 1 <= D <= --microbatches, got {deferred}")
    deferred = False if deferred is None else (args.microbatches if deferred == 0 else deferred)
    costs = stage_costs(args, chunks)
    latency = args.p2p if args.p2p is not None else (costs.p2p_latency or 0.0)
    virtual = {} if schedule.placement is None else {"chunks_per_rank": chunks}
    result = simulate(
        schedule,
        num_stages=args.stages,
        microbatches_per_step=args.microbatches,
        steps=args.steps,
        p2p_latency=latency,
        record_timeline=bool(args.timeline or args.plot),
        deferred_step=deferred,
        **virtual,
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
    sys.exit(run_tool(main))
