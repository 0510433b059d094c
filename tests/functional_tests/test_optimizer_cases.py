"""Every optimizer of the suite on real 4-process runs (gloo), under 1F1B-flush and PACI, and
the delay mitigations in the runtime.

Independent reference: the single-process synchronous run (`delayed_reference.py`, delay 0).
Every optimizer of the suite updates each parameter on its own (Muon and SOAP per matrix), so
4 pipeline stages under flush must give the single process's numbers.
"""

import math

import background
import delayed_reference_runs
import pytest
import run_cases
from run_cases import relative_difference

OPTIMIZERS = ["adam", "sgd", "muon", "lion", "adan", "soap", "mars"]
SCHEDULES = ["1f1b", "paci"]
FLUSH_CASES = [f"gpt_pp4_1f1b_opt_{name}" for name in OPTIMIZERS] + ["gpt_pp4_1f1b_opt_muon_ef"]


@background.started_with_the_session
def single_process_losses(directory: str) -> dict[str, list[float]]:
    """The flush cases' flags, trained in one process without the pipeline runtime."""
    cases = run_cases.discover_cases()
    names = FLUSH_CASES + ["gpt_tp2pp2_1f1b_opt_muon"]
    spec = [
        {"name": n, "args": run_cases.flags(cases[n]["MODEL_ARGS"], "unused"), "delay": 0}
        for n in names
    ]
    return delayed_reference_runs.run_in_subprocess(spec, directory)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_completes_a_run(case_results, name, schedule):
    summary = case_results[f"gpt_pp4_{schedule}_opt_{name}"]
    assert len(summary["loss"]) == 3 and all(math.isfinite(x) for x in summary["loss"])
    assert all(stage["optimizer_steps"] == 3 for stage in summary["stages"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_optimizer_makes_its_own_updates(case_results, schedule):
    """Same model, data and first loss; from the second step on, seven different losses."""
    finals = [case_results[f"gpt_pp4_{schedule}_opt_{n}"]["loss"] for n in OPTIMIZERS]
    assert len({losses[0] for losses in finals}) == 1
    assert len({round(losses[-1], 6) for losses in finals}) == len(OPTIMIZERS)


@pytest.mark.parametrize("name", FLUSH_CASES)
def test_flush_on_four_stages_equals_the_single_process_run(case_results, single_process_losses,
                                                           name):  # fmt: skip
    assert relative_difference(case_results[name]["loss"], single_process_losses[name]) <= 1e-5


def test_muon_under_tensor_parallelism_orthogonalizes_shards(case_results, single_process_losses):
    """TP = 2: each rank orthogonalizes its own shard (blockwise), so from the first Muon
    update on the run differs from the single process, which orthogonalizes whole matrices
    (AdamW under TP = 2 matches it: test_gpt_cases.py)."""
    tp = case_results["gpt_tp2pp2_1f1b_opt_muon"]["loss"]
    single = single_process_losses["gpt_tp2pp2_1f1b_opt_muon"]
    assert relative_difference(tp[:1], single[:1]) <= 1e-6
    assert abs(tp[-1] - single[-1]) / single[-1] > 1e-5


def test_mitigations_change_the_paci_run(case_results):
    plain = case_results["gpt_pp4_paci_opt_adam"]["loss"]
    mitigated = case_results["gpt_pp4_paci_opt_adam_ef_dc"]["loss"]
    assert all(math.isfinite(x) for x in mitigated) and mitigated[0] == plain[0]
    assert relative_difference(mitigated[1:], plain[1:]) > 1e-5
    # Error feedback and DC keep one parameter-sized buffer each: counted as optimizer state.
    for with_buffers, without in zip(
        case_results["gpt_pp4_paci_opt_adam_ef_dc"]["stages"],
        case_results["gpt_pp4_paci_opt_adam"]["stages"],
    ):
        extra = with_buffers["optimizer_state_bytes"] - without["optimizer_state_bytes"]
        assert extra == 2 * with_buffers["param_bytes"]


def test_synchronous_start_and_cooldown_switch_schedules_at_drained_boundaries(case_results):
    """--async-sync-warmup-iters 2 --async-sync-cooldown-iters 2 over 6 iterations: flush for
    iterations 1-2 and 5-6, PACI for 3-4. Up to the first PACI iteration the run is the flush
    run (iteration 3's forwards all see the weights of the drained boundary); then PACI's
    stale microbatches make it differ. Drift is PACI's, no collective crosses stages (the
    flush phases clip per stage, like PACI), every stage steps once per iteration."""
    flush = case_results["gpt_pp4_1f1b_sync_phases_ref"]["loss"]
    phased = case_results["gpt_pp4_paci_sync_phases"]
    assert phased["loss"][:3] == flush[:3] and phased["loss"][3] != flush[3]
    assert [stage["max_drift"] for stage in phased["stages"]] == [1, 1, 1, 0]
    assert all(stage["optimizer_steps"] == 6 for stage in phased["stages"])
    assert phased["cross_stage_collectives"] == 0


def test_error_feedback_steps_the_plain_update_in_the_synchronous_phases(case_results):
    """The same run with --async-error-feedback: in the flush phases the gradients are fresh, so
    error feedback steps the plain update and the run equals the flush run up to the first
    PACI iteration (within rounding: it applies AdamW's decay apart); extrapolating there, its
    second loss would be a step ahead. Then PACI's stale microbatches and the correction make
    it differ from the same run without error feedback."""
    flush = case_results["gpt_pp4_1f1b_sync_phases_ref"]["loss"]
    feedback = case_results["gpt_pp4_paci_sync_phases_ef"]
    plain = case_results["gpt_pp4_paci_sync_phases"]["loss"]
    assert relative_difference(feedback["loss"][:3], flush[:3]) <= 1e-6
    assert relative_difference(feedback["loss"][3:], plain[3:]) > 1e-5
    assert [stage["max_drift"] for stage in feedback["stages"]] == [1, 1, 1, 0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_precision_aware_optimizer_halves_adams_state_on_every_stage(case_results, schedule):
    """--use-precision-aware-optimizer with bf16 moments on 4 stages (flush and PACI): every
    stage steps as often as with fp32 moments, holds half the optimizer-state bytes, and the
    losses stay within bf16 rounding of the fp32-moment run."""
    plain = case_results[f"gpt_pp4_{schedule}_opt_adam"]
    low = case_results[f"gpt_pp4_{schedule}_opt_adam_pao"]
    assert low["loss"][0] == plain["loss"][0]
    assert relative_difference(low["loss"], plain["loss"]) <= 1e-3
    for ours, fp32 in zip(low["stages"], plain["stages"], strict=True):
        assert ours["optimizer_steps"] == fp32["optimizer_steps"] == 3
        assert 2 * ours["optimizer_state_bytes"] == fp32["optimizer_state_bytes"]
