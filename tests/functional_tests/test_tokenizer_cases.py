"""Megatron's TikTokenizer on a real run: a TikToken vocabulary in Megatron's format built
offline from the corpus's GPT-2 BPE (tools/build_tiktoken_vocab.py), the corpus tokenized with
it by tools/preprocess_data.py, and two pipeline stages trained on it under PACI."""

import math


def test_a_tiktokenizer_corpus_trains(case_results):
    summary = case_results["gpt_tiktoken_pp2_paci"]
    losses = summary["loss"]
    assert len(losses) == 12
    # 2,023 ids (1,000 special, then the 1,023 ranks) padded to 2,048 logits: a random model's
    # loss is about ln(2048); the corpus's ids all lie among the ranks and eod
    assert abs(losses[0] - math.log(2048)) < 0.3
    assert losses[-1] < losses[0] - 0.5
