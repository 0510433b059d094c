"""One writer per `--save` directory, for the life of the run.

Two jobs saving into one directory would both report every save and leave only the second
one's checkpoints. So global rank 0 takes an advisory lock (`flock`) on `DIR/.writer.lock` at
start-up and keeps it until the run ends, and writes an owner record beside it
(`DIR/.writer.json`: host, pid, Slurm job id, start time, the run's id). A second job finds the
lock held and stops with one line naming the owner. The kernel drops the lock of a process
that died, so a lock left behind is simply taken again (the old owner record is named in a
message). Where the file system does not honour `flock` (some network file systems), the owner
record is what protects the directory: it is read again before every save, and a save whose
record names another run stops with one line instead of overwriting that run's checkpoints.
"""

import datetime
import fcntl
import json
import os
import socket
import uuid

from megatron.common.errors import UserError

LOCK_FILE = ".writer.lock"
OWNER_FILE = ".writer.json"


def new_run_id() -> str:
    """This run's id: the Slurm job, else torchrun's run id, plus a random part."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return f"{job}-{uuid.uuid4().hex[:8]}"


def describe(owner: dict) -> str:
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (
        f"run {owner.get('run_id')} (pid {owner.get('pid')} on {owner.get('host')}{job}, "
        f"since {owner.get('started')})"
    )


class WriterLock:
    """Rank 0's hold on a `--save` directory (see the module docstring)."""

    def __init__(self, directory: str, run_id: str):
        self.directory, self.run_id = directory, run_id
        self.handle = None
        self.taken_over: dict | None = None  # the dead owner whose lock this run took

    def acquire(self) -> None:
        try:  # checked at validation; the directory may have changed since
            os.makedirs(self.directory, exist_ok=True)
            handle = open(os.path.join(self.directory, LOCK_FILE), "a+")
        except OSError as error:
            raise UserError(f"--save {self.directory}: {error.strerror}") from None
        previous = read_owner(self.directory)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            owner = f"it is held by {describe(previous)}" if previous else "it is held"
            raise UserError(
                f"--save {self.directory} is another run's: {owner}; wait for it to end, or "
                "save elsewhere"
            ) from None
        self.handle = handle
        if previous and previous.get("run_id") != self.run_id:
            self.taken_over = previous
        self._write_owner()

    def check(self) -> None:
        """Before a save: the owner record still names this run."""
        owner = read_owner(self.directory)
        if owner is not None and owner.get("run_id") != self.run_id:
            raise UserError(
                f"--save {self.directory} was taken over by {describe(owner)} while this run "
                f"({self.run_id}) trained: not saving over its checkpoints"
            )

    def release(self) -> None:
        if self.handle is None:
            return
        if (read_owner(self.directory) or {}).get("run_id") == self.run_id:
            _remove(os.path.join(self.directory, OWNER_FILE))
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None

    def _write_owner(self) -> None:
        owner = {
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        path = os.path.join(self.directory, OWNER_FILE)
        staging = f"{path}.{os.getpid()}.tmp"
        with open(staging, "w") as handle:
            json.dump(owner, handle)
        os.replace(staging, path)


def read_owner(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, OWNER_FILE)) as handle:
            owner = json.load(handle)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
