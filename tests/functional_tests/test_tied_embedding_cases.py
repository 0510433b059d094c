"""Tied embeddings under the asynchronous schedules, on real 4-process runs (gloo, mock data).

The first stage steps the tied weight with the sum of both copies' gradients and the last
stage's copy adopts it L = ceil(N / a) steps later and at every drain
(megatron/training/optimizer/tied_embeddings.py). Independent references: 1F1B-flush with
tied embeddings (Megatron's all-reduce), which one PACI step must equal bit for bit, and whose
checkpoints PACI resumes (and the reverse); the closed-form lag bound; the collective audit.
"""

import math

import pytest
import run_cases
from run_cases import relative_difference
from test_gpt_cases import drift_bound

from megatron.pipeline.schedules import get_schedule

ASYNCHRONOUS = [
    "gpt_pp4_paci_tied",
    "gpt_dp2pp2_paci_tied_bf16_distopt",
    "gpt_tp2pp2_paci_tied_fp16",
    "gpt_pp4_2bw_tied",
    "gpt_pp4_pipedream_tied",
    "gpt_tied_1_pp4_paci_save",
    "gpt_tied_3_1f1b_to_paci",
]


def ends(summary: dict) -> tuple[dict, dict]:
    """The first and the last stage's reports."""
    return summary["stages"][0], summary["stages"][-1]


@pytest.mark.parametrize("name", ASYNCHRONOUS)
def test_copies_are_bit_identical_at_the_end_and_the_lag_stays_in_its_bound(case_results, name):
    summary = case_results[name]
    first, last = ends(summary)
    assert first["tied_weight_sha256"] == last["tied_weight_sha256"]
    n = summary["pipeline_stages"]
    per_update = get_schedule(summary["schedule"]).microbatches_per_update(
        summary["num_microbatches"]
    )
    bound = math.ceil(n / per_update)
    exchange = last["tied_embedding"]
    assert first["tied_embedding"]["role"] == "first" and exchange["role"] == "last"
    assert exchange["lag_bound"] == first["tied_embedding"]["lag_bound"] == bound
    assert 1 <= exchange["max_lag"] <= bound
    assert sum(exchange["lag_histogram"].values()) == exchange["steps"] == last["optimizer_steps"]
    assert first["tied_embedding"]["steps"] == first["optimizer_steps"] == exchange["steps"]
    assert summary["cross_stage_collectives"] == 0
    for report in summary["stages"][1:-1]:
        assert "tied_embedding" not in report and "tied_weight_sha256" not in report
    if summary["schedule"] == "paci":
        for report in summary["stages"]:
            assert report["max_drift"] <= drift_bound(report["stage"], n, per_update)


@pytest.mark.parametrize("name", ASYNCHRONOUS)
def test_traffic_is_one_gradient_and_one_weight_per_step(case_results, name):
    """The last stage sends fp32 gradients, the first the weight in the model's dtype; a
    sender holds at most L + 1 messages."""
    first, last = (report["tied_embedding"] for report in ends(case_results[name]))
    weight_bytes = first["bytes_sent_per_step"]
    element = 2 if ("bf16" in name or "fp16" in name) else 4
    assert last["bytes_sent_per_step"] == weight_bytes * 4 / element
    for side, message in ((first, weight_bytes), (last, last["bytes_sent_per_step"])):
        assert message <= side["peak_message_bytes"] <= (side["lag_bound"] + 1) * message


def test_one_paci_step_equals_flush_bit_for_bit(case_results):
    """Every stage's first PACI step takes the gradients of W(0) only, and the first stage
    adds the last stage's gradient as flush's all-reduce does: the same tied weight."""
    paci = case_results["gpt_pp4_paci_tied_one_step"]
    flush = case_results["gpt_pp4_1f1b_tied_one_step"]
    assert paci["loss"] == flush["loss"]
    digests = {report["tied_weight_sha256"] for run in (paci, flush) for report in ends(run)}
    assert len(digests) == 1


def test_tied_paci_stays_close_to_tied_flush(case_results):
    """The same 8 iterations as gpt_pp4_tied_1f1b: within 1% of its loss at every one."""
    paci = case_results["gpt_pp4_paci_tied"]["loss"]
    flush = case_results["gpt_pp4_tied_1f1b"]["loss"]
    assert len(paci) == len(flush) == 8
    assert paci[0] == flush[0]  # W(0) on both
    assert paci != flush  # PACI's drift and the copy's lag do change the trajectory
    assert relative_difference(paci, flush) <= 0.01


def test_saving_run_is_the_uninterrupted_run(case_results):
    saved = case_results["gpt_tied_1_pp4_paci_save"]
    assert saved["loss"] == case_results["gpt_pp4_paci_tied"]["loss"][:4]
    assert "> saved checkpoint at iteration 4" in saved["log"]


def test_tied_paci_checkpoint_resumes_under_flush(case_results):
    """The first resumed iteration forwards on the checkpoint's weights under either
    schedule: flush's first loss is the one PACI itself continues with."""
    resumed = case_results["gpt_tied_2_paci_to_1f1b"]
    paci_continued = case_results["gpt_pp4_paci_tied"]["loss"][4]
    assert len(resumed["loss"]) == 4
    assert relative_difference(resumed["loss"][:1], [paci_continued]) <= 1e-6
    first, last = ends(resumed)
    assert first["tied_weight_sha256"] == last["tied_weight_sha256"]
    assert "another schedule: --pipeline-schedule 1f1b (checkpoint paci)" in resumed["log"]


def test_tied_flush_checkpoint_resumes_under_paci(case_results):
    resumed = case_results["gpt_tied_3_1f1b_to_paci"]
    flush_continued = case_results["gpt_pp4_tied_1f1b"]["loss"][4]
    assert len(resumed["loss"]) == 4
    assert relative_difference(resumed["loss"][:1], [flush_continued]) <= 1e-6
    assert "another schedule: --pipeline-schedule paci (checkpoint 1f1b)" in resumed["log"]


def test_cases_are_the_documented_ones():
    cases = run_cases.discover_cases()
    for name in ASYNCHRONOUS + ["gpt_tied_2_paci_to_1f1b", "gpt_pp4_paci_tied_one_step"]:
        assert "--untie-embeddings-and-output-weights" not in cases[name]["MODEL_ARGS"], name
