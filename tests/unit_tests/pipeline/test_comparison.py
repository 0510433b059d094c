"""The schedule comparison: its layer split and its pace against closed forms."""

import dataclasses

import pytest

from megatron.benchmarks.comparison import (
    MODELS,
    compare,
    layers_per_virtual_stage,
    rank_layer_totals,
    table,
)
from megatron.benchmarks.projection import Shape

# An output layer of negligible cost (vocabulary 1): every layer costs the same, so the
# schedules' paces have closed forms.
UNIFORM = dataclasses.replace(MODELS["gpt2-medium"], shape=Shape(24, 1024, 4096, 1024, 1))


@pytest.mark.parametrize(
    "layers, ranks, output, on_rank",
    [(24, 8, 3.78, 7), (80, 8, 1.36, 7), (24, 8, 3.78, 0), (7, 4, 0.0, 3)],
)
def test_rank_totals_are_as_even_as_whole_layers_allow(layers, ranks, output, on_rank):
    totals = rank_layer_totals(layers, ranks, output, on_rank)
    assert sum(totals) == layers and len(totals) == ranks
    loads = [n + (output if r == on_rank else 0) for r, n in enumerate(totals)]
    # moving one layer from the busiest rank to the idlest would not lower the maximum
    busiest, idlest = max(range(ranks), key=loads.__getitem__), min(
        range(ranks), key=loads.__getitem__
    )
    assert max(loads) <= loads[idlest] + 1 or totals[busiest] == 0


def test_each_rank_spreads_its_layers_over_its_chunks():
    model = MODELS["llama-70b"]
    layers = layers_per_virtual_stage(model, 5, "interleaved")
    assert sum(layers) == 80 and len(layers) == 40
    for rank in range(8):  # interleaved: rank r holds virtual stages r, r + 8, ...
        own = layers[rank::8]
        assert max(own) - min(own) <= 1, (rank, own)
    assert layers[-1] == min(layers[7::8])  # the output layer's chunk gets the fewest
    v_layers = layers_per_virtual_stage(model, 2, "v")
    per_rank = [v_layers[r] + v_layers[15 - r] for r in range(8)]  # rank r: stages r, 2N-1-r
    assert sum(v_layers) == 80 and max(per_rank) - min(per_rank) <= 2


@pytest.mark.parametrize("m", [8, 16, 32])
def test_paces_at_uniform_costs_match_the_closed_forms(m):
    n, v = UNIFORM.ranks, UNIFORM.interleaved_chunks
    one_f1b = compare(UNIFORM, "1f1b", 1, m)
    assert one_f1b.pace == pytest.approx(m / (m + n - 1), rel=0.01)
    interleaved = compare(UNIFORM, "interleaved-1f1b", None, m)
    assert interleaved.pace == pytest.approx(1 / (1 + (n - 1) / (v * m)), rel=0.01)
    paci = compare(UNIFORM, "paci", 1, m)
    assert paci.pace == pytest.approx(1.0, rel=0.01) and paci.drift == 1
    assert paci.peak_activations == n and paci.weight_copies == 1
    pipedream = compare(UNIFORM, "pipedream", 1, m)
    assert pipedream.weight_copies == n and pipedream.staleness == n - 1


def test_schedules_outside_their_rules_are_marked_not_defined():
    rows = {(r.schedule, r.microbatches): r for r in table(UNIFORM, [8])}
    dualpipe = rows[("dualpipe-v", 8)]
    assert dualpipe.pace is None and "at least 16 microbatches" in dualpipe.note
    assert all(r.pace is not None for key, r in rows.items() if key[0] != "dualpipe-v")


def test_the_vocabulary_split_lifts_the_whole_layer_cap():
    """GPT-2 Medium on 8 ranks: with the output layer whole on a rank, whole layers cap every
    schedule at 0.868 of the physical limit and PACI sits on it; split by vocabulary (3
    layers and 1/8 of the output layer per rank, its passes run as actions) PACI reaches the
    limit, and interleaved 1F1B's chunks balance too (its share added to the chunks)."""
    model = MODELS["gpt2-medium"]
    split = dataclasses.replace(model, vocab_parallel=True)
    assert layers_per_virtual_stage(split, 1, "interleaved") == [3] * 8
    assert compare(model, "paci", 1, 8).pace == pytest.approx(0.868, abs=5e-4)
    assert compare(split, "paci", 1, 8).pace == pytest.approx(1.0, abs=1e-9)
    # 1F1B with the shards' passes as actions: its bubble m / (m + N - 1), less the VB passes
    # that run in the cooldown's idle time
    flush = compare(split, "1f1b", 1, 8)
    assert 8 / 15 < flush.pace < 0.6 and flush.note == ""
    assert (
        compare(split, "interleaved-1f1b", None, 16).pace
        > compare(model, "interleaved-1f1b", None, 16).pace
    )
