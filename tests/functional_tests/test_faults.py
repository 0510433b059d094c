"""Faults on real 4-process torchrun launches: divergence, a rank-local error, a frozen stage,
a dead launcher. Each launch costs ~10 s of imports on a small machine, so there are few."""

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import background
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
DATA = os.path.join(REPO, "data", "stdlib_text_document")
TOKENIZER = os.path.join(REPO, "data", "tokenizer", "stdlib.model")
SMALL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "paci", "--eval-iters", "0",
    "--untie-embeddings-and-output-weights", "--log-interval", "1",
    "--tokenizer-type", "SentencePieceTokenizer",  # MOCK, given after, overrides it
]  # fmt: skip
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(args, env=None, **popen) -> subprocess.Popen:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "4",
               os.path.join(REPO, "pretrain_gpt.py"), *args]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, env=env or ENV, start_new_session=True, **popen)


def launch_until(args, log_path: str, needle: str, env=None) -> tuple[subprocess.Popen, dict]:
    """A launch logging to `log_path`, once `needle` is in its log: (launcher, rank -> pid)."""
    with open(log_path, "w") as log:
        process = launch(args, env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_line(log_path, needle, process)
        pids = workers(process.pid)
        assert len(pids) == 4, pids
    except BaseException:
        _kill_group(process)
        raise
    return process, pids


def run(args, timeout=180) -> tuple[int, str]:
    process = launch(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        _kill_group(process)
    return process.returncode, output


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass


def our_errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def worker_traceback(output: str) -> bool:
    """A Python traceback from a worker (torchrun's own report of the failure is not one)."""
    lines = output.splitlines()
    return any(
        line.startswith("Traceback") and "torchrun" not in "".join(lines[i + 1 : i + 3])
        for i, line in enumerate(lines)
    )


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (from /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
        if parent == launcher and ranks:
            found[ranks[0]] = int(pid)
    return found


def process_state(pid: int) -> str:
    """Its /proc state letter (R, S, T stopped, Z zombie, ...); "?" once it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    return process_state(pid) not in ("Z", "?")


def wait_for_line(path: str, needle: str, process, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while needle not in open(path).read():
        assert process.poll() is None, open(path).read()[-3000:]
        assert time.time() < deadline, f"no {needle!r} in time"
        time.sleep(0.5)


# ---------------------------------------------------------------------------- divergence
@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """--lr 1e3: finite for a few iterations, then NaN; checkpoints every 2 iterations."""
    out = tmp_path_factory.mktemp("diverged")
    args = SMALL + [
        "--train-iters", "12", "--lr", "1e3", "--lr-decay-style", "constant",
        "--data-path", DATA, "--tokenizer-model", TOKENIZER,
        "--save", str(out / "ckpt"), "--save-interval", "2", "--max-consecutive-skips", "2",
        "--ckpt-format", "torch",  # the checks below read its per-rank files
        "--metrics-dir", str(out / "metrics"),
    ]  # fmt: skip
    returncode, output = run(args)
    return out, returncode, output


def test_divergence_is_counted_rolled_back_and_fails_the_run(diverged):
    out, returncode, output = diverged
    assert returncode != 0, output[-3000:]
    assert not worker_traceback(output), output[-3000:]
    errors = our_errors(output)
    assert len(errors) == 1 and "training diverged" in errors[0], errors
    # every rank exits 3 (torchrun's failure report lists each worker's code)
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", output, re.M) == ["3"] * 4, output[-3000:]
    summary = json.load(open(out / "metrics" / "summary.json"))  # valid JSON: parses
    losses = summary["loss"]
    nan_count = sum(1 for loss in losses if loss is None)
    assert nan_count > 0 and summary["nan_iterations"] == nan_count
    assert all(skips > 0 for skips in summary["skipped_steps_by_stage"])
    assert summary["rollbacks"], "past --max-consecutive-skips the run must roll back"
    assert "rolled back to the checkpoint of iteration" in output
    # the log line's counters are counted, not constant
    counted = [line for line in output.splitlines() if "number of nan iterations:   1" in line]
    assert len(counted) == nan_count
    assert "number of skipped iterations:   1" in output
    # every checkpoint written holds finite weights, and the tracker names one of them
    import torch

    ckpt = out / "ckpt"
    iterations = sorted(int(name[5:]) for name in os.listdir(ckpt) if name.startswith("iter_"))
    assert iterations and int(open(ckpt / "latest_checkpointed_iteration.txt").read()) in iterations
    for iteration in iterations:
        for rank_dir in os.listdir(ckpt / f"iter_{iteration:07d}"):
            payload = torch.load(ckpt / f"iter_{iteration:07d}" / rank_dir / "model_optim_rng.pt",
                                 weights_only=False)  # fmt: skip
            assert all(torch.isfinite(t).all() for t in payload["model"].values() if t is not None
                       and torch.is_tensor(t) and t.is_floating_point())  # fmt: skip


def test_error_of_one_rank_is_printed_with_its_rank(diverged):
    """Stage 2's checkpoint file is gone: rank 2 names it; the others say to look there."""
    out, _, _ = diverged
    ckpt = out / "ckpt"
    latest = int(open(ckpt / "latest_checkpointed_iteration.txt").read())
    missing = ckpt / f"iter_{latest:07d}" / "mp_rank_00_002" / "model_optim_rng.pt"
    os.remove(missing)
    args = SMALL + ["--train-iters", "12", "--lr", "1e3", "--lr-decay-style", "constant",
                    "--data-path", DATA, "--tokenizer-model", TOKENIZER, "--load", str(ckpt),
                    "--ckpt-format", "torch"]  # fmt: skip
    returncode, output = run(args)
    assert returncode != 0
    assert not worker_traceback(output), output[-3000:]
    errors = our_errors(output)
    assert any(str(missing) in line and line.endswith("(rank 2)") for line in errors), errors
    assert len(errors) == len(set(line.rsplit(" (rank", 1)[0] for line in errors)), errors


# ---------------------------------------------------------------------------- hangs
@background.started_with_the_session(beside_cases=False)
def frozen_runs(directory: str) -> dict:
    """The three hang scenarios below each wait out --distributed-timeout-minutes 1, so they
    run side by side (they sleep, they do not compute), started with the session where it runs
    them: name -> what each measured."""
    root = pathlib.Path(directory)
    scenarios = {"stage": _freeze_a_stage, "save": _freeze_a_rank_in_its_save,
                 "replica": _freeze_a_replica_during_its_reduction}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {}
        for name, scenario in scenarios.items():
            (root / name).mkdir()
            futures[name] = pool.submit(scenario, root / name)
        return {name: future.result() for name, future in futures.items()}


def _freeze_rank_1(out, args: list[str]) -> dict:
    """A launch of `args` whose rank 1 is stopped (SIGSTOP) after iteration 3: how long every
    process took to end, which were left, and the log."""
    log_path = str(out / "log")
    process, pids = launch_until(args, log_path, "iteration        3/")
    try:
        os.kill(pids[1], signal.SIGSTOP)
        frozen_at = time.time()
        process.wait(timeout=150)
        ended_after = time.time() - frozen_at
        left = [rank for rank, pid in pids.items() if alive(pid)]
    finally:
        _kill_group(process)
    return {"ended_after": ended_after, "left": left, "output": open(log_path).read()}


def _freeze_a_stage(out) -> dict:
    """4 stages: rank 1 is stage 1, both neighbours wait on it."""
    return _freeze_rank_1(out, SMALL + MOCK + ["--train-iters", "100000", "--lr", "1e-4",
                                               "--distributed-timeout-minutes", "1"])  # fmt: skip


def _freeze_a_replica_during_its_reduction(out) -> dict:
    """PP 2 x DP 2 under PACI with the deferred step: rank 1 (stage 0's second replica) stops,
    so its replica's data-parallel reduction, in flight while the stage goes on, never lands."""
    args = list(SMALL)
    args[args.index("--pipeline-model-parallel-size") + 1] = "2"
    return _freeze_rank_1(out, args + MOCK + [
        "--train-iters", "100000", "--lr", "1e-4", "--distributed-timeout-minutes", "1",
        "--paci-deferred-step", "--overlap-grad-reduce",
    ])  # fmt: skip


def test_a_replica_frozen_during_a_reduction_is_named_and_ended(frozen_runs):
    """Every process ends within the timeout and the stopped rank is named (by its stage) and
    ended. Which rank's wait times out first depends on when each began it (rank 0's on its
    replica's reduction or loss average, rank 3's on its stage 0, rank 2's on rank 3), and the
    launcher ends the others then: rank 0, where it reported, names its data-parallel group.
    The reduction's own message: test_data_parallel.py, a stuck bucket."""
    run = frozen_runs["replica"]
    output, errors = run["output"], our_errors(run["output"])
    print(f"every process ended {run['ended_after']:.1f} s after rank 1 was frozen")
    print("\n".join(errors))
    assert not run["left"], run["left"]
    assert run["ended_after"] < 90, (run["ended_after"], output[-3000:])
    assert errors and all("stage ?" not in line for line in errors), errors
    assert any("stage 0 (rank 1) was stopped: ended" in line for line in errors), output[-3000:]
    replica = [line for line in errors if line.startswith("error: rank 0: ")]
    assert all("over ranks [0, 1] failed" in line for line in replica), replica
    assert not worker_traceback(output), output[-3000:]


def test_frozen_stage_ends_every_rank_within_the_timeout(frozen_runs):
    run = frozen_runs["stage"]
    output, ended_after = run["output"], run["ended_after"]
    print(f"every process ended {ended_after:.1f} s after stage 1 was frozen")
    print("\n".join(our_errors(output)))
    assert not run["left"], run["left"]
    assert ended_after < 90, (ended_after, output[-3000:])  # the 60 s timeout, then seconds
    assert any("stage 1 (rank 1)" in line for line in our_errors(output)), output[-3000:]


def test_workers_end_when_the_launcher_is_killed(tmp_path):
    log_path = str(tmp_path / "log")
    args = SMALL + MOCK + ["--train-iters", "100000", "--lr", "1e-4"]
    process, pids = launch_until(args, log_path, "iteration        2/")
    try:
        os.kill(process.pid, signal.SIGKILL)  # torchrun alone
        killed_at = time.time()
        # a hang check, not a speed check: the bound is generous for a loaded machine
        while any(alive(pid) for pid in pids.values()) and time.time() - killed_at < 120:
            time.sleep(0.2)
        outlived = time.time() - killed_at
        left = [pid for pid in pids.values() if alive(pid)]
    finally:
        _kill_group(process)
    print(f"every worker gone {outlived:.1f} s after the launcher was killed")
    assert not left, (left, outlived)
    assert "the launcher" in open(log_path).read()


# ---------------------------------------------------------------------------- one writer
def test_a_second_job_on_the_same_save_directory_stops_in_one_line(tmp_path):
    """Two real launches on one --save: the second ends at start-up with one line naming the
    first (its pid and run id), before any set-up; the first saves every checkpoint it should and
    its tracker names its own last iteration; no lock record is left behind. The first job's
    workers are stopped (SIGSTOP) while the second runs, so that it is still running then
    however long the second takes to start."""
    save = str(tmp_path / "ckpt")
    log_path = str(tmp_path / "first.log")
    first_args = SMALL + MOCK + ["--train-iters", "100000", "--lr", "1e-4", "--save", save,
                                 "--save-interval", "10", "--exit-interval", "30"]  # fmt: skip
    with open(log_path, "w") as log:
        first = launch(first_args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_line(log_path, "iteration        2/", first)
        owner = json.load(open(os.path.join(save, ".writer.json")))
        paused = workers(first.pid)
        assert len(paused) == 4, paused
        for pid in paused.values():
            os.kill(pid, signal.SIGSTOP)
        code, output = run(SMALL + MOCK + ["--train-iters", "20", "--lr", "1e-4", "--save", save,
                                           "--save-interval", "5"])  # fmt: skip
        assert first.poll() is None  # the first job was still training when refused
        for pid in paused.values():
            os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    finally:
        _kill_group(first)
    errors = our_errors(output)
    assert code != 0 and len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: --save {save} is another run's: it is held by run ")
    assert f"pid {owner['pid']}" in errors[0] and owner["run_id"] in errors[0]
    assert not worker_traceback(output), output[-3000:]
    # refused right after the process group came up: no model, data or iteration (the line
    # "> world size ..." opens the set-up that follows the lock)
    assert "> world size" not in output and "iteration " not in output, output[-3000:]
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == [
        "iter_0000010", "iter_0000020", "iter_0000030"
    ]  # fmt: skip
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "30"
    assert not os.path.exists(os.path.join(save, ".writer.json"))
    log = open(log_path).read()
    assert f"saved by run {owner['run_id']}" not in log  # it never loaded anything


# ---------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_ends_every_rank_in_one_line_and_keeps_the_checkpoint(tmp_path):
    """SIGINT to torchrun (which forwards it to its workers): one line per rank, no worker
    traceback or C++ "terminate called", every process gone at once, the checkpoint intact.
    (torchrun's own SignalException traceback is torchrun's, not a worker's.)"""
    save, log_path = str(tmp_path / "ckpt"), str(tmp_path / "log")
    args = SMALL + MOCK + ["--train-iters", "100000", "--lr", "1e-4", "--save", save,
                           "--save-interval", "3"]  # fmt: skip
    process, pids = launch_until(args, log_path, "saved checkpoint at iteration 3 ")
    try:
        os.kill(process.pid, signal.SIGINT)
        interrupted_at = time.time()
        process.wait(timeout=60)
        while any(alive(pid) for pid in pids.values()) and time.time() - interrupted_at < 120:
            time.sleep(0.2)
        ended_after = time.time() - interrupted_at
        left = [pid for pid in pids.values() if alive(pid)]
    finally:
        _kill_group(process)
    output = open(log_path).read()
    errors = our_errors(output)
    assert sorted(errors) == [
        f"error: interrupted (SIGINT): rank {rank} stops; checkpoints already saved are intact, "
        "the iterations since the last one are lost" for rank in range(4)
    ], output[-3000:]  # fmt: skip
    assert not worker_traceback(output) and "terminate called" not in output, output[-3000:]
    print(f"every process gone {ended_after:.1f} s after SIGINT")
    assert not left, (left, ended_after)  # a hang check: the bound is generous under load
    latest = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert latest % 3 == 0 and os.path.isdir(os.path.join(save, f"iter_{latest:07d}"))
    # a save cut short leaves only its staging directory (cleared by the next save), never a
    # published iteration
    assert f"iter_{latest:07d}.tmp" not in os.listdir(save)


def _freeze_a_rank_in_its_save(out) -> dict:
    save, log_path = str(out / "ckpt"), str(out / "log")
    args = SMALL + MOCK + ["--train-iters", "8", "--lr", "1e-4", "--save", save,
                           "--save-interval", "2", "--distributed-timeout-minutes", "1"]  # fmt: skip
    env = {**ENV, "MEGATRON_INJECT_STOP_IN_SAVE": "2:4"}
    process, pids = launch_until(args, log_path, "saved checkpoint at iteration 2 ", env)
    try:
        deadline = time.time() + 120
        while process_state(pids[2]) != "T":
            assert process.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.2)
        frozen_at = time.time()
        process.wait(timeout=150)
        ended_after = time.time() - frozen_at
        left = [rank for rank, pid in pids.items() if alive(pid)]
    finally:
        _kill_group(process)
    return {"ended_after": ended_after, "left": left, "output": open(log_path).read(),
            "save": save}  # fmt: skip


def test_a_rank_frozen_during_a_save_is_named_and_ended(frozen_runs):
    """Rank 2 stops itself (SIGSTOP) as the torch_dist save of iteration 4 begins: the others
    give up after --distributed-timeout-minutes, name it in one line, end it (the launcher
    need not wait 30 s for a process that ignores its SIGTERM), and the tracker keeps naming
    iteration 2, whose checkpoint is complete."""
    run = frozen_runs["save"]
    output, ended_after, save = run["output"], run["ended_after"], run["save"]
    errors = our_errors(output)
    print(f"every process ended {ended_after:.1f} s after rank 2 froze in its save")
    assert not run["left"], run["left"]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(
        "error: checkpoint of iteration 4 not saved: stage 2 (rank 2) was stopped (ended now) "
        "and did not take part within --distributed-timeout-minutes 1; "
        "latest_checkpointed_iteration.txt still names iteration 2"
    ), errors  # fmt: skip
    assert not worker_traceback(output), output[-3000:]
    assert ended_after < 60 + 28, ended_after  # the timeout, then seconds, not 30 s more
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]
