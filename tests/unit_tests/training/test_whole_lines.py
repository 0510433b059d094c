"""Ranks sharing one pipe never glue their lines (torchrun runs workers with `python -u`)."""

import io
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
# what a worker prints: log lines on stdout and one error on stderr, as `run_pretraining` does
WORKER = """
import sys
from megatron.training.entry import whole_lines
rank = sys.argv[1]
with whole_lines():
    for i in range(3000):
        print(f"rank {rank} iteration {i} loss 1.2345")
        if i == 1500:
            sys.stderr.write(f"error: training diverged (rank {rank})")
            sys.stderr.write("\\n")
"""
WHOLE = re.compile(r"^(rank \d iteration \d+ loss 1\.2345|error: training diverged \(rank \d\))$")


def test_lines_of_four_unbuffered_ranks_sharing_a_pipe_stay_whole():
    read, write = os.pipe()
    workers = [
        subprocess.Popen([sys.executable, "-u", "-c", WORKER, str(rank)], cwd=REPO,
                         stdout=write, stderr=write)  # fmt: skip
        for rank in range(4)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [worker.wait() for worker in workers] == [0] * 4
    assert len(lines) == 4 * 3001
    assert [line for line in lines if not WHOLE.match(line)] == []
    assert sorted(line for line in lines if line.startswith("error: ")) == [
        f"error: training diverged (rank {rank})" for rank in range(4)
    ]


def test_a_line_is_written_once_whole_and_the_streams_are_restored_after_the_run(monkeypatch):
    from megatron.training.entry import whole_lines

    written = io.BytesIO()
    stream = io.TextIOWrapper(written, encoding="utf-8", write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    with whole_lines():
        stream.write("iteration 1")
        assert written.getvalue() == b""  # not on its own
        stream.write(" loss 2.5\n")
        assert written.getvalue() == b"iteration 1 loss 2.5\n"
        stream.write("unfinished")
    assert written.getvalue() == b"iteration 1 loss 2.5\nunfinished"  # flushed at the end
    assert (stream.line_buffering, stream.write_through) == (False, True)
