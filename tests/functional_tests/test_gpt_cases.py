"""Functional tests on real multi-process runs (gloo, fp32, megatron-core GPT, mock data).

References are independent of the code under test where possible: a single-stage run for the
pipelined ones, the closed-form drift bound ceil((N-1-s)/a) for PACI.
"""

import json
import math
import os
import subprocess
import sys

import background
import pytest
import run_cases

PIPELINED_FLUSH = ["gpt_pp4_1f1b", "gpt_tp2pp2_1f1b", "gpt_dp2pp2_1f1b", "gpt_tp2pp2_1f1b_sp"]
# Split-backward schedules (input and weight gradient passes) -> their one-process reference
ZERO_BUBBLE = {
    "gpt_pp4_zbh1": "gpt_pp1_1f1b",
    "gpt_tp2pp2_zbh1": "gpt_pp1_1f1b",
    "gpt_dp2pp2_zbh1": "gpt_pp1_1f1b",
    "gpt_pp4_zbv": "gpt_pp1_8layers_1f1b",  # two chunks of one layer per rank, on a V
    "gpt_pp4_zb_interleaved": "gpt_pp1_8layers_1f1b",  # the same chunks, interleaved
    "gpt_dp2pp2_zbv": "gpt_pp1_1f1b",
    "gpt_tp2pp2_dualpipev": "gpt_pp1_1f1b",
}
# --deterministic-mode: the fixed 1F1B order, reproducible bit for bit.
PACI_FIXED_ORDER = [
    "gpt_pp4_paci_a1",
    "gpt_pp4_paci_a2",
    "gpt_pp4_paci_a4",
    "gpt_tp2pp2_paci",
    "gpt_dp2pp2_paci",
    "gpt_tp2pp2_paci_sp",
]
# Reacting to arrivals: the order depends on timing, the bound must hold all the same.
PACI_REACTIVE = ["gpt_pp4_paci_reactive", "gpt_tp2pp2_paci_reactive"]
PACI_FOUR_RANKS = PACI_FIXED_ORDER + PACI_REACTIVE


def drift_bound(stage: int, num_stages: int, accumulation: int) -> int:
    return math.ceil((num_stages - 1 - stage) / accumulation)


def assert_flush_equals(summary, reference, iterations: int) -> None:
    """A 1F1B-flush run against the one-process reference: losses and validation losses
    within 1e-5 relative."""
    losses, expected = summary["loss"], reference["loss"]
    assert len(losses) == len(expected) == iterations
    assert run_cases.relative_difference(losses, expected) <= 1e-5
    validation = [v["lm loss"] for v in summary["validation"]]
    expected_validation = [v["lm loss"] for v in reference["validation"]]
    assert validation and run_cases.relative_difference(validation, expected_validation) <= 1e-5


def assert_paci_keeps_its_bound(summary, reference_losses) -> None:
    """A PACI run: every stage within its drift bound and at least one asynchronous, its first
    two losses those of the flush reference (no stale weights yet), its loss falling."""
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], n, a)
    assert max(report["max_drift"] for report in summary["stages"]) >= 1
    assert summary["loss"][:2] == pytest.approx(reference_losses[:2], rel=1e-5)
    assert summary["loss"][-1] < summary["loss"][0]


@pytest.mark.parametrize("name", run_cases.cases_with_golden_values())
def test_golden_values(case_results, name):
    golden = run_cases.golden_losses(name)
    assert run_cases.relative_difference(case_results[name]["loss"], golden) <= 1e-3


@pytest.mark.parametrize("name", PIPELINED_FLUSH)
def test_flush_matches_single_stage(case_results, name):
    """Same model, initial weights and data: pipelining must not change the numbers."""
    reference = case_results["gpt_pp1_1f1b"]["loss"]
    assert len(reference) >= 5
    assert run_cases.relative_difference(case_results[name]["loss"], reference) <= 1e-5


@pytest.mark.parametrize("name", sorted(ZERO_BUBBLE))
def test_zero_bubble_schedules_match_one_process_and_hold_the_simulators_activations(
    case_results, name
):
    """ZB-H1, ZB-V, DualPipeV and interleaved zero bubble: the split backward, the V placement (its turn a loopback,
    tied embeddings summed on rank 0) and DualPipeV's paired slots change no number; every
    rank's peak of microbatch-chunks held is the simulator's for the same definition."""
    from megatron.pipeline.plan import resolve_plan
    from megatron.pipeline.simulation import simulate

    result = case_results[name]
    reference = case_results[ZERO_BUBBLE[name]]["loss"]
    assert len(reference) == 8
    assert run_cases.relative_difference(result["loss"], reference) <= 1e-5
    plan = resolve_plan(result["schedule"], num_stages=result["pipeline_stages"])
    simulated = simulate(plan.schedule, num_stages=plan.num_stages,
                         microbatches_per_step=result["num_microbatches"], steps=1,
                         forward_cost=1.0, backward_cost=1.0, weight_grad_cost=1.0,
                         chunks_per_rank=plan.chunks_per_rank)  # fmt: skip
    peaks = [stage["peak_inflight_microbatches"] for stage in result["stages"]]
    assert peaks == simulated.peak_held_per_stage


def test_a_zero_bubble_v_checkpoint_resumes_on_plain_stages(case_results):
    """ZB-V at TP 2 x PP 2 with tied embeddings (both copies on rank 0, summed locally): its 4
    iterations equal the one-process run; saved, then resumed by 1F1B on 4 plain stages, the
    rest of the run equals it too (torch_dist reshards the V's chunks onto stages, TP 2 onto
    1)."""
    reference = case_results["gpt_pp1_tied_1f1b"]["loss"]
    saved = case_results["gpt_zbv_1_tp2pp2_tied_save"]["loss"]
    resumed = case_results["gpt_zbv_2_pp4_tied_load"]["loss"]
    assert run_cases.relative_difference(saved, reference[:4]) <= 1e-5
    assert len(resumed) == 4 and run_cases.relative_difference(resumed, reference[4:]) <= 1e-5


def test_uneven_split_matches_single_stage(case_results):
    """8 layers as 1 + 3 + 3 + 1 (first/last stage sizes given) against one process."""
    reference = case_results["gpt_pp1_8layers_1f1b"]["loss"]
    uneven = case_results["gpt_pp4_uneven_1f1b"]["loss"]
    assert run_cases.relative_difference(uneven, reference) <= 1e-5


def test_qk_layernorm_under_tensor_parallelism_matches_single_stage(case_results):
    reference = case_results["gpt_pp1_1f1b_qkln"]["loss"]
    assert (
        run_cases.relative_difference(case_results["gpt_tp2pp2_1f1b_qkln"]["loss"], reference)
        <= 1e-5
    )


def test_megatron_realtime_check_and_fused_cross_entropy_under_paci(case_results):
    """--test-mode: megatron-core compares the q/k layernorm weights of the tensor-parallel
    ranks at every attention forward and raises on any difference; the run completing means
    the ranks' per-head gradients of those norms were summed (without the sum they drift
    apart within two steps). --cross-entropy-loss-fusion: the same loss at the initial weights
    as the unfused flush run (PACI's first iteration sees only those), then a bf16-rounded
    logit gradient."""
    checks = case_results["gpt_tp2pp2_paci_qkln_checks"]
    flush = case_results["gpt_tp2pp2_1f1b_qkln"]["loss"]
    assert abs(checks["loss"][0] - flush[0]) <= 1e-6 * flush[0]
    assert run_cases.relative_difference(checks["loss"], flush) <= 5e-3
    assert checks["cross_stage_collectives"] == 0


def test_sequence_parallelism_changes_no_number_under_paci(case_results):
    """--sequence-parallel splits the norms' and dropouts' sequence over the tensor-parallel
    ranks and halves the stage-boundary activations; with dropout 0 the run is the same run:
    PACI's fixed order with and without it agrees to float rounding, and the tensor-parallel
    gathers it adds stay inside the stages."""
    with_sp, without = case_results["gpt_tp2pp2_paci_sp"], case_results["gpt_tp2pp2_paci"]
    assert run_cases.relative_difference(with_sp["loss"], without["loss"]) <= 1e-5
    assert with_sp["cross_stage_collectives"] == 0


def test_paci_on_one_stage_is_flush(case_results):
    """With one stage no microbatch can cross a step: PACI is exactly flush."""
    assert case_results["gpt_pp1_paci"]["loss"] == case_results["gpt_pp1_1f1b"]["loss"]


@pytest.mark.parametrize("name", PACI_FOUR_RANKS)
def test_paci_drift_never_exceeds_its_bound(case_results, name):
    summary = case_results[name]
    stages, accumulation = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        bound = drift_bound(report["stage"], stages, accumulation)
        assert max(int(d) for d in report["drift_histogram"]) <= bound, (name, report["stage"])
        assert report["max_drift"] <= bound


@pytest.mark.parametrize("name", PACI_FIXED_ORDER)
def test_paci_drift_reaches_its_bound_in_steady_state(case_results, name):
    summary = case_results[name]
    stages, accumulation = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] == drift_bound(report["stage"], stages, accumulation)


def test_paci_drift_shrinks_with_accumulation(case_results):
    drifts = [
        [r["max_drift"] for r in case_results[f"gpt_pp4_paci_a{a}"]["stages"]] for a in (1, 2, 4)
    ]
    assert drifts == [[3, 2, 1, 0], [2, 1, 1, 0], [1, 1, 1, 0]]


def test_paci_inflight_limit_flush_holds_what_flush_holds(case_results):
    """2 microbatches per step on 4 stages: 1F1B-flush holds at most min(2, 4 - s) in flight.
    PACI's default window (4 - s) holds more; --paci-inflight-limit flush holds flush's count,
    so its activation bytes are that many of flush's microbatches, and it drifts at most
    ceil((window - 1) / a) = 1."""
    depth = case_results["gpt_pp4_paci_a2"]["stages"]
    capped = case_results["gpt_pp4_paci_a2_flushlimit"]["stages"]
    flush = case_results["gpt_pp4_1f1b"]["stages"]  # same model, 4 microbatches per step
    for d, c, f in zip(depth, capped, flush):
        held_by_flush = min(2, 4 - c["stage"])
        assert d["peak_inflight_microbatches"] == 4 - d["stage"]
        assert c["peak_inflight_microbatches"] == held_by_flush
        one_microbatch = f["peak_activation_bytes"] / f["peak_inflight_microbatches"]
        assert c["peak_activation_bytes"] == pytest.approx(held_by_flush * one_microbatch, rel=1e-3)
        assert c["max_drift"] <= math.ceil((held_by_flush - 1) / 2)
    assert capped[0]["max_drift"] == 1  # the first stage overlaps steps


def test_paci_keeps_flush_memory(case_results):
    flush, paci = case_results["gpt_pp4_1f1b"], case_results["gpt_pp4_paci_a4"]
    for f, p in zip(flush["stages"], paci["stages"]):
        assert p["peak_inflight_microbatches"] == f["peak_inflight_microbatches"]
        assert p["peak_inflight_microbatches"] == 4 - p["stage"]
        assert abs(p["peak_activation_bytes"] - f["peak_activation_bytes"]) <= (
            0.02 * f["peak_activation_bytes"]
        )
        state = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
        assert sum(p[k] for k in state) == sum(f[k] for k in state)
        assert p["extra_weight_versions"] == 0


def test_every_stage_steps_once_per_iteration(case_results):
    for name in PACI_FOUR_RANKS + PIPELINED_FLUSH:
        summary = case_results[name]
        assert all(r["optimizer_steps"] == summary["iterations"] for r in summary["stages"])


def test_paci_issues_no_collective_across_stages(case_results):
    """The audit wraps torch.distributed collectives during training; flush's global
    gradient-norm all-reduce shows it detects a cross-stage collective when there is one."""
    for name in PACI_FOUR_RANKS:
        assert case_results[name]["cross_stage_collectives"] == 0, name
    for name in PIPELINED_FLUSH:
        assert case_results[name]["cross_stage_collectives"] > 0, name


def test_megatron_style_log_lines(case_results):
    log = case_results["gpt_pp4_paci_a4"]["log"]
    assert " iteration        1/       8 | consumed samples:            8 |" in log
    assert "lm loss:" in log and "weight drift max/mean by stage: " in log
    assert "validation loss at iteration 4 | lm loss value:" in log


def test_paci_resumes_from_checkpoint_exactly(case_results):
    """A checkpoint is taken at a drained step boundary, so resuming reproduces the
    uninterrupted run bit for bit (same data position, optimizer and LR schedule state), its
    evaluations included: they read on through the validation split where the checkpoint's
    run stopped (iteration 4's evaluation), as Megatron's do."""
    uninterrupted = case_results["gpt_pp4_paci_a4"]
    first_half = case_results["gpt_pp4_paci_resume_1_save"]
    second_half = case_results["gpt_pp4_paci_resume_2_load"]
    assert first_half["loss"] == uninterrupted["loss"][:4]
    assert second_half["loss"] == uninterrupted["loss"][4:]
    assert first_half["validation"] == uninterrupted["validation"][:1]
    assert second_half["validation"] == uninterrupted["validation"][1:]


PACI_REPLAYED = "gpt_pp4_paci_a2_noeval"


@background.started_with_the_session
def paci_replay_losses(directory: str) -> list[float]:
    """The lm loss per iteration of one process replaying each stage's PACI order of the case
    PACI_REPLAYED on plain tensors (paci_reference.py)."""
    case = run_cases.discover_cases()[PACI_REPLAYED]
    command = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "paci_reference.py"),
        *run_cases.flags(case["MODEL_ARGS"], output=directory),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_paci_runtime_matches_single_process_replay(case_results, paci_replay_losses):
    """Four processes exchanging activations and gradients give the numbers of one process
    replaying each stage's PACI order on plain tensors (paci_reference.py)."""
    losses = case_results[PACI_REPLAYED]["loss"]
    assert run_cases.relative_difference(losses, paci_replay_losses) <= 1e-6


def test_the_tp_pp_dp_rank_order_changes_the_ranks_not_the_numbers(case_results):
    """--use-tp-pp-dp-mapping (Megatron's): the pipelines are ranks 0-1 and 2-3 instead of 0-2
    and 1-3, and PACI's numbers, drift included, are the default order's bit for bit."""
    mapped, default = case_results["gpt_dp2pp2_paci_tppdp"], case_results["gpt_dp2pp2_paci"]
    assert "> rank order tp-cp-ep-pp-dp: rank 0's pipeline is ranks [0, 1]" in mapped["log"]
    assert "> rank order tp-cp-ep-dp-pp: rank 0's pipeline is ranks [0, 2]" in default["log"]
    assert mapped["loss"] == default["loss"]
    assert [s["max_drift"] for s in mapped["stages"]] == [s["max_drift"] for s in default["stages"]]
