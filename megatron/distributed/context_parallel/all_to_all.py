"""Context-parallel attention by all-to-all (`--cp-comm-type a2a`, DeepSpeed-Ulysses style) and
its hierarchical form (`a2a+p2p`: all-to-all inside small groups, the ring between them).

A rank of a context-parallel group of size A holds, for every head, its 2 chunks of the
sequence (chunks i and 2A - 1 - i, see ring_attention.py). One all-to-all over the group trades
heads for sequence: afterwards it holds heads / A of the heads for the A ranks' chunks, i.e. the
whole sequence when the group is the whole context-parallel group. Attention is then local (plain
causal attention, ordinary dropout); a second all-to-all gives every rank its own chunks back
with every head. The backward of an all-to-all is the opposite all-to-all.

Hierarchical (`a2a+p2p`, --hierarchical-context-parallel-sizes A B, CP = A x B): megatron-core
puts context-parallel ranks o A .. o A + A - 1 in one inner group (the all-to-all) and ranks
j, A + j, .. in one outer group of size B (the ring). After the inner all-to-all, outer rank o
holds chunks o A .. o A + A - 1 and their mirrors 2 CP - 1 - (o A + j): exactly the 2 chunks
that rank o of a context-parallel group of size B holds when chunks are A times longer. So the
ring attention runs unchanged over the outer group, on heads / A heads.

Grouped-query attention: when the key/value groups do not divide over A, each group is first
repeated for its query heads (more to send, the same result).
"""

import torch
import torch.distributed as dist

from megatron.distributed.context_parallel.ring import (
    causal_attention,
    differentiable,
    expand_groups,
    ring_attention,
)


def _exchange(pieces: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send pieces[j] to rank j of `group`; return the piece received from each rank (all pieces
    of one call have the same shape)."""
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank(group)
    # contiguous buffers: the pieces may be views of a permuted [s, b, heads, d] tensor
    received = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in pieces]
    ops = []
    for j, rank in enumerate(ranks):
        if j == me:
            received[j] = pieces[j]
            continue
        ops.append(dist.P2POp(dist.isend, pieces[j].contiguous(), rank, group))
        ops.append(dist.P2POp(dist.irecv, received[j], rank, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, heads, 2c, d] (this rank's 2 chunks) -> [b, heads / A, 2 A c, d]: the group's chunks
    in the order of a group A times smaller (first chunks in rank order, then the mirrors)."""
    size = dist.get_world_size(group)
    received = _exchange(list(x.chunk(size, dim=1)), group)
    firsts, seconds = zip(*(piece.chunk(2, dim=2) for piece in received))
    return torch.cat([*firsts, *reversed(seconds)], dim=2)


def sequence_to_heads(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `heads_to_sequence`."""
    size = dist.get_world_size(group)
    chunks = y.chunk(2 * size, dim=2)
    pieces = [torch.cat([chunks[j], chunks[2 * size - 1 - j]], dim=2) for j in range(size)]
    return torch.cat(_exchange(pieces, group), dim=1)


_heads_to_sequence = differentiable(heads_to_sequence, sequence_to_heads)
_sequence_to_heads = differentiable(sequence_to_heads, heads_to_sequence)


def all_to_all_attention(
    q, k, v, inner_group, outer_group=None, scale=None, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of this rank's 2 chunks over the sequence held by the inner group (and,
    with an outer group, the ring over it). q: [b, heads, s_local, d]; k, v: [b, groups,
    s_local, d]. heads must divide by the inner group's size."""
    size, heads = dist.get_world_size(inner_group), q.shape[1]
    if heads % size:
        raise ValueError(f"{heads} attention heads do not divide over the all-to-all of {size}")
    if k.shape[1] % size:  # grouped-query attention with fewer groups than ranks
        k, v = expand_groups(k, heads), expand_groups(v, heads)
    q, k, v = (_heads_to_sequence(t, inner_group) for t in (q, k, v))
    if outer_group is None or dist.get_world_size(outer_group) == 1:
        context = causal_attention(q, k, v, scale, dropout_p)
    else:
        context = ring_attention(q, k, v, outer_group, scale, dropout_p)
    return _sequence_to_heads(context, inner_group)
