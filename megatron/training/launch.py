"""Joining the job: the launch environment checked, and a rendezvous that ends in one line.

torch's `env://` rendezvous turns launch mistakes into tracebacks or long waits: a `RANK`
outside the world waits for a server that never answers, a `WORLD_SIZE` larger than the
processes started waits for clients that never come, a `MASTER_PORT` in use raises
`EADDRINUSE` from C++. Here the variables are checked first (each mistake named with its
fix), and without torchrun the ranks meet through a store of our own whose server does not wait
for its clients: every rank counts itself in, so the wait ends after `timeout_s` with how many
processes came. Under torchrun the launcher already started every worker and hosts the store;
the workers join it as `env://` does.
"""

import datetime
import os
import socket
import time

import torch.distributed as dist

from megatron.common.errors import UserError

_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_HOW = "launch with torchrun (it sets them) or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
_JOIN_POLL_S = 0.05


def under_torchrun(environ=os.environ) -> bool:
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def launch_environment(environ=os.environ) -> tuple[int, int, str, int]:
    """(rank, world size, master address, master port) from the environment, or a UserError
    naming the variable that is missing or wrong and how to fix it."""
    missing = [name for name in _VARIABLES if not environ.get(name)]
    if missing:
        raise UserError(f"{', '.join(missing)} not set: {_HOW}")
    rank, world_size, port = (
        _integer(environ, name) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")
    )
    if world_size < 1:
        raise UserError(f"WORLD_SIZE={world_size}: the number of processes must be at least 1")
    if not 0 <= rank < world_size:
        raise UserError(
            f"RANK={rank} is outside the world: WORLD_SIZE={world_size} has ranks 0 to "
            f"{world_size - 1} (each process needs its own RANK below WORLD_SIZE)"
        )
    if not 0 < port < 2**16:
        raise UserError(f"MASTER_PORT={port}: a TCP port is between 1 and 65535")
    address = environ["MASTER_ADDR"]
    try:
        socket.getaddrinfo(address, port)
    except OSError as error:
        raise UserError(
            f"MASTER_ADDR={address} cannot be resolved ({error.strerror or error}): set it to "
            "the host name or address of the machine that runs rank 0"
        ) from None
    return rank, world_size, address, port


def _integer(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise UserError(f"{name}={environ[name]!r} is not an integer: {_HOW}") from None


def init_process_group(backend: str, timeout: datetime.timedelta, startup_timeout_s: float):
    """`torch.distributed.init_process_group` for this process, after the checks above; a
    rendezvous that does not complete within `startup_timeout_s` ends in a UserError."""
    rank, world_size, address, port = launch_environment()
    where = f"{address}:{port}"
    if under_torchrun():
        store = _agent_store(address, port, world_size, startup_timeout_s, where)
    else:
        store = _own_store(rank, world_size, address, port, startup_timeout_s, where)
    store.set_timeout(timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)  # fmt: skip


def _agent_store(address, port, world_size, timeout_s, where):
    try:
        return dist.TCPStore(address, port, world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    except (RuntimeError, dist.DistError) as error:
        raise UserError(
            f"cannot reach torchrun's store at {where} within {timeout_s:.0f} s "
            f"({_first_line(error)})"
        ) from None


def _own_store(rank, world_size, address, port, timeout_s, where):
    """Rank 0 serves the store, without waiting for clients; every rank adds itself to a
    count (and claims its RANK), then waits until the count is the world size."""
    deadline = time.monotonic() + timeout_s
    try:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=True)  # fmt: skip
    except (RuntimeError, dist.DistError) as error:
        raise UserError(_store_problem(rank, where, timeout_s, error)) from None
    if store.add(f"megatron/launch/rank/{rank}", 1) > 1:
        raise UserError(
            f"RANK={rank} was started twice: give each of the WORLD_SIZE={world_size} "
            "processes its own RANK"
        )
    joined = store.add("megatron/launch/joined", 1)
    while joined < world_size and time.monotonic() < deadline:
        time.sleep(_JOIN_POLL_S)
        try:
            joined = store.add("megatron/launch/joined", 0)
        except (RuntimeError, dist.DistError):  # rank 0 gave up first and closed the store
            break
    if joined < world_size:
        raise UserError(
            f"only {joined} of WORLD_SIZE={world_size} processes joined the rendezvous at "
            f"{where} within {timeout_s:.0f} s: start {world_size} processes, or set "
            f"WORLD_SIZE to the number started"
        )
    if joined > world_size:
        raise UserError(
            f"{joined} processes joined the rendezvous at {where}, more than "
            f"WORLD_SIZE={world_size}: another job may use MASTER_PORT={port}"
        )
    return store


def _store_problem(rank: int, where: str, timeout_s: float, error: BaseException) -> str:
    text = str(error)
    port = where.rsplit(":", 1)[1]
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"MASTER_PORT={port} is already in use on this host: choose a free port "
            "(the same MASTER_PORT for every process)"
        )
    if rank == 0:
        return f"cannot serve the rendezvous at {where} ({_first_line(error)})"
    return (
        f"rank 0's rendezvous at {where} did not answer within {timeout_s:.0f} s: start rank 0, "
        "and give every process the same MASTER_ADDR and MASTER_PORT"
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__
