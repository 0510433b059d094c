"""Activation recomputation (megatron-core's, under Megatron's flags) on real 2-stage runs.

The cases (`gpt_pp2_*`, one torchrun launch) train with dropout 0.1 so that a recomputed
forward that drew other dropout masks than its forward would change the gradients. The
references are the same runs without recomputation, and for the activation bytes a closed form:
full recomputation keeps only the input of each recomputed chunk of layers, a
[seq, micro batch, hidden] fp32 tensor.
"""

import pytest

FLUSH = "gpt_pp2_1f1b_dropout"
PACI = "gpt_pp2_paci_dropout"
FLUSH_RECOMPUTED = [
    "gpt_pp2_1f1b_recompute_full_uniform1",
    "gpt_pp2_1f1b_recompute_full_uniform2",
    "gpt_pp2_1f1b_recompute_full_block1",
    "gpt_pp2_1f1b_recompute_selective",
]
LAYERS_PER_STAGE = 2  # 4 layers on 2 stages
SEQ, MICRO_BATCH, HIDDEN = 32, 2, 64
CHUNK_INPUT_BYTES = SEQ * MICRO_BATCH * HIDDEN * 4  # one [s, b, h] fp32 tensor


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def bytes_per_microbatch(summary: dict) -> list[int]:
    """Activation bytes one microbatch holds on each stage (all microbatches are alike)."""
    result = []
    for stage in summary["stages"]:
        peak, inflight = stage["peak_activation_bytes"], stage["peak_inflight_microbatches"]
        assert inflight == 2 - stage["stage"] and peak % inflight == 0
        result.append(peak // inflight)
    return result


@pytest.mark.parametrize("name", FLUSH_RECOMPUTED)
def test_recomputation_keeps_the_flush_losses(case_results, name):
    """Same numbers as without recomputation, dropout included (the masks are redrawn)."""
    reference = case_results[FLUSH]["loss"]
    assert len(reference) == 6
    assert relative_difference(case_results[name]["loss"], reference) <= 1e-6


@pytest.mark.parametrize("name", FLUSH_RECOMPUTED)
def test_recomputation_holds_fewer_activations(case_results, name):
    plain = bytes_per_microbatch(case_results[FLUSH])
    recomputed = bytes_per_microbatch(case_results[name])
    assert all(r < p for r, p in zip(recomputed, plain)), (recomputed, plain)


def test_full_uniform_keeps_one_input_per_chunk(case_results):
    """Chunks of 1 layer keep L inputs, one chunk of L layers keeps 1: L - 1 inputs apart."""
    per_layer = bytes_per_microbatch(case_results["gpt_pp2_1f1b_recompute_full_uniform1"])
    per_stage = bytes_per_microbatch(case_results["gpt_pp2_1f1b_recompute_full_uniform2"])
    for one, whole in zip(per_layer, per_stage):
        assert one - whole == (LAYERS_PER_STAGE - 1) * CHUNK_INPUT_BYTES


def test_full_block_saves_per_recomputed_layer(case_results):
    """Block of 1 of 2 layers saves half of what recomputing both layers saves: each layer
    trades what it holds for its input."""
    plain = bytes_per_microbatch(case_results[FLUSH])
    both = bytes_per_microbatch(case_results["gpt_pp2_1f1b_recompute_full_uniform1"])
    first = bytes_per_microbatch(case_results["gpt_pp2_1f1b_recompute_full_block1"])
    for p, b, f in zip(plain, both, first):
        assert 2 * (p - f) == p - b


def test_paci_recomputes_core_attention_exactly(case_results):
    """Core attention has no weights: recomputing it under PACI (weights stepped since the
    forward) gives exactly PACI's numbers without recomputation."""
    reference = case_results[PACI]["loss"]
    assert relative_difference(case_results["gpt_pp2_paci_recompute_selective"]["loss"],
                               reference) <= 1e-6  # fmt: skip


def test_paci_with_full_recomputation(case_results):
    """Full recomputation under PACI: the flush run's activation bytes, the drift bound, and
    a backward through the current weights, which moves the loss slightly off PACI's."""
    paci = case_results["gpt_pp2_paci_recompute_full_uniform1"]
    flush = case_results["gpt_pp2_1f1b_recompute_full_uniform1"]
    assert bytes_per_microbatch(paci) == bytes_per_microbatch(flush)
    assert [s["max_drift"] for s in paci["stages"]] == [1, 0]
    difference = relative_difference(paci["loss"], case_results[PACI]["loss"])
    assert 0 < difference <= 1e-2


def test_selective_drops_the_same_on_every_stage_and_schedule(case_results):
    """Selective (core_attn) recomputes the same layers everywhere: the same bytes per layer
    on both stages, and under PACI the same as under flush."""
    plain = bytes_per_microbatch(case_results[FLUSH])
    flush = bytes_per_microbatch(case_results["gpt_pp2_1f1b_recompute_selective"])
    paci = bytes_per_microbatch(case_results["gpt_pp2_paci_recompute_selective"])
    drops = {p - s for p, s in zip(plain, flush)}
    assert len(drops) == 1 and drops.pop() > 0
    assert paci == flush
