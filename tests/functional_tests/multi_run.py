"""Several pretraining cases one after another in one process group: a torchrun target, or
its own launcher.

Importing torch and megatron-core costs ~5 CPU-seconds per process on a small machine;
starting one process group per case would spend most of the test time there. Each case gets
fresh model-parallel groups (pretrain destroys them at the end), so cases do not see each
other's state.

    torchrun --nproc-per-node 4 tests/functional_tests/multi_run.py CASES.json
    python tests/functional_tests/multi_run.py --nproc-per-node 4 CASES.json

The second form runs torch's elastic agent (what torchrun runs) in this process and forks the
workers from it after the imports: they share the imported modules instead of paying for them
each (the functional case batch launches this way: a 40-case launch of 4 ranks took 130
CPU-seconds so, against 160 under torchrun).
CASES.json: [{"name": ..., "args": [...flags...], "metrics_dir": ..., "forward_step": None
or "module.function" (instead of pretrain_gpt's), "expect_exit": None or the exit code the case
must end with (written to metrics_dir/exit_code.txt; the next case goes on)}, ...]
"""

import argparse
import importlib
import json
import os
import resource
import sys
import time
import uuid

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
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        args = parse_args(case["args"] + ["--metrics-dir", case["metrics_dir"]])
        try:
            pretrain(args, _forward_step(case.get("forward_step")))
        except RunFailed as failure:
            if case.get("expect_exit") != failure.exit_code:
                raise
            # a rank that fails early can get here before any rank made the directory
            os.makedirs(case["metrics_dir"], exist_ok=True)
            with open(os.path.join(case["metrics_dir"], "exit_code.txt"), "w") as file:
                file.write(str(failure.exit_code))
        _record_cost(case, time.perf_counter() - started, _cpu_seconds() - cpu_started)
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _record_cost(case: dict, wall_s: float, cpu_s: float) -> None:
    """Each rank's wall and CPU seconds for the case, one JSON line in the case's metrics
    directory (case_cost.jsonl: what the suite's time goes to, case by case)."""
    line = {"rank": dist.get_rank(), "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3)}
    os.makedirs(case["metrics_dir"], exist_ok=True)
    with open(os.path.join(case["metrics_dir"], "case_cost.jsonl"), "a") as file:
        file.write(json.dumps(line) + "\n")


def _forward_step(name: str | None):
    if not name:
        return forward_step
    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), function)


def launch(cases_file: str, nproc: int) -> int:
    """Run the cases on `nproc` local workers that torch's elastic agent forks from this
    process (torchrun --standalone's rendezvous, no restarts). A failed worker's error is
    printed and the exit code is 1, as torchrun's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork")  # fmt: skip
    sys.stdout.flush()  # or the workers would print this process's buffered lines again
    sys.stderr.flush()
    try:
        elastic_launch(config, main)(cases_file)
    except ChildFailedError as failure:
        print(failure.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:  # a worker that torchrun started
        sys.exit(main(sys.argv[1]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("cases_file")
    options = parser.parse_args()
    sys.exit(launch(options.cases_file, options.nproc_per_node))
