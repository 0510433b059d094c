"""torchrun target that runs several pretraining cases one after another in one process group.

Importing torch and megatron-core costs ~8 s per process on a small machine; starting one
process group per case would spend most of the test time there. Each case gets fresh model-
parallel groups (pretrain destroys them at the end), so cases do not see each other's state.

    torchrun --nproc-per-node 4 tests/functional_tests/multi_run.py CASES.json
CASES.json: [{"name": ..., "args": [...flags...], "metrics_dir": ..., "forward_step": None
or "module.function" (instead of pretrain_gpt's), "expect_exit": None or the exit code the case
must end with (written to metrics_dir/exit_code.txt; the next case goes on)}, ...]
"""

import importlib
import json
import os
import sys

import torch.distributed as dist

from megatron.common.errors import RunFailed
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from pretrain_gpt import forward_step  # installed beside megatron (setup.py py_modules)


def main(cases_file: str) -> int:
    cases = json.load(open(cases_file))
    dist.init_process_group("gloo")
    for case in cases:
        if dist.get_rank() == 0:
            print(f"=== case {case['name']}", flush=True)
        args = parse_args(case["args"] + ["--metrics-dir", case["metrics_dir"]])
        try:
            pretrain(args, _forward_step(case.get("forward_step")))
        except RunFailed as failure:
            if case.get("expect_exit") != failure.exit_code:
                raise
            with open(os.path.join(case["metrics_dir"], "exit_code.txt"), "w") as file:
                file.write(str(failure.exit_code))
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _forward_step(name: str | None):
    if not name:
        return forward_step
    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), function)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
