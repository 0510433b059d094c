"""Gloo groups made inside `shared_gloo_device()` share one transport device (one event-loop
thread a process) and still reduce (megatron/distributed/gloo_device.py). In a subprocess: it
sets up torch.distributed's world."""

import json
import subprocess
import sys

SCRIPT = """
import json, os, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from megatron.distributed.gloo_device import shared_gloo_device

def threads():
    return len(os.listdir("/proc/self/task"))

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = threads()
own = [dist.new_group([0]) for _ in range(8)]
after_own = threads()
with shared_gloo_device():
    shared = [dist.new_group([0]) for _ in range(8)]
    with shared_gloo_device():  # nested: the same device
        shared.append(dist.new_group([0]))
after_shared = threads()
values = []
for group in own + shared:
    x = torch.full((3,), 2.0)
    dist.all_reduce(x, group=group)
    values.append(x.tolist())
backend = shared[0]._get_backend(torch.device("cpu"))
print(json.dumps({"own": after_own - before, "shared": after_shared - after_own,
                  "values": values, "is_gloo": isinstance(backend, dist.ProcessGroupGloo),
                  "restored": c10d.ProcessGroupGloo is torch._C._distributed_c10d.ProcessGroupGloo}))
# as a run ends (training.py's _destroy_groups_since): the groups gone before the interpreter,
# whose teardown with live gloo worker threads aborted once in a make test ("terminate called
# without an active exception")
dist.destroy_process_group()
"""


def test_groups_made_inside_share_one_device_and_reduce():
    completed = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    # torch's own groups: two worker threads and an event loop each; shared: the two workers,
    # and one loop for all nine
    assert result["own"] == 3 * 8
    assert result["shared"] == 2 * 9 + 1
    assert result["values"] == [[2.0, 2.0, 2.0]] * 17
    assert result["is_gloo"] and result["restored"]
