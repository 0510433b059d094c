"""Run control on real multi-process runs: SIGTERM (--exit-signal-handler) sent as a launcher
and as Slurm would, a tiny --exit-duration-in-mins, --rampup-batch-size,
--step-batch-size-schedule and --calculate-per-token-loss, under 1F1B-flush and PACI.

References: megatron-core's ramp-up calculator for the batch of each iteration, a one-process
run for the pipelined per-token loss, an uninterrupted run for a stopped-and-resumed one."""

import glob
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import run_cases
import torch
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from megatron.training.run_control import iterations_ahead

REPO = run_cases.REPO
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SMALL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--pipeline-model-parallel-size", "4", "--eval-iters", "0", "--log-interval", "1",
    "--untie-embeddings-and-output-weights", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--lr", "1e-4", "--train-iters", "100000", "--exit-signal-handler",
    "--ckpt-format", "torch",  # the checks read the per-rank files
]  # fmt: skip
RAMP = dict(start=4, increment=4, samples=24, final=16, train_samples=124)


def case_log(summary: dict, name: str) -> str:
    """The part of a launch's log that belongs to one case."""
    return summary["log"].split(f"=== case {name}\n", 1)[1].split("=== case ", 1)[0]


def logged_batches(summary: dict, name: str) -> list[int]:
    return [int(b) for b in re.findall(r"global batch size: +(\d+) \|", case_log(summary, name))]


def reference_batches(iterations: int) -> list[int]:
    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=RAMP["final"], micro_batch_size=2, data_parallel_size=1,
        decrease_batch_size_if_needed=False, rank=1, start_global_batch_size=RAMP["start"],
        batch_size_increment=RAMP["increment"], ramup_samples=RAMP["samples"],
    )  # fmt: skip
    sizes, consumed = [], 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=True)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes


def checkpoint_payloads(directory: str, iteration: int) -> list[dict]:
    """The 4 stages' files of the checkpoint at `iteration` (written whole: torch.load reads
    each, and they record the iteration and the samples consumed)."""
    files = glob.glob(os.path.join(directory, f"iter_{iteration:07d}", "*", "*.pt"))
    assert len(files) == 4, files
    return [torch.load(path, weights_only=False) for path in sorted(files)]


def latest(directory: str) -> int:
    return int(open(os.path.join(directory, "latest_checkpointed_iteration.txt")).read())


def drift_bound(stage: int, num_stages: int, accumulation: int) -> int:
    return math.ceil((num_stages - 1 - stage) / accumulation)


# ---------------------------------------------------------------------------- batch ramp
@pytest.mark.parametrize("name", ["gpt_pp4_rampup_1f1b", "gpt_pp4_rampup_paci_1_full"])
def test_ramp_batches_follow_megatron_core_and_train(case_results, name):
    summary = case_results[name]
    expected = reference_batches(10)  # Megatron's count for 124 samples: 4 ramp + 6 full
    assert expected[:5] == [4, 4, 8, 12, 16]
    assert summary["iterations"] == 10 and logged_batches(summary, name) == expected
    assert all(loss is not None and math.isfinite(loss) for loss in summary["loss"])
    assert all(r["optimizer_steps"] == 10 for r in summary["stages"])


def test_ramp_under_paci_keeps_the_bound_of_its_smallest_a(case_results):
    summary = case_results["gpt_pp4_rampup_paci_1_full"]
    smallest_a = RAMP["start"] // 2  # start batch / micro batch
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], 4, smallest_a)
    assert summary["stages"][0]["max_drift"] == drift_bound(0, 4, smallest_a)  # reached
    assert summary["cross_stage_collectives"] == 0


def test_agreed_stop_and_resume_equal_the_uninterrupted_ramp(case_results):
    """A tiny --exit-duration-in-mins under PACI: the stop is agreed for iteration 5 (the first
    whose microbatches reach 2N - 1 + m = 15: 2 + 2 + 4 + 6 + 8), drained and saved there with
    the samples consumed so far; the resumed run continues the ramp and equals the run that
    was never stopped (both drain at 5: --save-interval 5)."""
    full = case_results["gpt_pp4_rampup_paci_1_full"]
    stopped = case_results["gpt_pp4_rampup_paci_2_stop"]
    resumed = case_results["gpt_pp4_rampup_paci_3_resume"]
    log = case_log(stopped, "gpt_pp4_rampup_paci_2_stop")
    assert "training stops after iteration 5 (drained)" in log
    assert "> exiting at iteration 5 (--exit-duration-in-mins: " in log
    assert stopped["iterations"] == 5 and stopped["loss"] == full["loss"][:5]
    assert stopped["cross_stage_collectives"] == 0  # the agreement is not a collective
    directory = os.path.join(os.path.dirname(stopped["metrics_dir"]), "rampup_stop")
    consumed = sum(reference_batches(5))
    for payload in checkpoint_payloads(directory, 5):
        assert payload["iteration"] == 5 and payload["consumed_train_samples"] == consumed == 44
    assert logged_batches(resumed, "gpt_pp4_rampup_paci_3_resume") == reference_batches(10)[5:]
    assert resumed["loss"] == full["loss"][5:]


# ---------------------------------------------------------------------------- step schedule
# The stepbatch cases' --step-batch-size-schedule "0:4 256:8 640:16" in (tokens, batch), at
# --seq-length 32, with --train-samples 100 and --lr-warmup-samples 16 on 2 stages
STEPS = [(0, 4), (256, 8), (640, 16)]


def step_reference(iterations: int, consumed: int = 0) -> list[int]:
    """Megatron-LM's definition (megatron-core 0.16.1 has no step calculator): the batch of the
    largest threshold, tokens // --seq-length, that the samples consumed reached."""
    sizes = []
    for _ in range(iterations):
        sizes.append(max((tokens // 32, batch) for tokens, batch in STEPS
                         if tokens // 32 <= consumed)[1])  # fmt: skip
        consumed += sizes[-1]
    return sizes


def logged_field(summary: dict, name: str, field: str) -> list[float]:
    return [float(v) for v in re.findall(rf"{field}: +([-0-9.E+]+) \|", case_log(summary, name))]


def reference_learning_rates(batches: list[int]) -> list[float]:
    """megatron-core's scheduler in samples (warmup 16, decay --train-samples 100, cosine),
    advanced by each iteration's batch: the LR each iteration steps with."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=16,
        lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=100, wd_incr_style="constant",
    )  # fmt: skip
    rates = []
    for batch in batches:
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=batch)
    return rates


@pytest.mark.parametrize("name", ["gpt_pp2_stepbatch_1f1b", "gpt_pp2_stepbatch_paci_1_full"])
def test_step_schedule_batches_samples_and_lr_follow_megatron(case_results, name):
    """9 iterations for 100 samples (the last batch whole, as Megatron counts): the batch
    changes at samples 8 and 20, mid-run; the LR schedule counts samples."""
    summary = case_results[name]
    expected = step_reference(9)
    assert expected == [4, 4, 8, 8, 16, 16, 16, 16, 16]
    assert summary["iterations"] == 9 and logged_batches(summary, name) == expected
    consumed = logged_field(summary, name, "consumed samples")
    assert consumed == [sum(expected[: i + 1]) for i in range(9)] and consumed[-1] == 104
    rates = logged_field(summary, name, "learning rate")
    assert rates == pytest.approx(reference_learning_rates(expected), rel=1e-6, abs=1e-12)
    assert all(r["optimizer_steps"] == 9 for r in summary["stages"])
    losses = summary["loss"]
    assert all(math.isfinite(loss) for loss in losses) and max(losses[-3:]) < losses[0]


def test_step_schedule_under_paci_starts_as_flush_without_collectives(case_results):
    flush = case_results["gpt_pp2_stepbatch_1f1b"]["loss"]
    paci = case_results["gpt_pp2_stepbatch_paci_1_full"]
    assert paci["loss"][0] == pytest.approx(flush[0], rel=1e-6)  # the same initial weights
    smallest_a = 4 // 2  # the first batch / micro batch
    for report in paci["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], 2, smallest_a)
    assert paci["cross_stage_collectives"] == 0


def test_step_schedule_resumes_from_the_samples_consumed(case_results):
    """Stopped after iteration 3 (16 samples: inside the step of batch 8), the resumed run
    picks the step up from the checkpoint's consumed samples and equals the uninterrupted run
    (both drain at 3: --save-interval 3)."""
    full = case_results["gpt_pp2_stepbatch_paci_1_full"]
    stopped = case_results["gpt_pp2_stepbatch_paci_2_stop"]
    resumed = case_results["gpt_pp2_stepbatch_paci_3_resume"]
    assert stopped["iterations"] == 3 and stopped["loss"] == full["loss"][:3]
    directory = os.path.join(os.path.dirname(stopped["metrics_dir"]), "stepbatch_stop")
    files = glob.glob(os.path.join(directory, "iter_0000003", "*", "*.pt"))
    assert len(files) == 2
    for path in files:
        payload = torch.load(path, weights_only=False)
        assert payload["iteration"] == 3 and payload["consumed_train_samples"] == 16
    assert logged_batches(resumed, "gpt_pp2_stepbatch_paci_3_resume") == step_reference(9)[3:]
    assert step_reference(6, consumed=16) == [8, 16, 16, 16, 16, 16]
    assert resumed["loss"] == full["loss"][3:]


# ---------------------------------------------------------------------------- duration
def test_tiny_duration_under_flush_stops_after_the_first_iteration(case_results):
    summary = case_results["gpt_pp4_duration_1f1b"]
    log = case_log(summary, "gpt_pp4_duration_1f1b")
    assert summary["iterations"] == 1
    assert "> exiting at iteration 1 (--exit-duration-in-mins: " in log
    directory = os.path.join(os.path.dirname(summary["metrics_dir"]), "duration_1f1b")
    payloads = checkpoint_payloads(directory, 1)
    assert latest(directory) == 1
    assert all(p["iteration"] == 1 and p["consumed_train_samples"] == 8 for p in payloads)


# ---------------------------------------------------------------------------- per-token loss
def test_per_token_loss_on_four_stages_equals_one_process(case_results):
    one = case_results["gpt_pp1_pertoken_1f1b"]["loss"]
    four = case_results["gpt_pp4_pertoken_1f1b"]["loss"]
    assert len(one) == 6
    assert max(abs(a - b) / abs(b) for a, b in zip(four, one)) <= 1e-5


def test_per_token_loss_under_paci(case_results):
    summary = case_results["gpt_pp4_pertoken_paci"]
    assert all(loss is not None and math.isfinite(loss) for loss in summary["loss"])
    assert summary["loss"][0] == pytest.approx(case_results["gpt_pp4_pertoken_1f1b"]["loss"][0])
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], 4, 4)
    assert summary["cross_stage_collectives"] == 0


# ---------------------------------------------------------------------------- SIGTERM
def _workers(launcher: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if parent == launcher and b"RANK=" in environ:
            found.append(int(pid))
    return found


def _terminate_midway(tmp_path, schedule: str, to_workers: bool) -> tuple[int, str, float, str]:
    """Start a long run, send SIGTERM after iteration 2 (to the workers, or to torchrun which
    forwards it); return (torchrun's status, log, seconds until the run had saved and said
    so, checkpoint dir)."""
    save, log_path = str(tmp_path / "ckpt"), str(tmp_path / "log")
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "4", os.path.join(REPO, "pretrain_gpt.py"),
               *SMALL, "--pipeline-schedule", schedule, "--save", save]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 150
        while "iteration        2/" not in open(log_path).read():
            assert process.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.2)
        targets = _workers(process.pid) if to_workers else [process.pid]
        assert len(targets) == (4 if to_workers else 1)
        sent = time.time()
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        while "> exiting at iteration" not in open(log_path).read() and process.poll() is None:
            time.sleep(0.1)
        saved_after = time.time() - sent
        returncode = process.wait(timeout=120)
        return returncode, open(log_path).read(), saved_after, save
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass


def _check_stopped_and_saved(log: str, save: str, schedule: str) -> int:
    stop = int(re.search(r"> exiting at iteration (\d+) \(--exit-signal-handler: SIGTERM", log)[1])
    assert not [line for line in log.splitlines() if line.startswith("error: ")], log[-3000:]
    assert "Traceback" not in log.split("Received 15 death signal")[0]  # no worker traceback
    if schedule == "paci":  # agreed ahead: ceil((2N - 1) / a) = 2 iterations after the request
        requested = int(re.search(r"training stops after iteration (\d+) \(drained\)", log)[1])
        assert requested == stop
    payloads = checkpoint_payloads(save, stop)
    assert latest(save) == stop
    assert all(p["iteration"] == stop and p["consumed_train_samples"] == 8 * stop for p in payloads)
    return stop


def test_sigterm_to_the_workers_drains_saves_and_exits_0_under_paci(tmp_path):
    """Slurm signals every process of a job step; here only the workers, so torchrun's exit
    status is theirs."""
    returncode, log, seconds, save = _terminate_midway(tmp_path, "paci", to_workers=True)
    assert returncode == 0, log[-3000:]
    stop = _check_stopped_and_saved(log, save, "paci")
    print(f"paci: stopped and saved after iteration {stop}, {seconds:.1f} s after SIGTERM")
    assert iterations_ahead(4, 4) == 2


def test_sigterm_to_torchrun_is_forwarded_and_the_run_saves_under_flush(tmp_path):
    """torchrun forwards SIGTERM to its workers and waits --shutdown-timeout (30 s) before
    killing them; it then exits 1 itself (its own SignalException), whatever the workers did."""
    returncode, log, seconds, save = _terminate_midway(tmp_path, "1f1b", to_workers=False)
    assert "Received 15 death signal, shutting down workers" in log
    stop = _check_stopped_and_saved(log, save, "1f1b")
    print(f"1f1b: stopped and saved after iteration {stop}, {seconds:.1f} s after SIGTERM")
    assert seconds < 30  # saved within torchrun's default shutdown timeout
    assert returncode == 1
