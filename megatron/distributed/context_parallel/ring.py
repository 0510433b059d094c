"""Context-parallel causal attention on any torch.distributed backend: ring attention.

With context parallelism of size CP each sequence is cut into 2 CP chunks and rank i of the
context-parallel group holds chunks i and 2 CP - 1 - i (megatron-core's
`get_batch_on_this_cp_rank`, which balances the causal work: every rank gets one early and one
late chunk). Attention needs every earlier key of the sequence, so the key/value blocks travel
around the ring of CP ranks: at step t rank i holds the block of rank i - t, attends its own
queries to it under the causal mask of the chunks' global positions, and merges the result into
a running softmax (the running maximum and denominator of each query row: numerically stable,
the same result as one softmax over the whole row). The backward goes round the ring again:
each rank recomputes the block's probabilities from the saved log-sum-exp, adds its queries'
gradient, and adds its share of the block's key/value gradient to accumulators that travel
with the block and arrive back at its owner after CP steps.

Grouped-query attention: keys and values carry fewer heads than the queries; each key/value
head serves `heads / groups` query heads, and its gradient is the sum over them.

Attention dropout: the probabilities are recomputed in the backward, so each block's mask is
drawn again there from the same generator: one seed per call (drawn from the default generator
of the device, which checkpointed recomputation restores), mixed with the global rank and the
block's owner. The probabilities are dropped after the softmax's normalization, as in plain
attention: the running denominator counts every key, the numerator only the kept ones, scaled
by 1 / (1 - p).

`ring_attention(q, k, v, group)` takes [batch, heads, local sequence, head dim] tensors and
returns the attention output in the query's layout; with CP = 1 it is plain causal attention.
The all-to-all (cp_all_to_all.py) and all-gather (cp_all_gather.py) forms share its helpers.
"""

import math

import torch
import torch.distributed as dist


def chunk_positions(rank: int, cp: int, local_length: int, device) -> torch.Tensor:
    """Global positions of the 2 chunks rank `rank` holds (chunks rank and 2 CP - 1 - rank)."""
    chunk = local_length // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second_start = (2 * cp - 1 - rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def expand_groups(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each group serves heads / groups query heads."""
    groups = tensor.shape[1]
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=1)


def _sum_groups(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `expand_groups` for gradients: sum over each group's query heads."""
    b, heads, s, d = tensor.shape
    if groups == heads:
        return tensor
    return tensor.view(b, groups, heads // groups, s, d).sum(dim=2)


def causal_attention(q, k, v, scale=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Plain causal attention over the whole (local) sequence, grouped-query attention
    expanded, ordinary dropout."""
    k, v = expand_groups(k, q.shape[1]), expand_groups(v, q.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale
    )


# Tests set this to a function of (owner, keep mask) to see the masks the ring draws.
observe_dropout_mask = None


def dropout_keep_mask(seed: int, owner: int, shape, p: float, device) -> torch.Tensor:
    """The keep mask (True: kept, probability 1 - p) of this rank's queries against the block
    of `owner`, the same every time it is drawn with the same seed."""
    generator = torch.Generator(device=device)
    # one stream per (call, rank, block): ranks hold different queries or heads
    generator.manual_seed((seed * 1_000_003 + dist.get_rank() * 8_191 + owner) % 2**63)
    keep = torch.rand(shape, generator=generator, device=device) >= p
    if observe_dropout_mask is not None:
        observe_dropout_mask(owner, keep)
    return keep


def _ring_exchange(tensors: list[torch.Tensor], group, rank: int, cp: int) -> list[torch.Tensor]:
    """Send `tensors` to the next rank of the ring and receive the previous rank's."""
    ranks = dist.get_process_group_ranks(group)
    send_to, receive_from = ranks[(rank + 1) % cp], ranks[(rank - 1) % cp]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, receive_from, group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _masked_scores(q, k, q_pos, k_pos, scale):
    """Scaled scores with the causal mask of the blocks' global positions (-inf above it)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    return scores.masked_fill(~allowed, float("-inf"))


def _block(qf, block_k, block_v, owner: int, cp: int, q_pos, scale, work_dtype):
    """The scores of this rank's queries against the key/value block of rank `owner` (causal
    mask of the chunks' global positions), and the block's keys and values expanded to every
    query head, in the working precision."""
    heads, local = qf.shape[1], qf.shape[2]
    k_pos = chunk_positions(owner, cp, local, qf.device)
    kf = expand_groups(block_k, heads).to(work_dtype)
    vf = expand_groups(block_v, heads).to(work_dtype)
    return _masked_scores(qf, kf, q_pos, k_pos, scale), kf, vf


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, dropout_p, seed):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = chunk_positions(rank, cp, q.shape[2], q.device)
        work_dtype = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(work_dtype)
        row_max = torch.full(q.shape[:-1], float("-inf"), dtype=work_dtype, device=q.device)
        denominator = torch.zeros(q.shape[:-1], dtype=work_dtype, device=q.device)
        numerator = torch.zeros(q.shape, dtype=work_dtype, device=q.device)
        block_k, block_v = k, v
        for step in range(cp):
            owner = (rank - step) % cp
            scores, _, vf = _block(qf, block_k, block_v, owner, cp, q_pos, scale, work_dtype)
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            correction = torch.exp(row_max - safe_max)
            probabilities = torch.exp(scores - safe_max[..., None])
            denominator = denominator * correction + probabilities.sum(dim=-1)
            if dropout_p:  # the denominator counts every key, the numerator the kept ones
                keep = dropout_keep_mask(seed, owner, scores.shape, dropout_p, q.device)
                probabilities = probabilities * keep / (1.0 - dropout_p)
            numerator = numerator * correction[..., None] + torch.matmul(probabilities, vf)
            row_max = new_max
            if step < cp - 1:
                block_k, block_v = _ring_exchange([block_k, block_v], group, rank, cp)
        output = numerator / denominator[..., None]
        log_sum_exp = row_max + torch.log(denominator)
        ctx.save_for_backward(q, k, v, output, log_sum_exp)
        ctx.group, ctx.scale, ctx.dropout_p, ctx.seed = group, scale, dropout_p, seed
        return output.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, output, log_sum_exp = ctx.saved_tensors
        group, scale, dropout_p = ctx.group, ctx.scale, ctx.dropout_p
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        groups, work_dtype = k.shape[1], output.dtype
        q_pos = chunk_positions(rank, cp, q.shape[2], q.device)
        qf, grad_out = q.to(work_dtype), grad_output.to(work_dtype)
        # D = rowsum(dO * O); with dropout still rowsum(dP * P) (O holds the dropped P)
        row_dot = (grad_out * output).sum(dim=-1)
        grad_q = torch.zeros_like(qf)
        block_k, block_v = k, v
        grad_k = torch.zeros(k.shape, dtype=work_dtype, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=work_dtype, device=v.device)
        for step in range(cp):
            owner = (rank - step) % cp
            scores, kf, vf = _block(qf, block_k, block_v, owner, cp, q_pos, scale, work_dtype)
            probabilities = torch.exp(scores - log_sum_exp[..., None])
            grad_p = torch.matmul(grad_out, vf.transpose(-1, -2))
            dropped = probabilities
            if dropout_p:  # the forward's mask, drawn again
                keep = dropout_keep_mask(ctx.seed, owner, scores.shape, dropout_p, q.device)
                dropped = probabilities * keep / (1.0 - dropout_p)
                grad_p = grad_p * keep / (1.0 - dropout_p)
            grad_v += _sum_groups(torch.matmul(dropped.transpose(-1, -2), grad_out), groups)
            grad_s = probabilities * (grad_p - row_dot[..., None])
            grad_q += torch.matmul(grad_s, kf) * scale
            grad_k += _sum_groups(torch.matmul(grad_s.transpose(-1, -2), qf) * scale, groups)
            # the block and its gradient accumulators move on; after cp moves they are home
            block_k, block_v, grad_k, grad_v = _ring_exchange(
                [block_k, block_v, grad_k, grad_v], group, rank, cp
            )
        grads = grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)
        return (*grads, None, None, None, None)


def ring_attention(
    q, k, v, group=None, scale: float | None = None, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence held by the context-
    parallel `group` (see the module docstring), attention dropout `dropout_p`. q: [b, heads,
    s_local, d]; k, v: [b, groups, s_local, d] with heads divisible by groups; s_local even
    (two chunks)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} groups")
    if q.shape[2] % 2:
        raise ValueError(f"local sequence {q.shape[2]} is not 2 chunks of equal length")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if group is None or dist.get_world_size(group) == 1:
        return causal_attention(q, k, v, scale, dropout_p)
    seed = 0
    if dropout_p:  # from the device's generator: recomputation restores it, the same seed
        seed = int(torch.randint(0, 2**62, (1,), device=q.device).item())
    return _RingAttention.apply(q, k, v, group, scale, dropout_p, seed)


def differentiable(collective, adjoint):
    """`collective(x, group)` as an autograd op whose gradient is `adjoint(grad, group)` (the
    context-parallel exchanges and their transposes)."""

    class _Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return collective(x, group)

        @staticmethod
        def backward(ctx, grad):
            return adjoint(grad, ctx.group), None

    return _Collective.apply
