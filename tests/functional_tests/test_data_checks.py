"""Data damaged after preprocessing is caught where it is read: a 4-stage torchrun launch on a
.bin whose token ids were overwritten beyond the vocabulary, its .stats.json (which the
start-up check trusts) left as it was."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
VOCAB = 1000  # NullTokenizer: 1001 ids with its eod, padded to 1024
PADDED = 1024
ROTTEN = 2000  # the rotted copy's document d holds the id ROTTEN + d
ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "paci",
    "--train-iters", "4", "--lr", "1e-4", "--eval-iters", "0", "--split", "1,0,0",
    "--log-interval", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small dataset written by tools/preprocess_data.py (with its .stats.json)."""
    directory = tmp_path_factory.mktemp("data")
    rng = numpy.random.default_rng(0)
    with open(directory / "in.jsonl", "w") as handle:
        for _ in range(200):
            ids = rng.integers(0, VOCAB, size=int(rng.integers(20, 200)))
            handle.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
    prefix = str(directory / "ints")
    command = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
               "--input", str(directory / "in.jsonl"), "--output-prefix", prefix,
               "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
               "--append-eod"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return prefix + "_text_document"


def rotted_copy(prefix: str, target: str) -> None:
    """Copy .bin/.idx/.stats.json, then overwrite the middle id of every document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for suffix in (".bin", ".idx", ".stats.json"):
        shutil.copy(prefix + suffix, target + suffix)
    index = IndexedDataset(target).index
    tokens = numpy.memmap(target + ".bin", dtype=index.dtype, mode="r+")
    starts = index.sequence_pointers // numpy.dtype(index.dtype).itemsize
    for document, (start, length) in enumerate(zip(starts, index.sequence_lengths)):
        tokens[start + length // 2] = ROTTEN + document
    tokens.flush()


def session_alive(session: int) -> list[int]:
    """Pids of the live (not zombie) processes of a session."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            found.append(int(pid))
    return found


def worker_traceback(output: str) -> bool:
    """A Python traceback from a worker (torchrun's own report of the failure is not one)."""
    lines = output.splitlines()
    return any(
        "Traceback" in line and "torchrun" not in "".join(lines[i + 1 : i + 3])
        for i, line in enumerate(lines)
    )


def test_rotted_bin_with_its_stats_stops_in_one_line(dataset, tmp_path):
    target = str(tmp_path / "rotted_text_document")
    rotted_copy(dataset, target)
    stats = json.load(open(target + ".stats.json"))
    assert stats["max_token_id"] < PADDED  # the start-up check has nothing to object to

    log_path = tmp_path / "log"
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "4",
               os.path.join(REPO, "pretrain_gpt.py"), *ARGS, "--data-path", target]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while "holds token id" not in open(log_path).read():
            assert launcher.poll() is None, open(log_path).read()[-3000:]
            assert time.time() < deadline, "no token-id error in time"
            time.sleep(0.2)
        reported = time.time()
        # a hang check, not a speed check: the bound is generous for a loaded machine
        while session_alive(launcher.pid) and time.time() - reported < 120:
            time.sleep(0.2)
        gone_after = time.time() - reported
        left = session_alive(launcher.pid)
        launcher.wait(timeout=30)
    finally:
        for pid in session_alive(launcher.pid):
            os.kill(pid, 9)
    output = open(log_path).read()
    print(f"every process gone {gone_after:.1f} s after the error line")
    assert not left, (left, gone_after)
    assert launcher.returncode != 0
    assert not worker_traceback(output) and "IndexError" not in output, output[-3000:]

    lines = [line for line in output.splitlines() if "holds token id" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    head = f"error: {target}.bin: document "
    assert line.startswith(head), line
    document, rest = line[len(head) :].split(" holds token id ", 1)
    token_id = int(rest.split(",", 1)[0])
    assert token_id == ROTTEN + int(document), line  # the document named holds that id
    assert f"outside the padded vocabulary of {PADDED} tokens" in rest
    # the stages that lost their neighbour because of it stay quiet: the cause is the one line
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [line]
