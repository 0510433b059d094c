"""--rerun-mode validate_results on 2 pipeline stages (1F1B-flush and interleaved 1F1B), in one
2-process launch.

* A rerun repeats its iteration exactly: with dropout on and a (non-fatal, injected) rejection
  in every checked iteration, each iteration runs twice and the losses and gradient norms are
  bit-identical to the run without validation, so the RNG states, the data and the dropped
  gradients are all put back as they were.
* Validation with nothing rejected changes nothing either.
* Megatron's outcomes of a fatal rejection: a transient error saves the iteration before and
  exits with 17; a persistent one saves it with the rerun state beside it and exits with 16,
  and resumed on the same device exits with 16 again without comparing.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from run_cases import HERE, REPO

MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 5 "
    "--lr 1e-3 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 "
    "--eval-iters 0 --seed 7 --pipeline-model-parallel-size 2 --hidden-dropout 0.1 "
    "--attention-dropout 0.1"
).split()
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]
VALIDATE = ["--rerun-mode", "validate_results"]
# a rejection in every checked iteration, of a non-fatal check: the run goes on after each
NON_FATAL = VALIDATE + ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss",
                        "--error-injection-rate", "1"]  # fmt: skip


def _cases(output: str) -> list[dict]:
    checkpoints = {kind: os.path.join(output, kind, "checkpoint") for kind in ("transient",
                   "persistent")}  # fmt: skip
    fatal = VALIDATE + ["--error-injection-rate", "1", "--save-interval", "100"]
    runs = [
        ("plain", MODEL, None),
        ("injected", MODEL + NON_FATAL + ["--result-rejected-tracker-filename",
                                          os.path.join(output, "tracker.txt")], None),  # fmt: skip
        ("validated", MODEL + VALIDATE, None),
        ("interleaved_plain", MODEL + INTERLEAVED, None),
        ("interleaved_injected", MODEL + INTERLEAVED + NON_FATAL, None),
        ("transient", MODEL + fatal + ["--error-injection-type", "transient_error",
                                       "--save", checkpoints["transient"]], 17),  # fmt: skip
        ("persistent", MODEL + fatal + ["--error-injection-type", "persistent_error",
                                        "--save", checkpoints["persistent"]], 16),  # fmt: skip
        ("resumed_here", MODEL + fatal + ["--error-injection-type", "persistent_error",
                                          "--load", checkpoints["persistent"],
                                          "--save", checkpoints["persistent"]], 16),  # fmt: skip
    ]
    cache = ["--data-cache-path", os.path.join(output, "index_cache")]
    return [{"name": name, "args": args + cache, "metrics_dir": os.path.join(output, name),
             "expect_exit": code} for name, args, code in runs]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """case name -> {"summary", "log", "exit"} (exit: the code the case ended with, or None)."""
    output = str(tmp_path_factory.mktemp("rerun"))
    spec = os.path.join(output, "runs.json")
    cases = _cases(output)
    json.dump(cases, open(spec, "w"))
    # torchrun's agent in the launching process, the workers forked after the imports
    command = [sys.executable, os.path.join(HERE, "multi_run.py"), "--nproc-per-node=2", spec]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    log = completed.stdout + completed.stderr
    assert completed.returncode == 0, log[-6000:]
    result = {"log": log, "tracker": open(os.path.join(output, "tracker.txt")).read()}
    for case in cases:
        summary = os.path.join(case["metrics_dir"], "summary.json")
        code = os.path.join(case["metrics_dir"], "exit_code.txt")
        result[case["name"]] = {
            "summary": json.load(open(summary)) if os.path.exists(summary) else None,
            "exit": int(open(code).read()) if os.path.exists(code) else None,
            "checkpoint": os.path.join(output, case["name"], "checkpoint"),
        }
    return result


def _log_of(log: str, case: str) -> str:
    return log.split(f"=== case {case}\n")[1].split("=== case ")[0]


@pytest.mark.parametrize("plain,validated", [("plain", "injected"), ("plain", "validated"),
                                             ("interleaved_plain", "interleaved_injected")])  # fmt: skip
def test_reruns_repeat_their_iteration_exactly(runs, plain, validated):
    expected, got = runs[plain]["summary"], runs[validated]["summary"]
    assert len(expected["loss"]) == 5
    assert got["loss"] == expected["loss"]
    assert got["skipped_steps_by_stage"] == expected["skipped_steps_by_stage"] == [0, 0]
    norms = [
        re.findall(r"grad norm: (\S+)", _log_of(runs["log"], case)) for case in (plain, validated)
    ]
    assert len(norms[0]) == 5 and norms[0] == norms[1]


def test_every_checked_iteration_was_run_twice(runs):
    log = _log_of(runs["log"], "injected")
    for iteration in range(2, 6):  # the first iteration of a process is not checked
        assert f"[rank 1, iteration {iteration}]: unexpected result" in log
        assert f"[rank 1, iteration {iteration}]: rerun:" in log
    assert "iteration 1]: unexpected result" not in log
    assert "a result was rejected" not in _log_of(runs["log"], "validated")


def test_the_tracker_file_has_megatrons_fields(runs):
    lines = runs["tracker"].splitlines()
    initial = [line for line in lines if "status=INITIAL_RUN" in line]
    verdicts = [line for line in lines if "status=FIRST_RERUN_NOT_REPRODUCIBLE" in line]
    # only the last stage checks anything here (the loss); iterations 2 to 5
    assert len(initial) == len(verdicts) == 4
    assert all("rank=1" in line and "message='Spiky loss'" in line for line in lines)
    assert all("jobID=" in line and "device=" in line for line in lines)


def test_a_transient_error_saves_and_exits_17(runs):
    run = runs["transient"]
    assert run["exit"] == 17
    checkpoint = run["checkpoint"]
    assert open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt")).read() == "1"
    assert not os.path.exists(os.path.join(checkpoint, "iter_0000001", "rerun_state"))
    assert "possible transient error" in _log_of(runs["log"], "transient")


def test_a_reproducible_error_saves_its_state_and_exits_16(runs):
    run = runs["persistent"]
    assert run["exit"] == 16
    state_dir = os.path.join(run["checkpoint"], "iter_0000001", "rerun_state")
    states = [
        json.load(open(os.path.join(state_dir, name))) for name in sorted(os.listdir(state_dir))
    ]
    assert len(states) == 2
    assert all(s["phase"] == "save_to_resume" and s["suspect"] for s in states)
    assert all(s["injector"]["injected"] == "persistent_error" for s in states)


def test_resumed_on_the_same_device_exits_16_without_comparing(runs):
    assert runs["resumed_here"]["exit"] == 16
    log = _log_of(runs["log"], "resumed_here")
    assert "resuming to rerun iteration 2" in log
    assert "resumed on the same device" in log
    assert "rerun: " not in log  # no comparison made
