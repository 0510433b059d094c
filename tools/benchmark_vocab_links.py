"""The vocabulary split's tree against the fan over emulated per-rank links, measured and
replayed by the simulator (`megatron/benchmarks/vocab_links.py`; docs/vocab_parallel_pace.md).

    python tools/benchmark_vocab_links.py --link-gbs 0.1 --unpaced-embedding --output runs/vl
"""

import argparse
import json

from megatron.benchmarks.vocab_links import benchmark


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--stages", type=int, default=8)
    add("--microbatches", type=int, default=8)
    add("--steps", type=int, default=5)
    add("--fwd-ms", type=float, default=20.0)
    add("--bwd-ms", type=float, default=40.0)
    add("--vocab-fwd-ms", type=float, default=5.0)
    add("--vocab-bwd-ms", type=float, default=3.0)
    add("--hidden-size", type=int, default=256)
    add("--seq-length", type=int, default=1024)
    add("--micro-batch-size", type=int, default=1)
    add("--link-gbs", type=float, default=0.1, help="each rank's link, GB/s")
    add("--link-latency-us", type=float, default=50.0)
    add("--unpaced-embedding", action="store_true",
        help="the input embedding's messages (a fan whatever the tree) bypass the links")  # fmt: skip
    add("--base-latency-ms", type=float, default=0.0,
        help="the backend's own time per message, added in the replay")  # fmt: skip
    add("--schedules", nargs="+", default=["paci", "1f1b"])
    add("--arities", nargs="+", default=["2", "fan"])
    add("--timeout", type=float, default=600.0)
    add("--output", default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(benchmark(parse()), indent=2))
