"""Emulated-compute schedule benchmark: the real runtime against the simulator's prediction.

Launches `pretrain_gpt.py` through torchrun once per schedule with emulated compute and compares
each run's steady-state throughput with the simulator's prediction from the run's own trace;
`megatron.pipeline.simulation.emulation` does the work and defines every figure. Prints one
JSON object (also written to ``OUTPUT/report.json``).

    python tools/benchmark_schedules.py --stages 4 --microbatches 8 --fwd-ms 50 --bwd-ms 100
"""

import argparse
import json
import sys

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.simulation.emulation import benchmark
from megatron.pipeline.simulation.results import steady_state_window


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True, help="m per step (a for PACI)")
    parser.add_argument("--fwd-ms", type=float, required=True, help="emulated forward, ms")
    parser.add_argument("--bwd-ms", type=float, required=True, help="emulated backward, ms")
    parser.add_argument("--steps", type=int, default=8, help="training iterations per run")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per schedule; the median run is reported"
    )
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "paci"])
    parser.add_argument(
        "--p2p-ms",
        type=float,
        default=None,
        help="p2p latency for the simulator, ms (default: measured from each run's trace)",
    )
    parser.add_argument("--output", default=None, help="directory for logs, traces, summaries")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    options = parser.parse_args(argv)
    if options.stages < 2 or options.microbatches < 1:
        parser.error("--stages must be >= 2 and --microbatches >= 1")
    if options.repeats < 1:
        parser.error("--repeats must be >= 1")
    if options.fwd_ms <= 0 or options.bwd_ms <= 0:
        parser.error("--fwd-ms and --bwd-ms must be > 0")
    try:
        steady_state_window(options.stages, options.microbatches, options.steps)
    except ValueError as error:
        parser.error(str(error))
    for schedule in options.schedules:
        try:
            get_schedule(schedule)
        except ValueError as error:
            parser.error(str(error))
    return options


def main(argv=None) -> int:
    report = benchmark(parse_args(argv))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
