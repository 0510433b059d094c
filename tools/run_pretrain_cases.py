"""torchrun target: several pretraining runs one after another in one process group.

Importing torch and megatron-core costs ~8 s per process on a small machine; one launch for many
runs pays it once. Each case gets fresh model-parallel groups (pretrain destroys them at the
end). Used by `tools/real_compute_benchmark.py`.

    torchrun --nproc-per-node 2 tools/run_pretrain_cases.py CASES.json [--pin-cores]
CASES.json: [{"name": ..., "args": [...flags...], "metrics_dir": ...}, ...]
"""

import json
import os
import sys

import torch.distributed as dist

from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from pretrain_gpt import forward_step  # installed beside megatron (setup.py py_modules)


def main(cases_file: str, pin_cores: bool = False) -> int:
    with open(cases_file) as f:
        cases = json.load(f)
    if pin_cores:  # one process per core: local rank r on core r
        os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    dist.init_process_group("gloo")
    for case in cases:
        if dist.get_rank() == 0:
            print(f"=== case {case['name']}", flush=True)
        args = parse_args(case["args"] + ["--metrics-dir", case["metrics_dir"]])
        pretrain(args, forward_step)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--pin-cores" in sys.argv[2:]))
