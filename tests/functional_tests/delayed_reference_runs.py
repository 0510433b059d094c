"""Run `megatron.studies.delayed_reference` for several cases in one process.

    python tests/functional_tests/delayed_reference_runs.py SPEC.json
SPEC.json: [{"name": ..., "args": [...pretrain_gpt.py flags...], "delay": 0|1}, ...]
prints one JSON object on its last line: {name: [lm loss per iteration]}.

The functional tests call `run_in_subprocess(spec, directory)`, which does the above in a fresh
process and returns that object.
"""

import json
import os
import subprocess
import sys


def main(spec_file: str) -> int:
    import torch

    from megatron.studies.delayed_reference import parse_reference_args, run_delayed

    torch.set_num_threads(1)
    losses = {}
    for case in json.load(open(spec_file)):
        args = parse_reference_args(case["args"])
        losses[case["name"]] = run_delayed(args, delay=case["delay"], evaluate=False).losses
    print(json.dumps(losses))
    return 0


def run_in_subprocess(spec: list[dict], directory: str) -> dict[str, list[float]]:
    """Writes `spec` to DIRECTORY/spec.json, runs this script on it in a fresh one-thread
    process (no torch.distributed state or threads shared with the caller) and returns
    {name: [lm loss per iteration]}."""
    spec_file = os.path.join(directory, "spec.json")
    with open(spec_file, "w") as handle:
        json.dump(spec, handle)
    completed = subprocess.run(
        [sys.executable, os.path.abspath(__file__), spec_file],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"delayed_reference_runs.py failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
