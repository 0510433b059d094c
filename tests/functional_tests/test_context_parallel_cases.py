"""Context parallelism on real 4-process runs (gloo, megatron-core's GPT, the portable ring
attention): each sequence split into 2 x CP chunks over the context-parallel ranks.

The other communication types (--cp-comm-type a2a+p2p with --hierarchical-context-parallel-
sizes 2 2 on 8 processes, one type per layer) and attention dropout under the ring.

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


OTHER_COMM_TYPES = {
    "gpt_cp4pp2_a2a_p2p_1f1b": "context 4 (a2a+p2p, 2 x 2)",
    "gpt_cp2pp2_mixed_comm_1f1b": "context 2 (p2p all_gather a2a p2p)",
}


@pytest.mark.parametrize("name", sorted(OTHER_COMM_TYPES))
def test_other_comm_types_flush_matches_one_process(case_results, name):
    """a2a+p2p (CP 4 = all-to-all 2 x ring 2) x PP 2 on 8 processes, and one type per layer
    (p2p, all_gather, a2a, p2p) at CP 2 x PP 2: each equals the one-process run and the ring's
    CP 2 x PP 2 run."""
    reference, ring = case_results["gpt_pp1_1f1b"]["loss"], case_results["gpt_cp2pp2_1f1b"]["loss"]
    assert len(reference) == 8
    assert run_cases.relative_difference(case_results[name]["loss"], reference) <= 1e-5
    assert run_cases.relative_difference(case_results[name]["loss"], ring) <= 1e-5
    assert OTHER_COMM_TYPES[name] in case_results[name]["log"]  # the start-up line


def test_paci_with_hierarchical_context_parallelism(case_results):
    """PACI at PP 2 x CP 4 (a2a+p2p): the all-to-all and the ring stay inside each stage, the
    drift bound holds, the model learns."""
    summary = case_results["gpt_cp4pp2_a2a_p2p_paci"]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= math.ceil((n - 1 - report["stage"]) / a)
    assert summary["cross_stage_collectives"] == 0
    assert summary["loss"][-1] < summary["loss"][0]


def test_attention_dropout_with_context_parallelism_learns(case_results):
    """--attention-dropout 0.1 at CP 2 x PP 2: the ring drops (the losses differ from the run
    without dropout), stays close to it (dropout after the softmax's normalization, scaled by
    1 / (1 - p): the same expected output) and the model learns. Measured: 1.6e-4 apart."""
    ours = case_results["gpt_cp2pp2_dropout_1f1b"]["loss"]
    without = case_results["gpt_cp2pp2_1f1b"]["loss"]
    assert len(ours) == 8 and all(math.isfinite(loss) for loss in ours)
    assert 1e-5 < run_cases.relative_difference(ours, without) < 1e-2
    assert ours[-1] < ours[0]
