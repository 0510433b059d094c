"""Context-parallel attention by all-gather (`--cp-comm-type all_gather`).

Every rank gathers the keys and values of the whole sequence from the context-parallel group
(rank i holds chunks i and 2 CP - 1 - i, see ring_attention.py), puts them in sequence order
and attends its own 2 chunks of queries to them under the causal mask of the queries' global
positions: plain attention, ordinary dropout. The backward of the gather is a reduce-scatter:
every rank's gradient for the whole sequence's keys and values is summed and each rank keeps
the part of its own chunks.
"""

import torch
import torch.distributed as dist

from megatron.distributed.context_parallel.ring import (
    chunk_positions,
    differentiable,
    expand_groups,
)


def _chunk_order(cp: int) -> list[int]:
    """Where each gathered chunk goes: the gathered tensor lists rank 0's 2 chunks, then rank
    1's, ..; entry n of the result is the index of sequence chunk n in that list."""
    owner_slot = {}
    for rank in range(cp):
        owner_slot[rank], owner_slot[2 * cp - 1 - rank] = 2 * rank, 2 * rank + 1
    return [owner_slot[n] for n in range(2 * cp)]


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, groups, 2c, d] on each rank -> [b, groups, 2 CP c, d], the whole sequence in order."""
    cp = dist.get_world_size(group)
    gathered = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(cp)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    chunks = [c for piece in gathered for c in piece.chunk(2, dim=2)]
    return torch.cat([chunks[slot] for slot in _chunk_order(cp)], dim=2)


def scatter_sequence_sum(y: torch.Tensor, group) -> torch.Tensor:
    """The backward of `gather_sequence`: the sum over the group of `y`, this rank's chunks.
    gloo has no reduce-scatter: there the whole sum is reduced and sliced."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = y.chunk(2 * cp, dim=2)
    pieces = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=2) for r in range(cp)]
    if dist.get_backend(group) == "gloo":
        total = torch.stack(pieces).contiguous()
        dist.all_reduce(total, group=group)
        return total[rank]
    mine = torch.empty(pieces[rank].shape, dtype=y.dtype, device=y.device)
    dist.reduce_scatter(mine, [p.contiguous() for p in pieces], group=group)
    return mine


_gather_sequence = differentiable(gather_sequence, scatter_sequence_sum)


def all_gather_attention(q, k, v, group, scale=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's 2 chunks of queries over the whole sequence's keys and
    values, gathered from `group`. q: [b, heads, s_local, d]; k, v: [b, groups, s_local, d]."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, local = q.shape[1], q.shape[2]
    k, v = (expand_groups(_gather_sequence(t, group), heads) for t in (k, v))
    q_pos = chunk_positions(rank, cp, local, q.device)
    k_pos = torch.arange(cp * local, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale
    )
