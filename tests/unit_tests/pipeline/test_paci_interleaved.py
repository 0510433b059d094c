"""PACI over virtual stages in the simulator, against its derivation: no bubble in steady
state, at most interleaved flush's microbatch-chunks in flight per rank, each chunk's drift
within `drift_bound`, and one batch's gradient per step."""

import pytest

from megatron.pipeline.schedules import SIMULATED_SCHEDULES, paci_interleaved, virtual_schedule
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.vocab_passes import with_vocab_passes
from megatron.pipeline.simulation import simulate
from megatron.pipeline.simulation.costs import CostNoise

STEPS = 40
F, B = 1.0, 2.0  # per chunk pass
GRID = [(4, 2, 4), (4, 2, 8), (8, 2, 8), (4, 4, 4), (2, 2, 2), (8, 4, 8), (4, 3, 4)]


def run(schedule, n, v, a, timeline=False):
    return simulate(schedule, num_stages=n, microbatches_per_step=a, steps=STEPS,
                    chunks_per_rank=v, forward_cost=F, backward_cost=B,
                    record_timeline=timeline)  # fmt: skip


def pace(result, v, a) -> float:
    """Ideal time (every rank busy) over the makespan."""
    return STEPS * a * v * (F + B) / result.makespan


def per_chunk_drift(result, n):
    """(rank, chunk) -> the most steps the rank took between a microbatch's forward and its
    backward on that chunk, read off the timeline."""
    worst = {}
    for rank in range(n):
        steps, forwarded = 0, {}
        for event in sorted((e for e in result.timeline if e.stage == rank),
                            key=lambda e: e.start_s):  # fmt: skip
            action = event.action
            if action.kind is ActionKind.STEP:
                steps += 1
            elif action.kind is ActionKind.FORWARD:
                forwarded[(action.chunk, action.microbatch)] = steps
            elif action.kind is ActionKind.BACKWARD:
                drift = steps - forwarded[(action.chunk, action.microbatch)]
                key = (rank, action.chunk)
                worst[key] = max(worst.get(key, 0), drift)
    return worst


@pytest.mark.parametrize("n, v, a", GRID)
def test_no_bubble_in_steady_state_and_faster_than_flush(n, v, a):
    paci = run(virtual_schedule("paci"), n, v, a)
    flush = run(virtual_schedule("1f1b"), n, v, a)
    assert pace(paci, v, a) >= 0.98  # only the fill and the final drain are idle
    assert pace(paci, v, a) > pace(flush, v, a)


@pytest.mark.parametrize("n, v, a", GRID)
def test_memory_at_most_interleaved_flushs_peak(n, v, a):
    paci = run(virtual_schedule("paci"), n, v, a).to_dict()["virtual_stages"]
    flush = run(virtual_schedule("1f1b"), n, v, a).to_dict()["virtual_stages"]
    peaks = paci["peak_activation_chunks_per_rank"]
    assert all(p <= f for p, f in zip(peaks, flush["peak_activation_chunks_per_rank"]))
    assert peaks == [paci_interleaved.window(r, n, a, v) for r in range(n)]


@pytest.mark.parametrize("rule", ["forward-first", "fixed"])
@pytest.mark.parametrize("n, v, a", GRID)
def test_drift_within_the_bound_per_chunk(n, v, a, rule):
    result = run(paci_interleaved.paci_interleaved(None, rule), n, v, a, timeline=True)
    drift = per_chunk_drift(result, n)
    for (rank, chunk), worst in drift.items():
        assert worst <= paci_interleaved.drift_bound(rank, chunk, n, a, v), (rank, chunk)
    assert drift[(n - 1, v - 1)] == 0  # the last virtual stage: its forward, then its backward
    assert max(drift.values()) >= 1  # no flush: microbatches do cross steps


def test_bound_is_reached_when_the_window_is_megatrons():
    """a v >= W_0 + 1: the cap does not bind, the fixed order is interleaved 1F1B's steady
    state and each chunk's drift is exactly its bound."""
    n, v, a = 4, 2, 8
    result = run(paci_interleaved.paci_interleaved(None, "fixed"), n, v, a, timeline=True)
    drift = per_chunk_drift(result, n)
    assert all(drift[(r, c)] == paci_interleaved.drift_bound(r, c, n, a, v)
               for r in range(n) for c in range(v))  # fmt: skip


def test_the_fixed_order_pays_for_the_memory_cap():
    """What the docstring states: when a v < W_0 + 1 the counter-only order runs at about half
    pace (blocked on forwards), forward-first at full pace; both bubble-free without the cap."""
    capped = (4, 2, 4)
    fixed = pace(run(paci_interleaved.paci_interleaved(None, "fixed"), *capped), 2, 4)
    assert 0.45 < fixed < 0.55
    uncapped = (4, 2, 8)
    assert pace(run(paci_interleaved.paci_interleaved(None, "fixed"), *uncapped), 2, 8) >= 0.98


def test_each_step_takes_one_batch_per_chunk():
    """Between two steps every chunk runs exactly a backwards, of the same a microbatches."""
    n, v, a = 4, 2, 4
    result = run(virtual_schedule("paci"), n, v, a, timeline=True)
    for rank in range(n):
        batch = {c: [] for c in range(v)}
        for event in sorted((e for e in result.timeline if e.stage == rank),
                            key=lambda e: e.start_s):  # fmt: skip
            if event.action.kind is ActionKind.BACKWARD:
                batch[event.action.chunk].append(event.action.microbatch)
            elif event.action.kind is ActionKind.STEP:
                microbatches = [sorted(batch[c]) for c in range(v)]
                assert all(m == microbatches[0] for m in microbatches)
                assert len(microbatches[0]) == a
                assert microbatches[0][0] % a == 0
                batch = {c: [] for c in range(v)}


def test_registered_for_the_simulator():
    assert SIMULATED_SCHEDULES["paci-interleaved"] is paci_interleaved.SCHEDULE
    assert virtual_schedule("paci") is paci_interleaved.SCHEDULE
    assert virtual_schedule("paci", None, "fixed") is paci_interleaved.SCHEDULE.fixed_order


@pytest.mark.parametrize("seed", [None, 0])
@pytest.mark.parametrize("rule", ["forward-first", "fixed"])
@pytest.mark.parametrize("n, v, a", [(4, 2, 4), (4, 2, 8), (8, 3, 8)])
def test_with_the_split_vocabulary_one_more_chunk_in_flight(n, v, a, rule, seed):
    """The shards as one more stage: every rank holds one more microbatch-chunk, each chunk's
    drift stays within the bound of that window, and a rank's shard drifts no more than its
    first chunk (its VF follows the chunk's forward, its VB precedes the step after the
    chunk's backward); no bubble under the default rule (the fixed order pays for the memory
    cap as without the split)."""
    schedule = with_vocab_passes(paci_interleaved.paci_interleaved(None, rule), split_input=True)
    result = simulate(schedule, num_stages=n, microbatches_per_step=a, steps=STEPS,
                      chunks_per_rank=v, forward_cost=F, backward_cost=B, vocab_forward_cost=0.4,
                      vocab_backward_cost=0.2, record_timeline=True,
                      noise=None if seed is None else CostNoise(0.3, seed=seed))  # fmt: skip
    peaks = result.to_dict()["virtual_stages"]["peak_activation_chunks_per_rank"]
    assert peaks == [paci_interleaved.window(r, n, a, v, extra=1) for r in range(n)]
    for (rank, chunk), worst in per_chunk_drift(result, n).items():
        assert worst <= paci_interleaved.drift_bound(rank, chunk, n, a, v, extra=1)
    for rank, worst in enumerate(result.max_shard_drift_per_stage):
        assert worst <= paci_interleaved.drift_bound(rank, 0, n, a, v, extra=1)
    assert max(result.max_shard_drift_per_stage) >= 1
    if rule == "forward-first" and seed is None:
        assert STEPS * a * (v * (F + B) + 0.6) / result.makespan >= 0.97
