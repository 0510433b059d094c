"""A portable (plain torch, any device) chunked gated delta rule: the stand-in for
flash-linear-attention's Triton kernels `chunk_gated_delta_rule` and `l2norm` where `fla` is not
installed (megatron-core's GatedDeltaNet calls them; gated_delta_net.py puts these in).

Conventions (fla's, as megatron-core calls it): q, k [B, T, H, K], v [B, T, HV, V] with HV a
multiple of H (value head j reads key head j // (HV / H), megatron-core's `repeat_interleave`
grouping; megatron-core repeats the heads itself, so H == HV there), g [B, T, HV] the log of
the decay alpha_t (<= 0), beta [B, T, HV], the state S [K, V] per head. Per step and head:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

(the brief's S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t with
the state stored transposed). `scale` defaults to K ** -0.5; `use_qk_l2norm_in_kernel`
normalizes q and k first; the initial and final states are [N, HV, K, V] in fp32; `cu_seqlens`
(B == 1) runs each of the N packed sequences from its own initial state.

The chunked form: within a chunk of C steps with G_t the cumulative log decay and S0 the state
entering it, u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t) satisfies the unit-lower-triangular
system (I + A) U = beta V - beta e^G (K S0) with A_tj = beta_t e^(G_t - G_j) k_t.k_j (j < t),
solved once per chunk for all chunks at once; then O = scale (e^G Q S0 + (Q K^T * D) U) with
D_tj = e^(G_t - G_j) (j <= t), and the state leaves the chunk as e^(G_C) S0 + (e^(G_C - G) K)^T U.
Only this last step runs chunk after chunk. Everything is computed in fp32.
"""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps) over the last dimension (in fp32)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).sum(dim=dim, keepdim=True) + eps)
    return normed.to(output_dtype or x.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs [B, T, HV, V] (v's dtype) and, with `output_final_state`, the final states
    [N, HV, K, V] (fp32; else None). Same arguments as fla's `chunk_gated_delta_rule`."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    groups = v.size(2) // q.size(2)
    if groups > 1:  # grouped value heads: each key head serves `groups` value heads
        q, k = (t.repeat_interleave(groups, dim=2) for t in (q, k))
    if cu_seqlens is None:
        out, final = _chunked(q, k, v, g, beta, scale, initial_state, chunk_size)
        return out, final if output_final_state else None
    if q.size(0) != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into batch 1, got {q.size(0)}")
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[index : index + 1]
        pieces = (t[:, start:end] for t in (q, k, v, g, beta))
        out, final = _chunked(*pieces, scale, state, chunk_size)
        outs.append(out)
        finals.append(final)
    final = torch.cat(finals) if output_final_state else None
    return torch.cat(outs, dim=1), final


def _chunked(q, k, v, g, beta, scale, initial_state, chunk_size):
    """The gated delta rule over [B, T, H, *] inputs of equal head counts, chunk by chunk."""
    batch, steps, heads, key_dim = k.shape
    value_dim, out_dtype = v.size(-1), v.dtype
    pad = (-steps) % chunk_size  # padded steps: k = v = 0, beta = 0, no decay: state unchanged
    # [B, T, H, d] -> [B, H, chunks, C, d] in fp32
    q, k, v = (_to_chunks(F.pad(t.float(), (0, 0, 0, 0, 0, pad)), chunk_size) for t in (q, k, v))
    g, beta = (_to_chunks(F.pad(t.float(), (0, 0, 0, pad)), chunk_size) for t in (g, beta))
    decay = g.cumsum(-1)  # G_t within each chunk
    within = _decay_matrix(decay)  # D_tj = e^(G_t - G_j), j <= t
    keys_beta = k * beta.unsqueeze(-1)
    identity = torch.eye(chunk_size, dtype=torch.float32, device=k.device)
    lower = (keys_beta @ k.transpose(-1, -2)) * within * (1 - identity)  # A (strictly lower)
    # U = T (beta V) - W S0 with T = (I + A)^-1, W = T (beta e^G K)
    t_beta_v = torch.linalg.solve_triangular(identity + lower, v * beta.unsqueeze(-1),
                                             upper=False, unitriangular=True)  # fmt: skip
    weights = torch.linalg.solve_triangular(identity + lower, keys_beta * decay.exp().unsqueeze(-1),
                                            upper=False, unitriangular=True)  # fmt: skip
    scores = (q @ k.transpose(-1, -2)) * within * scale  # Q K^T * D, scaled
    queries_decayed = q * decay.exp().unsqueeze(-1) * scale
    keys_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # e^(G_C - G_j) k_j
    state = (
        torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=k.device)
        if initial_state is None
        else initial_state.float()
    )
    outputs = []
    for chunk in range(q.size(2)):
        updates = t_beta_v[:, :, chunk] - weights[:, :, chunk] @ state
        outputs.append(queries_decayed[:, :, chunk] @ state + scores[:, :, chunk] @ updates)
        end_decay = decay[:, :, chunk, -1, None, None].exp()
        state = end_decay * state + keys_to_end[:, :, chunk].transpose(-1, -2) @ updates
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :steps]  # [B, H, T, V]
    return out.transpose(1, 2).to(out_dtype), state


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, T / C, C, ...]."""
    x = x.transpose(1, 2)
    return x.reshape(x.size(0), x.size(1), -1, chunk_size, *x.shape[3:])


def _decay_matrix(decay: torch.Tensor) -> torch.Tensor:
    """e^(G_t - G_j) for j <= t, 0 above the diagonal (masked before the exponential, where the
    difference is positive and could overflow)."""
    size = decay.size(-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=decay.device).tril()
    difference = decay.unsqueeze(-1) - decay.unsqueeze(-2)
    return difference.masked_fill(~causal, float("-inf")).exp()
