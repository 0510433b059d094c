"""Megatron command lines on real multi-process runs: tied embeddings, a GPT-3 style command
line on GPT-2 BPE data, a Llama-style model, and run control (exit, resume, skip-train).

References: a one-stage run of the same command line for every pipelined flush run (1F1B-flush
is numerically a non-pipelined run), and the uninterrupted run for resumed ones."""

import glob
import math
import os
import re

import pytest
import run_cases
import torch
from test_gpt_cases import drift_bound

# (pipelined flush case, its one-stage reference)
FLUSH_EQUALS_ONE_STAGE = [
    ("gpt_pp4_tied_1f1b", "gpt_pp1_tied_1f1b"),
    ("gpt_gpt3style_pp4_1f1b", "gpt_gpt3style_pp1_1f1b"),
    ("gpt_llama_pp4_1f1b", "gpt_llama_pp1_1f1b"),
]
PACI_CASES = ["gpt_gpt3style_pp4_paci", "gpt_llama_pp4_paci"]


@pytest.mark.parametrize("pipelined, reference", FLUSH_EQUALS_ONE_STAGE)
def test_pipelined_flush_equals_one_stage(case_results, pipelined, reference):
    """With tied embeddings this holds only if the first and last stages' copies of the
    embedding sum their gradients every step (the embedding-group all-reduce)."""
    expected = case_results[reference]["loss"]
    assert len(expected) == 8
    assert run_cases.relative_difference(case_results[pipelined]["loss"], expected) <= 1e-5


def test_tied_embeddings_change_the_model(case_results):
    tied, untied = case_results["gpt_pp1_tied_1f1b"]["loss"], case_results["gpt_pp1_1f1b"]["loss"]
    assert run_cases.relative_difference(tied, untied) > 1e-3


@pytest.mark.parametrize("name", PACI_CASES)
def test_paci_megatron_style_runs_keep_drift_bound_and_no_global_sync(case_results, name):
    summary = case_results[name]
    assert summary["cross_stage_collectives"] == 0
    for report in summary["stages"]:
        bound = drift_bound(
            report["stage"], summary["pipeline_stages"], summary["num_microbatches"]
        )
        assert report["max_drift"] == bound
    assert summary["loss"][-1] < summary["loss"][0]


def test_gpt3_style_run_logs_like_megatron(case_results):
    summary = case_results["gpt_gpt3style_pp4_1f1b"]
    log = summary["log"]
    assert "checkpoints (no latest_checkpointed_iteration.txt): training from scratch" in log
    assert "| lm loss: " in log and "| loss scale: 1.0 | grad norm: " in log
    throughput = (
        r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): "
    )
    assert re.search(throughput + r"[\d.]+ \| learning rate: ", log)
    loss = summary["validation"][0]["lm loss"]
    assert f"lm loss value: {loss:.6E} | lm loss PPL: {math.exp(loss):.6E} |" in log


def tensorboard_scalars(summary) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(summary["metrics_dir"], "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_megatron_logging_switches_reach_tensorboard(case_results):
    summary = case_results["gpt_gpt3style_pp1_1f1b"]
    scalars = tensorboard_scalars(summary)
    expected_ppl = [math.exp(v["lm loss"]) for v in summary["validation"]]
    assert scalars["lm loss validation ppl"] == pytest.approx(expected_ppl, rel=1e-5)
    for tag in ("params-norm", "num-zeros", "optimizer-time", "forward-backward-time",
                "mem-max-rss-bytes"):  # fmt: skip
        assert len(scalars[tag]) == 8 and all(v >= 0 for v in scalars[tag]), tag
    assert all(v > 1e6 for v in scalars["mem-max-rss-bytes"])


def test_wandb_offline_run_holds_the_tensorboard_scalars(case_results):
    """--wandb-project under PACI on 4 stages, offline: the run file holds every scalar of
    TensorBoard (each stage's drift among them) under the same name and iteration."""
    from wandb_records import read_run, run_file

    summary = case_results["gpt_gpt3style_pp4_paci"]
    run = read_run(run_file(os.path.join(summary["metrics_dir"], "wandb_files")))
    assert (run["project"], run["name"]) == ("paci-functional", "gpt_gpt3style_pp4_paci")
    assert run["config"]["pipeline_schedule"] == "paci"
    scalars = tensorboard_scalars(summary)
    assert {f"drift/stage{s}/max" for s in range(4)} <= set(scalars)
    assert sorted(run["history"]) == sorted(scalars)
    for tag, values in scalars.items():
        assert list(run["history"][tag].values()) == pytest.approx(values, rel=1e-6), tag
    assert list(run["history"]["lm loss"]) == list(range(1, 9))
    assert list(run["history"]["lm loss"].values()) == pytest.approx(summary["loss"], rel=1e-6)


def test_params_norm_is_the_models_under_flush(case_results):
    """The norm summed over the stages (the tied embedding counted once) is the one-stage
    model's; PACI's line reports the last stage's own, which is smaller."""
    one_stage = tensorboard_scalars(case_results["gpt_gpt3style_pp1_1f1b"])["params-norm"]
    pipelined = tensorboard_scalars(case_results["gpt_gpt3style_pp4_1f1b"])["params-norm"]
    assert run_cases.relative_difference(pipelined, one_stage) <= 1e-5
    last_stage = tensorboard_scalars(case_results["gpt_gpt3style_pp4_paci"])["params-norm"]
    assert all(0 < stage < model for stage, model in zip(last_stage, one_stage))
    log = case_results["gpt_gpt3style_pp4_1f1b"]["log"]
    assert "| params norm: " in log and "| num zeros: " in log


def test_exit_interval_then_resume_with_train_samples(case_results):
    """--exit-interval 6 stops an 8-iteration run after 6 (and saves without RNG state); a
    run given --train-samples 64 (= 8 x 8) resumes at 7 and equals the uninterrupted run."""
    uninterrupted = case_results["gpt_pp4_1f1b"]["loss"]
    first = case_results["gpt_runcontrol_1_exit"]
    assert first["iterations"] == 6 and first["loss"] == uninterrupted[:6]
    assert "> exiting at iteration 6 (--exit-interval)" in first["log"]
    resumed = case_results["gpt_runcontrol_2_resume"]["loss"]
    assert resumed == uninterrupted[6:]
    checkpoints = os.path.join(os.path.dirname(first["metrics_dir"]), "runcontrol")
    saved = glob.glob(os.path.join(checkpoints, "iter_0000006", "*", "*.pt"))
    assert len(saved) == 4
    assert all("rng_state" not in torch.load(path, weights_only=False) for path in saved)


def test_skip_train_with_finetune_evaluates_the_loaded_model_at_iteration_0(case_results):
    """--finetune loads the model only and starts at iteration 0; --skip-train evaluates it.
    The loaded (trained) model scores below the untrained model's first training loss."""
    summary = case_results["gpt_runcontrol_3_skiptrain"]
    assert summary["loss"] == [] and summary["iterations"] == 0
    assert [v["iteration"] for v in summary["validation"]] == [0]
    untrained = case_results["gpt_pp4_1f1b"]["loss"][0]
    assert 0 < summary["validation"][0]["lm loss"] < untrained - 0.05
