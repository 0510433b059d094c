"""Context parallelism on real 4-process runs (gloo, megatron-core's GPT, the portable ring
attention): each sequence split into 2 x CP chunks over the context-parallel ranks.

References independent of the code under test: the one-process run of the same model (flush
over any layout equals it within float tolerance) and PACI's closed-form drift bound.
"""

import math

import pytest
import run_cases

FLUSH = ["gpt_cp2pp2_1f1b", "gpt_tp2cp2_1f1b_sp"]


@pytest.mark.parametrize("name", FLUSH)
def test_context_parallel_flush_matches_one_process(case_results, name):
    reference = case_results["gpt_pp1_1f1b"]["loss"]
    assert len(reference) == 8
    assert run_cases.relative_difference(case_results[name]["loss"], reference) <= 1e-5
    assert "context 2" in case_results[name]["log"]


def test_rope_and_grouped_query_attention_under_context_parallelism(case_results):
    """Rotary positions of each rank's two chunks and the ring with 2 key/value groups: the
    Llama-style model at CP 2 x PP 2 equals its one-process run."""
    reference = case_results["gpt_llama_pp1_1f1b"]["loss"]
    ours = case_results["gpt_llama_cp2pp2_1f1b"]["loss"]
    assert len(reference) == 8 and run_cases.relative_difference(ours, reference) <= 1e-5


def test_paci_with_context_parallelism_keeps_its_bound_and_its_stages_apart(case_results):
    """On the default corpus: each stage's ring and its decisions (shared by the stage's
    context-parallel ranks) stay inside the stage: no collective crosses stages; the drift
    bound holds; the model learns."""
    summary = case_results["gpt_cp2pp2_paci"]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= math.ceil((n - 1 - report["stage"]) / a)
    assert summary["cross_stage_collectives"] == 0
    assert summary["loss"][-1] < summary["loss"][0]


def test_a_context_parallel_checkpoint_resumes_without_it(case_results):
    """Saved at CP 2 x PP 2 after 4 iterations, resumed at CP 1 on 4 stages (torch_dist): the
    rest of the run equals the one-process run's."""
    reference = case_results["gpt_pp1_1f1b"]["loss"]
    saved = case_results["gpt_cp_1_cp2pp2_save"]["loss"]
    resumed = case_results["gpt_cp_2_pp4_load"]["loss"]
    assert run_cases.relative_difference(saved, reference[:4]) <= 1e-5
    assert len(resumed) == 4 and run_cases.relative_difference(resumed, reference[4:]) <= 1e-5
    assert abs(resumed[0] - reference[4]) <= 1e-6 * reference[4]  # the first loss after it


def test_per_token_loss_with_context_parallelism_equals_one_process(case_results):
    """--calculate-per-token-loss: each rank backpropagates its own chunks' loss sum and the
    step divides by the tokens counted over data x context ranks (the mask differs per token,
    so the ranks' counts differ)."""
    one = case_results["gpt_pp1_pertoken_1f1b"]["loss"]
    assert len(one) == 6
    ours = case_results["gpt_cp2pp2_pertoken_1f1b"]["loss"]
    assert run_cases.relative_difference(ours, one) <= 1e-5
