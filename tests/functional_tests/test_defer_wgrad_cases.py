"""--defer-embedding-wgrad-compute on real TP=2 x PP=2 runs (gloo, mock data): the same numbers
as the same run without the flag, under 1F1B-flush (Megatron's limit of 2), PACI with sequence
parallelism (drained before each stage's own step), tied fp16 PACI (limit 1: the drained
gradient reaches the tied copy's fp32 main gradient through its hooks, before the tied
exchange) and ZB-H1 (a split backward: the output layer has nothing left for the W pass); and
DP=2 x PP=2 1F1B (drained before the data-parallel average).

Each run's last stage reports what it deferred, so the equal numbers are not those of a flag
that did nothing: 8 steps of 4 microbatches (2 per data-parallel rank with DP 2); kept per
microbatch, the output layer's input [32, 2, 64] (gathered over the tensor-parallel ranks with
sequence parallelism) and output gradient [32, 2, 1024 / tp] (the padded vocabulary's shard),
4 bytes each (2 with --fp16)."""

import pytest
from run_cases import relative_difference

DEFERRED = {
    "gpt_tp2pp2_1f1b_defer_wgrad": "gpt_tp2pp2_1f1b",
    "gpt_tp2pp2_paci_sp_defer_wgrad": "gpt_tp2pp2_paci_sp",
    "gpt_tp2pp2_paci_tied_fp16_defer_wgrad": "gpt_tp2pp2_paci_tied_fp16",
    "gpt_tp2pp2_zbh1_defer_wgrad": "gpt_tp2pp2_zbh1",
    "gpt_dp2pp2_1f1b_defer_wgrad": "gpt_dp2pp2_1f1b",
}
TP2_KEPT = 32 * 2 * (64 + 1024 // 2) * 4  # one microbatch's input and output gradient, a rank
# deferred microbatches over the run, most kept at once, bytes kept per microbatch
REPORTED = {
    "gpt_tp2pp2_1f1b_defer_wgrad": (8 * 2, 2, TP2_KEPT),  # limit 2: 2 of each step's 4
    "gpt_tp2pp2_paci_sp_defer_wgrad": (8 * 4, 4, TP2_KEPT),  # a step's, drained at its step
    "gpt_tp2pp2_paci_tied_fp16_defer_wgrad": (8 * 1, 1, TP2_KEPT // 2),  # limit 1, fp16
    "gpt_tp2pp2_zbh1_defer_wgrad": (8 * 4, 4, TP2_KEPT),
    "gpt_dp2pp2_1f1b_defer_wgrad": (8 * 2, 2, 32 * 2 * (64 + 1024) * 4),  # a DP rank's 2
}


@pytest.mark.parametrize("name", DEFERRED)
def test_deferred_output_layer_weight_gradient_keeps_the_numbers(case_results, name):
    deferred, reference = case_results[name], case_results[DEFERRED[name]]
    assert len(reference["loss"]) == 8
    assert relative_difference(deferred["loss"], reference["loss"]) <= 1e-6
    validation = [v["lm loss"] for v in deferred["validation"]]
    expected = [v["lm loss"] for v in reference["validation"]]
    assert len(validation) == 2 and relative_difference(validation, expected) <= 1e-6
    assert deferred["skipped_steps_by_stage"] == reference["skipped_steps_by_stage"]


@pytest.mark.parametrize("name", DEFERRED)
def test_only_the_last_stage_defers_and_reports_what_it_kept(case_results, name):
    first, last = case_results[name]["stages"]
    assert "deferred_wgrad" not in first
    assert "deferred_wgrad" not in case_results[DEFERRED[name]]["stages"][-1]
    microbatches, peak, kept_bytes = REPORTED[name]
    assert last["deferred_wgrad"] == {
        "microbatches": microbatches,
        "peak_kept": peak,
        "peak_kept_bytes": peak * kept_bytes,
    }
