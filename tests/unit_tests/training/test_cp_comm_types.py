"""The context-parallel attentions other than the ring (--cp-comm-type all_gather, a2a,
a2a+p2p) against full causal attention over the whole sequence on one process, forward and
backward, with grouped-query attention; and the ring's attention dropout against autograd
through the same forward with the same masks. 4 real processes (gloo) in one launch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.parallel_state import create_hierarchical_groups
from rank_processes import start_ranks

from megatron.distributed.context_parallel import ring
from megatron.distributed.context_parallel.attention import ContextParallelAttention
from megatron.distributed.context_parallel.ring import chunk_positions

BATCH, HEADS, GROUPS, DIM, SEQ = 2, 4, 2, 8, 64
SCALE, DROPOUT = DIM**-0.5, 0.3
CPU = torch.device("cpu")


def full_attention(q, k, v, allowed=None, keep=None):
    """Causal attention over the whole sequence (`allowed`: the mask of q's rows when q holds
    some of them); `keep`: a dropout mask of the probabilities."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril() if allowed is None else allowed
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    if keep is not None:
        probabilities = probabilities * keep / (1 - DROPOUT)
    return probabilities @ v


def inputs():
    """The whole sequence's q, k, v and output gradient, the same on every process."""
    generator = torch.Generator().manual_seed(11)
    shapes = [(BATCH, HEADS, SEQ, DIM), (BATCH, GROUPS, SEQ, DIM), (BATCH, GROUPS, SEQ, DIM)]
    full = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    grad = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    return full, grad


def model_layout(tensor):
    """[b, heads, s, d] as the model passes it (a view of a permuted [s, b, heads, d] leaf) and
    the leaf; the leaf's gradient permuted back is the view's."""
    leaf = tensor.permute(2, 0, 1, 3).contiguous().requires_grad_(True)
    return leaf.permute(1, 2, 0, 3), leaf


def compare(attention: ContextParallelAttention, cp_rank: int, cp: int) -> dict:
    """Largest differences of output and gradients against full attention on one process."""
    full, grad = inputs()
    reference = [t.clone().requires_grad_(True) for t in full]
    expected = full_attention(*reference)
    expected.backward(grad)
    mine = chunk_positions(cp_rank, cp, SEQ // cp, CPU)
    local, leaves = zip(*(model_layout(t[:, :, mine]) for t in full))
    output = attention(*local, SCALE, 0.0)
    output.backward(grad[:, :, mine])
    errors = {"output": float((output.detach() - expected.detach()[:, :, mine]).abs().max())}
    for name, leaf, ref in zip("qkv", leaves, reference):
        ours = leaf.grad.permute(1, 2, 0, 3)
        errors[f"grad_{name}"] = float((ours - ref.grad[:, :, mine]).abs().max())
    return errors


def ring_dropout(rank: int, group) -> dict:
    """CP 2 ring with dropout: its output and gradients against autograd through full-row
    attention with the masks the ring drew (seen through the test hook)."""
    full, grad = inputs()
    drawn = []
    ring.observe_dropout_mask = lambda owner, keep: drawn.append((owner, keep.clone()))
    mine = chunk_positions(rank, 2, SEQ // 2, CPU)
    local = [t[:, :, mine].clone().requires_grad_(True) for t in full]
    output = ring.ring_attention(*local, group, SCALE, DROPOUT)
    output.backward(grad[:, :, mine])
    ring.observe_dropout_mask = None
    forward, backward = drawn[:2], drawn[2:]
    keep = torch.zeros(BATCH, HEADS, SEQ // 2, SEQ, dtype=torch.bool)
    for owner, block in forward:  # the block's keys sit at its owner's positions
        keep[..., chunk_positions(owner, 2, SEQ // 2, CPU)] = block
    causal = chunk_positions(rank, 2, SEQ // 2, CPU)[:, None] >= torch.arange(SEQ)[None, :]
    reference = [t.clone().requires_grad_(True) for t in full]
    expected = full_attention(reference[0][:, :, mine], *reference[1:], causal, keep)
    expected.backward(grad[:, :, mine])
    for t in reference[1:]:  # every rank's queries contribute to every key's gradient
        dist.all_reduce(t.grad, group=group)
    errors = {"output": float((output.detach() - expected.detach()).abs().max())}
    for name, ours, ref in zip("qkv", local, reference):
        errors[f"grad_{name}"] = float((ours.grad - ref.grad[:, :, mine]).abs().max())
    same = all(o1 == o2 and torch.equal(a, b) for (o1, a), (o2, b) in zip(forward, backward))
    kept = torch.cat([block.flatten() for _, block in forward]).double().mean()
    return {"errors": errors, "backward_masks_same": same, "kept": float(kept)}


def worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
    everyone = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # megatron-core's hierarchical groups for sizes 2 2: inner {0, 1} {2, 3}, outer {0, 2} {1, 3}
    hierarchical, _ = create_hierarchical_groups(rank, [0, 1, 2, 3], [2, 2])
    out = {
        "all_gather": compare(ContextParallelAttention("all_gather", everyone), rank, 4),
        "a2a": compare(ContextParallelAttention("a2a", everyone), rank, 4),
        "a2a_cp2": compare(ContextParallelAttention("a2a", pairs[rank // 2]), rank % 2, 2),
        "a2a+p2p": compare(ContextParallelAttention("a2a+p2p", everyone, hierarchical), rank, 4),
        "dropout": ring_dropout(rank % 2, pairs[rank // 2]),
    }
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    results = mp.Manager().dict()
    store = os.path.join(tmp_path_factory.mktemp("cp_comm"), "store")
    start_ranks(worker, (store, results), nprocs=4)
    return dict(results)


@pytest.mark.parametrize("kind", ["all_gather", "a2a", "a2a_cp2", "a2a+p2p"])
def test_equals_full_causal_attention(measured, kind):
    for rank in range(4):
        for name, error in measured[rank][kind].items():
            assert error < 1e-12, f"rank {rank} {kind} {name}: {error:g}"


def test_ring_dropout_backward_equals_autograd_with_the_same_masks(measured):
    for rank in range(4):
        dropout = measured[rank]["dropout"]
        assert dropout["backward_masks_same"], f"rank {rank}: the backward drew other masks"
        for name, error in dropout["errors"].items():
            assert error < 1e-12, f"rank {rank} dropout {name}: {error:g}"


def test_ring_dropout_keeps_one_minus_p(measured):
    for rank in range(4):
        assert abs(measured[rank]["dropout"]["kept"] - (1 - DROPOUT)) < 0.02


def test_dropout_masks_differ_between_ranks_and_calls():
    """One seed per call mixed with the rank and the block: no two streams alike."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        draw = lambda seed, owner: ring.dropout_keep_mask(seed, owner, (64, 64), 0.5, CPU)
        assert torch.equal(draw(5, 0), draw(5, 0))
        assert not torch.equal(draw(5, 0), draw(5, 1))
        assert not torch.equal(draw(5, 0), draw(6, 0))
    finally:
        dist.destroy_process_group()
