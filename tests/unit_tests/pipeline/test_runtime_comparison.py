"""The measured side-by-side comparison's own arithmetic, on simulated timelines: its steady
pace agrees with the projection's (a different measurement of the same steady state), and each
schedule's emulated costs are the same work per microbatch."""

import pytest

from megatron.benchmarks.comparison import MODELS, compare
from megatron.benchmarks.runtime_comparison import (
    RUNTIME_NAMES,
    _nominal_seconds,
    base_schedule,
    definition_of,
    microbatch_ms,
    model_for,
    schedule_costs_ms,
    steady_pace,
)
from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.simulation import simulate

MODEL = MODELS["gpt2-medium"]


@pytest.mark.parametrize("schedule", sorted(RUNTIME_NAMES))
def test_steady_pace_of_a_simulated_run_is_the_projected_pace(schedule):
    name, chunks = RUNTIME_NAMES[schedule]
    chunks = MODEL.interleaved_chunks if chunks is None else chunks
    m, steps = 16, 8
    costs = schedule_costs_ms(MODEL, schedule, chunks, 1.0)
    definition = definition_of(schedule)
    ranks = MODEL.ranks if definition.vocab_passes else 0
    nominal = _nominal_seconds(costs, definition.splits_backward, ranks)
    result = simulate(definition, num_stages=MODEL.ranks, microbatches_per_step=m, steps=steps,
                      chunks_per_rank=chunks if definition.placement is not None else None,
                      record_timeline=True, **nominal)  # fmt: skip
    limit = MODEL.ranks / microbatch_ms(costs, MODEL.ranks) * 1000
    projected = compare(model_for(MODEL, schedule), base_schedule(schedule), chunks, m).pace
    assert steady_pace(result.timeline, m, steps) / limit == pytest.approx(projected, rel=0.03)
    # the runtime resolves the schedule to the same definition and placement
    plan = resolve_plan(name, num_stages=MODEL.ranks, chunks_per_rank=chunks,
                        vocab_passes=definition.vocab_passes)  # fmt: skip
    assert plan.schedule.name == definition.name or name in ("1f1b", "paci")
    assert plan.chunks_per_rank == chunks and plan.schedule.vocab_passes == ("+vocab" in schedule)


def test_every_schedule_does_the_same_work_per_microbatch():
    totals = set()
    for schedule, (_, chunks) in RUNTIME_NAMES.items():
        costs = schedule_costs_ms(MODEL, schedule, chunks or MODEL.interleaved_chunks, 2.0)
        totals.add(round(microbatch_ms(costs, MODEL.ranks), 6))
        assert all(0 <= w <= b for w, b in zip(costs["weight_grad"], costs["backward"]))
    assert max(totals) - min(totals) < 1e-3  # ms, rounding only
