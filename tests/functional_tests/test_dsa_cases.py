"""DeepSeek sparse attention (--experimental-attention-variant dsa) on real multi-process runs
(gloo, CPU): megatron-core's DSAttention with its lightning indexer as MLA's core attention,
each query attending to the indexer's top 8 of 32 keys. The indexer's KL loss is strong here
(coefficient 10), so the indexer moves and with it the keys each query sees: a wrong indexer
gradient changes the model's losses.

Reference: the same model on one process. TP 2 x PP 2 with sequence parallelism (the indexer
whole on each tensor rank) changes no number beyond float tolerance under 1F1B-flush; four
PACI stages keep their drift bound while the loss falls; the indexer loss is logged."""

from test_gpt_cases import assert_flush_equals, assert_paci_keeps_its_bound

REFERENCE = "gpt_dsa_pp1_1f1b"


def test_flush_equals_one_process(case_results):
    assert_flush_equals(case_results["gpt_dsa_tp2pp2_1f1b_sp"], case_results[REFERENCE],
                        iterations=6)  # fmt: skip


def test_paci_keeps_its_drift_bound(case_results):
    assert_paci_keeps_its_bound(case_results["gpt_dsa_pp4_paci"], case_results[REFERENCE]["loss"])


def test_the_indexer_loss_is_logged_and_falls(case_results):
    reference = case_results[REFERENCE]
    losses = reference["stages"][0]["indexer_losses"]
    assert len(losses) == 6 and all(loss > 0 for loss in losses)
    assert losses[-1] < losses[0]  # the indexer learns the attention it selects for
    assert "indexer loss: " in reference["log"]
