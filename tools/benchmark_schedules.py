"""Emulated-compute schedule benchmark: the real runtime against the simulator's prediction.

Launches `pretrain_gpt.py` through torchrun once per schedule with emulated compute and compares
each run's steady-state throughput with the simulator's prediction from the run's own trace;
`megatron.benchmarks.emulated_benchmark` does the work and defines every figure. Prints one
JSON object (also written to ``OUTPUT/report.json``).

    python tools/benchmark_schedules.py --stages 4 --microbatches 8 --fwd-ms 50 --bwd-ms 100
    python tools/benchmark_schedules.py --stages 4 --microbatches 4 --fwd-ms 20,40,20,20 \
        --bwd-ms 40,80,40,40 --noise-cv 0.2 --schedules 1f1b paci paci:backward-first
    python tools/benchmark_schedules.py --stages 4 --virtual-stages 2 --microbatches 8 \
        --fwd-ms 10 --bwd-ms 20      # interleaved 1F1B and PACI over virtual stages

With ``--model NAME`` every schedule runs on that model's own per-virtual-stage costs (the
comparison's FLOP model, split backward included) and the report tabulates them side by side
(`megatron.benchmarks.runtime_comparison`); ``--markdown`` prints only that table:

    python tools/benchmark_schedules.py --model gpt2-medium --microbatches 16 --ms-per-layer 2 \
        --schedules 1f1b interleaved-1f1b zb-h1 zb-v dualpipe-v 2bw paci paci-interleaved
"""

import argparse
import json
import sys

from megatron.benchmarks.comparison import MODELS
from megatron.benchmarks.emulated_benchmark import (
    benchmark,
    has_noise,
    schedule_and_rule,
    simulated_definition,
)
from megatron.benchmarks.runtime_comparison import RUNTIME_NAMES, compare_in_runtime
from megatron.common.errors import run_tool
from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import with_paci_options
from megatron.pipeline.simulation.costs import stage_values
from megatron.pipeline.simulation.results import steady_state_window


def parse_model_args(argv) -> argparse.Namespace:
    """--model: every schedule on one model's costs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--microbatches", type=int, required=True, help="m per step (a for PACI)")
    parser.add_argument("--ms-per-layer", type=float, default=2.0, help="one layer's forward, ms")
    parser.add_argument("--steps", type=int, default=8, help="training iterations per run")
    parser.add_argument("--schedules", nargs="+", default=list(RUNTIME_NAMES),
                        choices=list(RUNTIME_NAMES))  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="print only the table")
    parser.add_argument("--output", default=None, help="directory for logs, traces, summaries")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    options = parser.parse_args(argv)
    if options.ms_per_layer <= 0 or options.microbatches < 1 or options.steps < 4:
        parser.error("--ms-per-layer must be > 0, --microbatches >= 1 and --steps >= 4")
    return options


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True, help="m per step (a for PACI)")
    parser.add_argument(
        "--fwd-ms", type=stage_values, required=True, help="emulated forward, ms (or per stage)"
    )
    parser.add_argument(
        "--bwd-ms", type=stage_values, required=True, help="emulated backward, ms (or per stage)"
    )
    parser.add_argument(
        "--noise-cv", type=stage_values, default=0.0, help="lognormal CV per action (or per stage)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="seeds the noise draws")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="model chunks per rank (costs per chunk)"
    )
    parser.add_argument("--steps", type=int, default=8, help="training iterations per run")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per schedule; the median run is reported"
    )
    parser.add_argument(
        "--schedules", nargs="+", default=["1f1b", "paci"], help="paci:RULE: an arrival rule"
    )
    parser.add_argument(
        "--p2p-ms",
        type=float,
        default=None,
        help="p2p latency for the simulator, ms (default: measured from each run's trace)",
    )
    parser.add_argument("--output", default=None, help="directory for logs, traces, summaries")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    options = parser.parse_args(argv)
    _check_options(parser, options)
    return options


def _check_options(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Refuse what the benchmark cannot run, before launching anything."""
    if options.stages < 2 or options.microbatches < 1:
        parser.error("--stages must be >= 2 and --microbatches >= 1")
    if options.repeats < 1:
        parser.error("--repeats must be >= 1")
    if options.virtual_stages < 1:
        parser.error("--virtual-stages must be >= 1")
    count = options.stages * options.virtual_stages  # costs per (virtual) stage
    if options.virtual_stages > 1 and has_noise(options.noise_cv):
        parser.error("--noise-cv with --virtual-stages is not supported yet")
    for flag in ("fwd_ms", "bwd_ms", "noise_cv"):
        values = getattr(options, flag)
        values = values if isinstance(values, list) else [values] * count
        if len(values) != count:
            each = "virtual stage" if options.virtual_stages > 1 else "stage"
            parser.error(f"--{flag.replace('_', '-')}: one value, or one per {each} ({count})")
        if flag != "noise_cv" and min(values) <= 0:
            parser.error("--fwd-ms and --bwd-ms must be > 0")
    try:
        steady_state_window(options.stages, options.microbatches, options.steps)
    except ValueError as error:
        parser.error(str(error))
    for schedule in options.schedules:
        name, rule = schedule_and_rule(schedule)
        try:
            with_paci_options(get_schedule(name), rule)
            if options.virtual_stages > 1:
                simulated_definition(schedule, options.virtual_stages)
        except ValueError as error:
            parser.error(
                f"{error} is not supported yet" if options.virtual_stages > 1 else str(error)
            )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--model" in argv:
        options = parse_model_args(argv)
        report = compare_in_runtime(options)
        print(report["table_markdown"] if options.markdown else json.dumps(report, indent=2))
        return 0
    report = benchmark(parse_args(argv))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
