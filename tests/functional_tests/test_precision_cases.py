"""Mixed precision and the distributed optimizer on real multi-process runs (gloo, CPU).

* the distributed optimizer (DP = 2 x PP = 2) gives the unsharded run's losses, holds half the
  optimizer state per rank, and under PACI adds no cross-stage collective; two copies of it
  over DP = 4 give the one-process run's losses with half the state per rank;
* bf16 (fp32 main weights and gradient accumulation) tracks the fp32 run; its optimizer state
  is fp32 (as many bytes as the fp32 run's);
* fp16 with an overflow injected into stage 1's third step: under PACI only stage 1 skips and
  halves its loss scale; under 1F1B-flush every stage does (Megatron's model-wide found-inf).
"""

import math
import re

import pytest
from run_cases import relative_difference

STAGES = 4


def test_distributed_optimizer_copies_match_the_single_process_run(case_results):
    """DP = 4 with two copies of the distributed optimizer, each sharded over two ranks: the
    one-process run's losses, and half its optimizer state per rank."""
    reference = case_results["gpt_pp1_1f1b"]
    copies = case_results["gpt_dp4_1f1b_distopt_instances2"]
    assert relative_difference(copies["loss"], reference["loss"]) <= 1e-5
    whole = reference["stages"][0]["optimizer_state_bytes"]
    assert abs(copies["stages"][0]["optimizer_state_bytes"] - whole / 2) <= 64 * 4


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_distributed_optimizer_matches_the_unsharded_run(case_results, schedule):
    plain = case_results[f"gpt_dp2pp2_{schedule}"]
    sharded = case_results[f"gpt_dp2pp2_{schedule}_distopt"]
    assert relative_difference(sharded["loss"], plain["loss"]) <= 1e-6
    by_rank = zip(plain["optimizer_state_bytes_by_rank"], sharded["optimizer_state_bytes_by_rank"])
    for whole, mine in by_rank:
        assert whole > 0 and abs(mine - whole / 2) <= 64  # half, give or take the padding
    for stage in sharded["stages"]:  # fp32 main weights: half of this rank's parameters
        assert abs(stage["main_param_bytes"] - stage["param_bytes"] / 2) <= 8
    if schedule == "paci":
        assert sharded["cross_stage_collectives"] == 0


def test_distributed_optimizer_checkpoint_resumes_without_it(case_results):
    """The checkpoint holds the unsharded state: a run without the distributed optimizer
    resumes it and continues the sharded run's losses."""
    sharded = case_results["gpt_dp2pp2_paci_distopt"]["loss"]
    first_half = case_results["gpt_dp2pp2_paci_distopt_resume_1_save"]["loss"]
    second_half = case_results["gpt_dp2pp2_paci_distopt_resume_2_load"]["loss"]
    assert first_half == sharded[:4]
    assert relative_difference(second_half, sharded[4:]) <= 1e-6


def test_bf16_tracks_fp32_with_fp32_optimizer_state(case_results):
    fp32, bf16 = case_results["gpt_pp4_1f1b"], case_results["gpt_pp4_1f1b_bf16"]
    assert 0 < relative_difference(bf16["loss"], fp32["loss"]) <= 1e-2
    for full, half in zip(fp32["stages"], bf16["stages"]):
        assert half["param_bytes"] * 2 == full["param_bytes"]
        assert half["main_param_bytes"] == full["param_bytes"]  # fp32 copies
        assert half["optimizer_state_bytes"] == full["optimizer_state_bytes"]  # fp32 state


def test_bf16_with_the_distributed_optimizer_under_paci(case_results):
    fp32 = case_results["gpt_dp2pp2_paci"]
    sharded = case_results["gpt_dp2pp2_paci_bf16_distopt"]
    assert relative_difference(sharded["loss"], fp32["loss"]) <= 1e-2
    assert sharded["cross_stage_collectives"] == 0
    for stage in sharded["stages"]:  # bf16 weights, half of them again in fp32
        assert abs(stage["main_param_bytes"] - stage["param_bytes"]) <= 8


def _iteration_line(run: dict, name: str, iteration: int) -> str:
    """The case's own iteration line (cases of one launch share a log, in order)."""
    log = run["log"].split(f"=== case {name}\n", 1)[1].split("=== case ", 1)[0]
    return next(line for line in log.splitlines() if re.search(rf"iteration +{iteration}/", line))


def test_fp16_overflow_in_one_stage_under_paci_skips_that_stage_only(case_results):
    run = case_results["gpt_pp4_paci_fp16_overflow"]
    assert run["skipped_steps_by_stage"] == [0, 1, 0, 0]
    assert [s["loss_scale"] for s in run["stages"]] == [4096.0, 2048.0, 4096.0, 4096.0]
    assert all(s["optimizer_steps"] == 8 for s in run["stages"])
    assert math.isfinite(run["final_loss"]) and run["final_loss"] < run["loss"][0]
    assert run["cross_stage_collectives"] == 0
    assert "loss scale: 4096.0 |" in _iteration_line(run, "gpt_pp4_paci_fp16_overflow", 8)


def test_fp16_overflow_under_flush_skips_every_stage_together(case_results):
    run = case_results["gpt_pp4_1f1b_fp16_overflow"]
    assert run["skipped_steps_by_stage"] == [1] * STAGES
    assert [s["loss_scale"] for s in run["stages"]] == [2048.0] * STAGES
    assert math.isfinite(run["final_loss"]) and run["final_loss"] < run["loss"][0]
    line = _iteration_line(run, "gpt_pp4_1f1b_fp16_overflow", 3)
    assert "loss scale: 2048.0 |" in line and "number of skipped iterations:   1 |" in line
