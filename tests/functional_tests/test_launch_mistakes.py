"""Launch mistakes without torchrun (RANK, WORLD_SIZE and the MASTER_* variables set by hand, as
under Slurm's srun): each ends on every process that sees it in one `error:` line naming the
variable, with exit status 2, within the rendezvous timeout and no traceback. The processes of
all cases start at once (one import wait for the lot)."""

import os
import socket
import subprocess
import sys
import time

import pytest
from test_faults import MOCK, REPO, our_errors, worker_traceback

TIMEOUT_S = 10
ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "2", "--eval-iters", "0", "--lr", "1e-4",
    "--rendezvous-timeout-seconds", str(TIMEOUT_S), *MOCK,
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(rank: int, world_size: int, port: int) -> subprocess.Popen:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        environ.pop(name, None)
    return subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *ARGS],
                            cwd=REPO, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def outcomes():
    """case -> [(exit status, output, seconds)] per process of the case."""
    busy = socket.socket()  # another program's server on the port
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = {
        "rank outside the world": [(3, 2, _free_port())],
        "world larger than started": [(0, 4, port := _free_port()), (1, 4, port)],
        "port in use": [(0, 1, busy.getsockname()[1])],
    }
    started = time.time()
    processes = {name: [_start(*spec) for spec in specs] for name, specs in cases.items()}
    results = {}
    try:
        for name, group in processes.items():
            results[name] = []
            for process in group:
                output, _ = process.communicate(timeout=120)
                results[name].append((process.returncode, output, time.time() - started))
    finally:
        for group in processes.values():
            for process in group:
                process.kill()
        busy.close()
    return results


def _one_line_each(results, expected: str) -> None:
    for code, output, _seconds in results:
        errors = our_errors(output)
        assert code == 2 and len(errors) == 1, (code, output[-3000:])
        assert expected in errors[0], errors
        assert not worker_traceback(output), output[-3000:]
        assert "> world size" not in output, output[-3000:]  # stopped before any set-up


def test_a_rank_outside_the_world_is_named(outcomes):
    _one_line_each(outcomes["rank outside the world"],
                   "RANK=3 is outside the world: WORLD_SIZE=2 has ranks 0 to 1")  # fmt: skip


def test_a_world_larger_than_the_processes_started_ends_within_the_timeout(outcomes):
    results = outcomes["world larger than started"]
    _one_line_each(results, "only 2 of WORLD_SIZE=4 processes joined the rendezvous")
    assert all(seconds >= TIMEOUT_S for _, _, seconds in results)  # it did wait for them


def test_a_port_in_use_is_named(outcomes):
    _one_line_each(outcomes["port in use"], "is already in use on this host: choose a free port")


def test_an_error_before_the_process_group_is_printed_once_and_leaves_nothing(tmp_path):
    """A flag error under torchrun: every worker sees it before any process group exists; it
    is printed once for the job (deduplicated through torchrun's store) and no marker file
    is left in the temp folder."""
    from test_faults import SMALL, TORCHRUN

    environ = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "4",
               os.path.join(REPO, "pretrain_gpt.py"), *SMALL, *MOCK, "--train-iters", "2",
               "--lr", "-1"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = our_errors(output)
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith("error: --lr must be a number >= 0, got -1.0 (rank "), errors
    assert not [name for name in os.listdir(tmp_path) if name.startswith("megatron-errors")]
