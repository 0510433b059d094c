"""The vocabulary split over the pipeline ranks, as schedule actions (schedules.vocab_passes):
every schedule that takes them runs them without a deadlock under every arrival rule, noise
and latency; the last stage's backward never starts before every shard has scored the
microbatch; a shard's drift stays within the stated bound; the projected pace on the PACI
paper's model reaches its goal."""

import dataclasses
import itertools

import pytest

from megatron.benchmarks.comparison import MODELS, compare
from megatron.pipeline.schedules import get_schedule, paci
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.vocab_passes import cannot_take, with_vocab_passes
from megatron.pipeline.simulation.costs import CostNoise
from megatron.pipeline.simulation.engine import simulate

TAKING = ["gpipe", "1f1b", "zb-h1", "paci", "2bw", "pipedream"]
PACI_VARIANTS = [
    paci.paci_schedule(rule, limit)
    for rule, limit in itertools.product(["fixed", "backward-first", "forward-first"],
                                         ["depth", "flush"])
]  # fmt: skip


def _run(schedule, n=4, m=4, steps=4, latency=0.3, noise=None, split_input=False):
    embed_costs = {"embed_forward_cost": 0.1, "embed_backward_cost": 0.1} if split_input else {}
    return simulate(
        with_vocab_passes(schedule, split_input),
        num_stages=n,
        microbatches_per_step=m,
        steps=steps,
        forward_cost=1.0,
        backward_cost=2.0,
        weight_grad_cost=1.0 if schedule.splits_backward else 0.0,
        vocab_forward_cost=0.4,
        vocab_backward_cost=0.2,
        p2p_latency=latency,
        noise=noise,
        **embed_costs,
    )


def _events(result, rank, kind):
    return {e.action.microbatch: e for e in result.timeline if e.stage == rank
            and any(p.kind is kind for p in e.action.passes)}  # fmt: skip


@pytest.mark.parametrize("name", TAKING)
@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 7), (8, 16)])
def test_every_rank_scores_every_microbatch_once(name, n, m):
    result = _run(get_schedule(name, simulated=True), n=n, m=m, steps=3)
    for rank in range(n):
        for kind in (ActionKind.VOCAB_FORWARD, ActionKind.VOCAB_BACKWARD):
            assert sorted(_events(result, rank, kind)) == list(range(3 * m))


@pytest.mark.parametrize("schedule", PACI_VARIANTS, ids=lambda s: s.description[-40:])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paci_rules_never_deadlock_under_noise(schedule, seed):
    result = _run(schedule, n=4, m=2, steps=6, noise=CostNoise(0.5, seed=seed))
    assert result.optimizer_steps_per_stage == [6] * 4


@pytest.mark.parametrize("name", TAKING)
def test_the_last_backward_waits_for_every_shard(name):
    latency, n = 0.3, 4
    result = _run(get_schedule(name, simulated=True), n=n, m=4, latency=latency)
    last_backwards = _events(result, n - 1, ActionKind.BACKWARD)
    for microbatch, backward in last_backwards.items():
        for rank in range(n):
            scored = _events(result, rank, ActionKind.VOCAB_FORWARD)[microbatch]
            arrival = scored.end_s + (latency if rank != n - 1 else 0.0)
            assert backward.start_s >= arrival - 1e-9


@pytest.mark.parametrize("name", TAKING)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shards_gradient_waits_for_the_ranks_own_backward(name, seed):
    """Without a flush the statistics of the next step's microbatches can arrive before the
    rank takes this step: their VB waits for the rank's backward, so each shard gradient
    lands in the step of its microbatch whatever the arrival order (2BW is exact)."""
    n = 4
    result = _run(get_schedule(name, simulated=True), n=n, m=4, steps=4, latency=0.05,
                  noise=CostNoise(0.5, seed=seed))  # fmt: skip
    for rank in range(n):
        backwards = _events(result, rank, ActionKind.BACKWARD)
        for microbatch, shard in _events(result, rank, ActionKind.VOCAB_BACKWARD).items():
            assert shard.start_s >= backwards[microbatch].end_s - 1e-9, (rank, microbatch)


@pytest.mark.parametrize("a", [1, 2, 4])
def test_shard_drift_within_the_bound(a):
    n = 4
    schedule = with_vocab_passes(paci.SCHEDULE)
    result = _run(paci.SCHEDULE, n=n, m=a, steps=8, noise=CostNoise(0.3, seed=a))
    bounds = [schedule.drift_bound(s, n, a) for s in range(n)]
    assert bounds == [-(-(n - s) // a) for s in range(n)]  # ceil((N - s) / a): one stage deeper
    for drift, shard, bound in zip(result.max_drift_per_stage, result.max_shard_drift_per_stage,
                                   bounds):  # fmt: skip
        assert drift <= bound and shard <= bound
    assert max(result.max_shard_drift_per_stage) >= 1  # the shards do see other versions


def test_synchronous_schedules_keep_their_shards_at_one_version():
    for name in ("1f1b", "zb-h1", "gpipe"):
        result = _run(get_schedule(name, simulated=True), m=4)
        assert result.max_shard_drift_per_stage == [0] * 4


VIRTUAL = [
    ("interleaved-1f1b", 4, 8),
    ("paci-interleaved", 4, 4),
    ("zb-v", 4, 8),
    ("dualpipe-v", 4, 8),
    ("interleaved-1f1b", 2, 4),
    ("dualpipe-v", 2, 4),
]


@pytest.mark.parametrize("split_input", [False, True], ids=["output", "both"])
@pytest.mark.parametrize("name, n, m", VIRTUAL)
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_virtual_stage_schedules_take_the_passes(name, n, m, seed, split_input):
    """Several chunks per rank (the V's last virtual stage on rank 0): every rank scores and
    looks up every microbatch once, without a deadlock under noise; the flushes at one
    version."""
    schedule = get_schedule(name, simulated=True)
    noise = None if seed is None else CostNoise(0.5, seed=seed)
    result = _run(schedule, n=n, m=m, steps=3, noise=noise, split_input=split_input)
    kinds = [ActionKind.VOCAB_FORWARD, ActionKind.VOCAB_BACKWARD]
    if split_input:
        kinds += [ActionKind.EMBED_FORWARD, ActionKind.EMBED_BACKWARD]
    for rank, kind in itertools.product(range(n), kinds):
        assert sorted(_events(result, rank, kind)) == list(range(3 * m))
    if schedule.flushes_every_call:
        assert result.max_shard_drift_per_stage == [0] * n


def test_schedules_that_stash_weights_keep_the_input_whole():
    for name in ("2bw", "pipedream"):
        schedule = get_schedule(name, simulated=True)
        assert cannot_take(schedule) is None
        assert "stashes weights" in cannot_take(schedule, split_input=True)


def test_vocab_costs_need_a_schedule_that_places_them():
    with pytest.raises(ValueError, match="places no vocabulary passes"):
        simulate(paci.SCHEDULE, num_stages=2, microbatches_per_step=1, steps=1, forward_cost=1,
                 backward_cost=1, vocab_forward_cost=1)  # fmt: skip


def test_paci_reaches_the_physical_limit_on_gpt2_medium():
    split = dataclasses.replace(MODELS["gpt2-medium"], vocab_parallel=True)
    for m in (8, 16, 32):
        whole, passes = compare(MODELS["gpt2-medium"], "paci", 1, m), compare(split, "paci", 1, m)
        assert whole.pace < 0.87 and passes.pace >= 0.97
        assert passes.note == ""  # run as actions, not a share added to the stages
        assert passes.peak_activations == whole.peak_activations + 1  # rule 1's one more
        flush, flush_split = compare(MODELS["gpt2-medium"], "1f1b", 1, m), compare(
            split, "1f1b", 1, m
        )
        assert flush_split.pace > flush.pace


@pytest.mark.parametrize("model", ["gpt2-medium", "llama-70b"])
@pytest.mark.parametrize("name, chunks", [("paci", 1), ("2bw", 1), ("pipedream", 1),
                                          ("paci-interleaved", None)])  # fmt: skip
def test_the_asynchronous_schedules_reach_the_limit_with_the_split(model, name, chunks):
    """No bubble added: without a flush every schedule that takes the passes runs at the
    physical limit (2BW and PipeDream in 1F1B's order, the virtual stages one more
    microbatch-chunk in flight); whole, the slowest stage caps them."""
    split = dataclasses.replace(MODELS[model], vocab_parallel=True)
    for m in (8, 16):
        whole, passes = compare(MODELS[model], name, chunks, m), compare(split, name, chunks, m)
        assert passes.pace >= 0.99 > whole.pace, (m, whole.pace, passes.pace)


@pytest.mark.parametrize("model", ["gpt2-medium", "llama-70b"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_the_flushes_gain_from_the_split(model, name):
    """No bubble added where the pipeline is full: with the split every flush schedule is
    faster than with the slowest stage holding the output layer (the virtual-stage tables in
    their variant that hides the shards' round trip)."""
    split = dataclasses.replace(MODELS[model], vocab_parallel=True)
    chunks = {"1f1b": 1, "zb-h1": 1, "zb-v": 2, "dualpipe-v": 2}.get(name)
    whole, passes = compare(MODELS[model], name, chunks, 32), compare(split, name, chunks, 32)
    assert passes.pace > whole.pace + 0.01, (whole.pace, passes.pace)  # m = 32: a long steady state


def test_2bw_needs_a_batch_per_window_one_stage_deeper():
    schedule = with_vocab_passes(get_schedule("2bw"))
    assert schedule.min_microbatches_per_step(4) == 4  # N - 1 on N + 1 stages
    with pytest.raises(ValueError, match="needs at least 4 microbatches"):
        _run(get_schedule("2bw"), n=4, m=3)


# ------------------------------------------------------------ the input embedding split too
TAKING_INPUT = ["gpipe", "1f1b", "zb-h1", "paci"]


@pytest.mark.parametrize("name", TAKING_INPUT)
@pytest.mark.parametrize("n,m", [(2, 2), (4, 1), (4, 4), (4, 7), (8, 16)])
def test_every_rank_looks_every_microbatch_up_once(name, n, m):
    result = _run(get_schedule(name, simulated=True), n=n, m=m, steps=3, split_input=True)
    for rank in range(n):
        for kind in (ActionKind.EMBED_FORWARD, ActionKind.EMBED_BACKWARD):
            assert sorted(_events(result, rank, kind)) == list(range(3 * m))


@pytest.mark.parametrize("schedule", PACI_VARIANTS, ids=lambda s: s.description[-40:])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paci_rules_never_deadlock_with_the_input_split(schedule, seed):
    result = _run(schedule, n=4, m=2, steps=6, noise=CostNoise(0.5, seed=seed), split_input=True)
    assert result.optimizer_steps_per_stage == [6] * 4


@pytest.mark.parametrize("name", TAKING_INPUT)
def test_the_first_forward_waits_for_every_ranks_part(name):
    latency, n = 0.3, 4
    result = _run(get_schedule(name, simulated=True), n=n, m=4, latency=latency, split_input=True)
    for microbatch, forward in _events(result, 0, ActionKind.FORWARD).items():
        for rank in range(n):
            looked_up = _events(result, rank, ActionKind.EMBED_FORWARD)[microbatch]
            arrival = looked_up.end_s + (latency if rank else 0.0)
            assert forward.start_s >= arrival - 1e-9


@pytest.mark.parametrize("a", [1, 2, 4])
def test_embedding_drift_within_the_bound(a):
    """PACI: ceil(2 W0 / a) with W0 = N + 1 (tests/unit_tests/pipeline/test_embedding_runtime.py
    has the argument); flush: none, the rows step with the stage."""
    n = 4
    result = _run(paci.SCHEDULE, n=n, m=a, steps=8, noise=CostNoise(0.3, seed=a), split_input=True)
    assert max(result.max_embed_drift_per_stage) <= -(-2 * (n + 1) // a)
    assert max(result.max_embed_drift_per_stage) >= 1
    for name in ("1f1b", "zb-h1", "gpipe"):
        flush = _run(get_schedule(name, simulated=True), m=4, split_input=True)
        assert flush.max_embed_drift_per_stage == [0] * 4


@pytest.mark.parametrize(
    "name, window", [("1f1b", lambda n, m: min(n + 1, m)), ("paci", lambda n, m: n + 1)]
)
def test_a_rank_looks_up_no_further_than_the_first_stages_window(name, window):
    """Rule 5 bounds what the first stage buffers: rank r looks microbatch i up only once it
    has backwarded i - W0, so at most W0 parts per rank wait there (not a step's worth)."""
    n, m = 4, 8
    result = _run(get_schedule(name, simulated=True), n=n, m=m, steps=3, split_input=True)
    for rank in range(n):
        backward_ends = sorted(e.end_s for e in _events(result, rank, ActionKind.BACKWARD).values())
        for microbatch, lookup in _events(result, rank, ActionKind.EMBED_FORWARD).items():
            backwarded = sum(end <= lookup.start_s + 1e-9 for end in backward_ends)
            assert microbatch < backwarded + window(n, m)
