"""One writer per --save directory: the lock, the owner record, a dead owner's lock taken
over, the check before a save (checkpointing/writer_lock.py)."""

import json
import os
import subprocess
import sys
import time

import pytest

from megatron.common.errors import UserError
from megatron.training.checkpointing.writer_lock import OWNER_FILE, WriterLock, read_owner

HOLDER = """
import sys, time
from megatron.training.checkpointing.writer_lock import WriterLock
lock = WriterLock(sys.argv[1], "holder-run")
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_held_directory_is_refused_naming_its_owner(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as caught:
            WriterLock(str(tmp_path), "second-run").acquire()
        message = str(caught.value)
        assert message.startswith(f"--save {tmp_path} is another run's: it is held by run ")
        assert f"holder-run (pid {holder.pid} on " in message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    # its process is gone, so is its lock (the kernel's): the next run takes over
    lock = WriterLock(str(tmp_path), "third-run")
    lock.acquire()
    assert lock.taken_over["run_id"] == "holder-run" and lock.taken_over["pid"] == holder.pid
    assert read_owner(str(tmp_path))["run_id"] == "third-run"
    lock.release()


def test_the_owner_record_is_checked_before_a_save_and_removed_at_the_end(tmp_path):
    lock = WriterLock(str(tmp_path), "mine")
    lock.acquire()
    owner = read_owner(str(tmp_path))
    assert owner["pid"] == os.getpid() and owner["run_id"] == "mine" and owner["host"]
    lock.check()  # still ours
    # a file system that ignores flock let another job write its record
    with open(os.path.join(str(tmp_path), OWNER_FILE), "w") as handle:
        json.dump({**owner, "run_id": "theirs", "pid": 4242}, handle)
    with pytest.raises(UserError) as caught:
        lock.check()
    assert "was taken over by run theirs (pid 4242" in str(caught.value)
    assert "not saving over its checkpoints" in str(caught.value)
    lock.release()  # the record is theirs now: left in place
    assert read_owner(str(tmp_path))["run_id"] == "theirs"
    mine = WriterLock(str(tmp_path), "again")
    mine.acquire()
    mine.release()
    assert read_owner(str(tmp_path)) is None
