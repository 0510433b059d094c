"""The output layer's messages on trees (`VocabTree`, `combine_partials`): the shapes for
N = 2..8 ranks, and the shards' outputs reduced up a tree against `combine_shards` of every
message at once."""

import math

import pytest
import torch
from test_rank_runtime import SHAPE, Layer
from test_runtime_state import in_process_context, run_threads
from test_vocab_runtime import output_weight, reference, train

from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.runtime import RankRuntime
from megatron.pipeline.schedules.vocab_passes import with_vocab_passes
from megatron.pipeline.transport import InProcessTransport
from megatron.pipeline.vocab_parallel import (
    OutputShard,
    combine_partials,
    combine_shards,
    score_shard,
    shard_ranges,
)
from megatron.pipeline.vocab_tree import VocabTree

HIDDEN, TOKENS, ROWS = 16, 12, 5


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("root_at_end", [True, False])  # the last stage, or rank 0 (the V)
def test_a_binary_tree_reaches_every_rank_in_floor_log2_n_hops(n, root_at_end):
    root = n - 1 if root_at_end else 0
    tree = VocabTree(n, root)
    assert tree.parent(root) is None
    for stage in range(n):
        assert len(tree.children(stage)) <= 2
        assert all(tree.parent(child) == stage for child in tree.children(stage))
        assert tree.path(stage)[0] == root and tree.path(stage)[-1] == stage
    assert sorted(c for s in range(n) for c in tree.children(s)) == sorted(set(range(n)) - {root})
    assert max(tree.depth(stage) for stage in range(n)) == int(math.log2(n))
    assert tree.children(root) == [(root - 1) % n, (root - 2) % n][: n - 1]


@pytest.mark.parametrize("n", range(2, 9))
def test_arity_n_minus_1_is_the_fan(n):
    tree = VocabTree(n, n - 1, arity=n - 1)
    assert tree.children(n - 1) == list(range(n - 2, -1, -1))
    assert all(tree.depth(stage) == 1 for stage in range(n - 1))


def shard_messages(n: int, seed: int) -> tuple[list[torch.Tensor], int]:
    generator = torch.Generator().manual_seed(seed)
    vocab = n * ROWS
    weight = torch.randn(vocab, HIDDEN, generator=generator) * 2
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    labels = torch.randint(0, vocab, (TOKENS,), generator=generator)
    messages = [score_shard(hidden, labels, weight[start:end], start)[1]
                for start, end in shard_ranges(vocab, n)]  # fmt: skip
    return messages, vocab


def reduce_up(tree: VocabTree, messages: list[torch.Tensor], stage: int) -> torch.Tensor:
    """What `stage` sends up: its shard's output combined with its children's partials."""
    inputs = [messages[stage]] + [reduce_up(tree, messages, c) for c in tree.children(stage)]
    return combine_partials(inputs, HIDDEN)


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("arity", [1, 2, 3])
def test_the_tree_reduction_equals_combining_every_shard_at_once(n, arity):
    messages, _ = shard_messages(n, seed=n)
    tree = VocabTree(n, n - 1, arity)
    root_message = reduce_up(tree, messages, n - 1)
    assert root_message.shape == messages[0].shape  # one shard's message, whatever the subtree
    reduced, at_once = combine_shards([root_message], HIDDEN), combine_shards(messages, HIDDEN)
    for name in ("per_token_loss", "direction", "global_max", "global_sum"):
        got, expected = getattr(reduced, name), getattr(at_once, name)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_combining_is_associative_in_any_grouping():
    messages, _ = shard_messages(6, seed=3)
    left = combine_partials([combine_partials(messages[:2], HIDDEN),
                             combine_partials(messages[2:], HIDDEN)], HIDDEN)  # fmt: skip
    right = combine_partials([messages[0], combine_partials(messages[1:], HIDDEN)], HIDDEN)
    torch.testing.assert_close(left, right, rtol=1e-6, atol=1e-6)
    assert combine_partials(messages[:1], HIDDEN) is messages[0]  # a leaf sends its own


def test_bf16_partials_stay_within_bf16_rounding():
    messages, _ = shard_messages(8, seed=11)
    tree = VocabTree(8, 7)
    exact = combine_shards(messages, HIDDEN)
    halves = [_to_bf16(m) for m in messages]
    reduced = combine_shards([reduce_up(tree, halves, 7)], HIDDEN)
    torch.testing.assert_close(reduced.per_token_loss, exact.per_token_loss, rtol=0, atol=1e-6)
    scale = exact.direction.abs().max()
    assert (reduced.direction - exact.direction).abs().max() <= 4 * 2**-8 * scale


def _to_bf16(message: torch.Tensor) -> torch.Tensor:
    """An fp32 SHARD_OUTPUT message as the bf16 run sends it (statistics carried bit for bit)."""
    stats, gradient = message[: 3 * TOKENS], message[3 * TOKENS :]
    return torch.cat([stats.contiguous().view(torch.bfloat16), gradient.to(torch.bfloat16)])


# ------------------------------------------------------------------ the rank runtime on trees
def build_ranks_on_tree(n: int, arity: int):
    """`test_vocab_runtime.build_ranks` with the output layer's messages on a tree of `arity`
    (1: a chain, every message N - 1 hops; N - 1: the fan)."""
    transport, runtimes, full = InProcessTransport(tree_arity=arity), [], output_weight()
    for rank, (start, end) in enumerate(shard_ranges(full.shape[0], n)):
        shard = OutputShard(torch.nn.Parameter(full[start:end].clone()), start)
        runtimes.append(RankRuntime(in_process_context(rank, n), Layer(rank, n), tensor_shape=SHAPE,
                                    dtype=torch.float32, transport=transport.for_rank([rank]),
                                    output_shard=shard))  # fmt: skip
    return runtimes


@pytest.mark.parametrize("arity", [1, 2, 3])
def test_flush_on_any_tree_trains_as_one_process(arity):
    n, m, steps = 4, 4, 2
    schedule = with_vocab_passes(resolve_plan("1f1b", num_stages=n).schedule)
    runtimes, losses = build_ranks_on_tree(n, arity), {}
    run_threads(runtimes, lambda r: train(r, schedule, m, steps, losses))
    expected_losses, layers, weight = reference(n, m, steps)
    torch.testing.assert_close(losses[n - 1], expected_losses, rtol=1e-5, atol=1e-6)
    shards = torch.cat([r.output_shard.weight.detach() for r in runtimes])
    torch.testing.assert_close(shards, weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arity", [1, 2])
def test_paci_on_a_deep_tree_scores_every_microbatch_once(arity):
    """PACI with the statistics relayed through ranks that step at their own times: every
    shard takes every microbatch's gradient, within the drift bound one stage deeper."""
    n, a, steps = 4, 2, 6
    schedule = with_vocab_passes(resolve_plan("paci", num_stages=n).schedule)
    runtimes, losses = build_ranks_on_tree(n, arity), {}
    run_threads(runtimes, lambda r: train(r, schedule, a, steps, losses))
    assert len(losses[n - 1]) == steps * a
    for runtime in runtimes:
        assert sum(runtime.shard_drift.values()) == steps * a and not runtime.shard_scores
        assert max(runtime.shard_drift) <= schedule.drift_bound(runtime.context.stage, n, a)
