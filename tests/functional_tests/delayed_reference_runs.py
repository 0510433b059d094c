"""Run `megatron.training.delayed_reference` for several cases in one process.

    python tests/functional_tests/delayed_reference_runs.py SPEC.json
SPEC.json: [{"name": ..., "args": [...pretrain_gpt.py flags...], "delay": 0|1}, ...]
prints one JSON object on its last line: {name: [lm loss per iteration]}.
"""

import json
import os
import sys


def main(spec_file: str) -> int:
    import torch

    from megatron.training.delayed_reference import parse_reference_args, run_delayed

    torch.set_num_threads(1)
    losses = {}
    for case in json.load(open(spec_file)):
        args = parse_reference_args(case["args"])
        losses[case["name"]] = run_delayed(args, delay=case["delay"], evaluate=False).losses
    print(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
