"""What a run does when something outside the code goes wrong: errors on any rank, a stuck or
dead peer, a launcher that disappeared.

* `report_error`: every rank's error is printed, once per distinct message in the whole job
  (deduplicated through torch.distributed's store, or before the process group exists through
  torchrun's), with the rank that saw it.
* `apply_timeout_to_all_groups`: `--distributed-timeout-minutes` for every process group,
  including those megatron-core and the pipeline create with torch's 30-minute default.
* `watch_launcher`: workers end when torchrun itself dies (SIGKILL leaves them orphaned,
  and nothing else would stop them).
* `register_peers` / `end_stopped_peers`: a rank that timed out waiting for a peer kills the
  stopped processes of the job on its host, because a stopped process ignores the launcher's
  SIGTERM and the launcher waits 30 s more before its SIGKILL.
* `stop_on_interrupt`: Ctrl-C (SIGINT, which torchrun forwards to every worker) ends each rank
  with one line instead of a KeyboardInterrupt traceback from wherever it was, and the C++
  "terminate called" of its communication threads at interpreter exit.
"""

import contextlib
import datetime
import hashlib
import os
import signal
import socket
import sys
import threading

import torch.distributed as dist

_peers: dict[int, tuple[str, int]] = {}  # global rank -> (host, pid)
_watching = False


# ---------------------------------------------------------------------------- errors
def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _first_to_report(message: str) -> bool:
    """True on the first rank of the job to report `message` (best effort: when in doubt,
    print; a duplicate line is better than a lost one)."""
    key = hashlib.sha1(message.encode()).hexdigest()[:16]
    store = _job_store()
    if store is not None:
        try:
            store.add(_ANY_ERROR, 1)
            return store.add(f"{_ERROR_KEYS}/{key}", 1) == 1
        except Exception:  # the store's host is gone: print
            return True
    return True


# Per launch attempt: torchrun's store outlives a restart (--max-restarts).
_ERROR_KEYS = f"reported_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
_ANY_ERROR = f"{_ERROR_KEYS}/any"
_STORE_TIMEOUT = datetime.timedelta(seconds=5)
_launcher_store = None
_STOPPED_KEYS = f"stopped_rank/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _job_store():
    """The job's key-value store with a short timeout: torch.distributed's default store, or
    before the process group exists torchrun's own (its workers may join it as clients; no
    file is left behind). None without either."""
    global _launcher_store
    try:
        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        elif _launcher_store is None and os.environ.get("TORCHELASTIC_RUN_ID"):
            from megatron.training.launch import launch_environment, under_torchrun

            if not under_torchrun():
                return None
            _, world_size, address, port = launch_environment()
            _launcher_store = dist.TCPStore(address, port, world_size, is_master=False,
                                            timeout=_STORE_TIMEOUT)  # fmt: skip
            store = _launcher_store
        else:
            store = _launcher_store
        if store is not None:
            store.set_timeout(_STORE_TIMEOUT)
        return store
    except Exception:  # no store to reach: every rank prints
        return None


def another_rank_reported_an_error() -> bool:
    """Whether some rank already printed an error: a lost peer is then its consequence, and
    saying so on every other rank would bury the cause."""
    store = _job_store()
    try:
        return store is not None and store.check([_ANY_ERROR])
    except Exception:
        return False


def report_error(message: str) -> None:
    """`error: <message> (rank R)` on stderr, unless another rank already printed it."""
    if not _first_to_report(message):
        return
    rank = f"(rank {_rank()})"
    where = f" {rank}" if _world_size() > 1 and rank not in message else ""
    print_line(f"error: {message}{where}")


def print_line(text: str) -> None:
    """`text` and its newline on stderr, flushed at once: a signal handler's line must be out
    before it ends the process with os._exit (lines stay whole: `entry.whole_lines`)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------- timeouts
def apply_timeout_to_all_groups(minutes: int) -> None:
    """Set the timeout of every process group this rank belongs to (torch's private API, as
    megatron-core's `update_pg_timeout` uses it; if it changes, say so and go on)."""
    timeout = datetime.timedelta(minutes=minutes)
    c10d = dist.distributed_c10d
    try:
        for group in list(c10d._world.pg_map):
            if not c10d._rank_not_in_group(group):
                c10d._set_pg_timeout(timeout, group)
    except (AttributeError, RuntimeError, ValueError) as error:
        print(f"warning: could not set --distributed-timeout-minutes on every process group "
              f"({error}); groups created later keep torch's default", flush=True)  # fmt: skip


def register_peers() -> None:
    """Every rank's host, pid and pipeline stage (collective over the world; once, at set-up):
    a rank names a stopped peer of another pipeline by its stage too."""
    from megatron.core import parallel_state

    from megatron.pipeline import p2p

    gathered: list = [None] * dist.get_world_size()
    own = (socket.gethostname(), os.getpid(), parallel_state.get_pipeline_model_parallel_rank())
    dist.all_gather_object(gathered, own)
    _peers.clear()
    _peers.update((rank, (host, pid)) for rank, (host, pid, _) in enumerate(gathered))
    p2p.register_stages({rank: stage for rank, (_, _, stage) in enumerate(gathered)})


def _process_state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def end_stopped_peers() -> list[int]:
    """Kill the peers on this host whose process is stopped (SIGSTOP): a stopped process
    ignores the launcher's SIGTERM, and the launcher waits 30 s more before its SIGKILL.
    Returns the ranks found stopped by this rank or, before it, by another one (recorded in the
    job's store before the kill, so every rank that timed out names the same ones).
    (Linux /proc; elsewhere nothing is found.)"""
    here, store, ended = socket.gethostname(), _job_store(), set()
    for rank, (host, pid) in sorted(_peers.items()):
        if host == here and pid != os.getpid() and _process_state(pid) == "T":
            with contextlib.suppress(Exception):  # the store's host is gone: kill anyway
                store.set(f"{_STOPPED_KEYS}/{rank}", "1")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                ended.add(rank)
    with contextlib.suppress(Exception):
        ended.update(rank for rank in _peers if store.check([f"{_STOPPED_KEYS}/{rank}"]))
    return sorted(ended)


def timed_out(error: BaseException) -> bool:
    """Whether a failed collective or transfer gave up waiting (gloo's and NCCL's words)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


# ---------------------------------------------------------------------------- exit codes
def finish_on_our_own() -> None:
    """Every rank has decided to fail the run the same way (it diverged): ignore SIGTERM from
    here on. The first rank to exit makes torchrun SIGTERM the rest, which would end them with
    -15 instead of the exit code every rank is about to return."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------- Ctrl-C
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # the shell's convention for "ended by SIGINT"


class stop_on_interrupt:
    """While active, SIGINT prints one line and ends the process at once (os._exit: nothing
    runs after it, so no half-finished teardown prints). Checkpoints are written under
    temporary names and published by rename, so an interrupted save leaves the last one
    intact."""

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._stop)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    @staticmethod
    def _stop(signum, frame) -> None:
        print_line(f"error: interrupted (SIGINT): rank {_rank()} stops; checkpoints already "
                   "saved are intact, the iterations since the last one are lost")  # fmt: skip
        os._exit(INTERRUPTED_EXIT_CODE)


# ---------------------------------------------------------------------------- the launcher
def watch_launcher(poll_s: float = 1.0) -> None:
    """Under torchrun, end this worker when its launcher is gone (re-parented)."""
    global _watching
    if _watching or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _watching = True
    launcher = os.getppid()
    thread = threading.Thread(target=_watch, args=(launcher, poll_s), daemon=True)
    thread.start()


def _watch(launcher: int, poll_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll_s):
        if os.getppid() != launcher:
            # No deduplication: the store lived in the launcher.
            print_line(f"error: the launcher (pid {launcher}) is gone; rank {_rank()} stops")
            os._exit(1)
