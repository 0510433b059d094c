"""Ring attention (megatron/distributed/context_parallel/ring.py) against full causal attention over the
whole sequence, forward and backward, with grouped-query attention: 4 real processes (gloo),
context-parallel groups of 2 and of 4 in the same launch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_processes import start_ranks

from megatron.distributed.context_parallel.ring import chunk_positions, ring_attention

BATCH, HEADS, GROUPS, DIM, SEQ = 2, 4, 2, 8, 64


def full_causal_attention(q, k, v):
    k = k.repeat_interleave(HEADS // GROUPS, dim=1)
    v = v.repeat_interleave(HEADS // GROUPS, dim=1)
    scores = q @ k.transpose(-1, -2) / DIM**0.5
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def compare(rank: int, group, cp: int, errors: dict) -> None:
    generator = torch.Generator().manual_seed(11)
    shapes = [(BATCH, HEADS, SEQ, DIM), (BATCH, GROUPS, SEQ, DIM), (BATCH, GROUPS, SEQ, DIM)]
    full = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    grad = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    reference = [t.clone().requires_grad_(True) for t in full]
    full_causal_attention(*reference).backward(grad)
    mine = chunk_positions(rank, cp, 2 * SEQ // (2 * cp), torch.device("cpu"))
    local = [t[:, :, mine].clone().requires_grad_(True) for t in full]
    output = ring_attention(*local, group=group)
    output.backward(grad[:, :, mine])
    expected_out = full_causal_attention(*[t.detach() for t in full])[:, :, mine]
    errors["output"] = float((output.detach() - expected_out).abs().max())
    for name, ours, ref in zip("qkv", local, reference):
        errors[f"grad_{name}"] = float((ours.grad - ref.grad[:, :, mine]).abs().max())


def worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group([0, 1, 2, 3])
    errors_2, errors_4 = {}, {}
    compare(rank % 2, pairs[rank // 2], 2, errors_2)
    compare(rank, everyone, 4, errors_4)
    results[rank] = {"cp2": errors_2, "cp4": errors_4}
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    results = mp.Manager().dict()
    store = os.path.join(tmp_path_factory.mktemp("ring"), "store")
    start_ranks(worker, (store, results), nprocs=4)
    return dict(results)


@pytest.mark.parametrize("cp", ["cp2", "cp4"])
def test_ring_attention_equals_full_causal_attention(measured, cp):
    for rank in range(4):
        for name, error in measured[rank][cp].items():
            assert error < 1e-6, f"rank {rank} {cp} {name}: {error:g}"


def test_the_chunks_balance_causal_work():
    """Rank i holds chunks i and 2 CP - 1 - i: every rank the same number of visible keys."""
    cp, local = 4, 16
    visible = [
        int(chunk_positions(r, cp, local, torch.device("cpu")).add(1).sum()) for r in range(cp)
    ]
    assert len(set(visible)) == 1


def test_one_rank_is_plain_causal_attention():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    k, v = (
        torch.randn(BATCH, GROUPS, SEQ, DIM, generator=generator, dtype=torch.float64)
        for _ in range(2)
    )
    torch.testing.assert_close(ring_attention(q, k, v), full_causal_attention(q, k, v))
