"""Our portable chunked gated delta rule (megatron/model/gated_delta_rule.py) against a
naive per-step recurrence written here in the textbook form: per head a state S [V, K],

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t (scale q_t),

with alpha_t = exp(g_t); fla's (and our) state is S^T [K, V]. Values and gradients, several
shapes (shorter than a chunk, a multiple of it, ragged), with and without an initial state,
grouped value heads, packed sequences; and closed forms (alpha = 1, beta = 0: the state never
changes)."""

import pytest
import torch

from megatron.model.gated_delta_rule import chunk_gated_delta_rule, l2norm


def naive_gated_delta_rule(q, k, v, g, beta, scale, initial_state=None):
    """One step at a time, float64, state [B, HV, V, K]; value head j reads key head
    j // (HV / H)."""
    batch, steps, key_heads, key_dim = q.shape
    value_heads, value_dim = v.size(2), v.size(3)
    group = value_heads // key_heads
    state = torch.zeros(batch, value_heads, value_dim, key_dim, dtype=torch.float64)
    if initial_state is not None:
        state = initial_state.to(torch.float64).transpose(-1, -2)
    identity = torch.eye(key_dim, dtype=torch.float64)
    outputs = []
    for t in range(steps):
        step = []
        for head in range(value_heads):
            q_t, k_t = q[:, t, head // group].double(), k[:, t, head // group].double()
            v_t = v[:, t, head].double()
            alpha, b = g[:, t, head].double().exp(), beta[:, t, head].double()
            projection = identity - b[:, None, None] * k_t[:, :, None] * k_t[:, None, :]
            new = alpha[:, None, None] * state[:, head] @ projection
            new = new + b[:, None, None] * v_t[:, :, None] * k_t[:, None, :]
            state = torch.cat([state[:, :head], new[:, None], state[:, head + 1 :]], dim=1)
            step.append(new @ (scale * q_t)[:, :, None])
        outputs.append(torch.cat(step, dim=-1).transpose(1, 2))  # [B, HV, V]
    return torch.stack(outputs, dim=1), state.transpose(-1, -2)  # [B, T, HV, V], [B, HV, K, V]


def random_inputs(batch, steps, key_heads, value_heads, key_dim, value_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = draw(batch, steps, key_heads, key_dim)
    k = torch.nn.functional.normalize(draw(batch, steps, key_heads, key_dim), dim=-1)
    v = draw(batch, steps, value_heads, value_dim)
    g = -torch.rand(batch, steps, value_heads, generator=generator, dtype=torch.float64)
    beta = torch.rand(batch, steps, value_heads, generator=generator, dtype=torch.float64)
    state = draw(batch, value_heads, key_dim, value_dim)
    return q, k, v, g, beta, state


SHAPES = [  # batch, steps, key heads, value heads, key dim, value dim, chunk size
    (1, 5, 1, 1, 4, 3, 16),  # shorter than a chunk
    (2, 32, 2, 2, 8, 8, 16),  # two whole chunks
    (2, 37, 2, 4, 8, 6, 16),  # ragged; two value heads per key head
    (1, 70, 1, 3, 16, 8, 64),  # the default chunk size, ragged; three value heads per key head
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_values_and_gradients_equal_the_naive_recurrence(shape, with_state):
    *sizes, chunk = shape
    inputs = [t.requires_grad_() for t in random_inputs(*sizes)]
    q, k, v, g, beta, state = inputs
    scale = q.size(-1) ** -0.5
    initial = state if with_state else None
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                        output_final_state=True, chunk_size=chunk)  # fmt: skip
    expected_out, expected_final = naive_gated_delta_rule(q, k, v, g, beta, scale, initial)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), expected_final, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(expected_out)  # any loss of both outputs
    ours = torch.autograd.grad((out * weights).sum() + final.sum(), inputs, allow_unused=True)
    theirs = torch.autograd.grad(
        (expected_out * weights).sum() + expected_final.sum(), inputs, allow_unused=True
    )
    for name, mine, reference in zip("q k v g beta state".split(), ours, theirs):
        if not with_state and name == "state":
            continue
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("with_state", [False, True])
def test_no_decay_no_update_keeps_the_state(with_state):
    """alpha = 1 (g = 0), beta = 0: every S_t is the initial state, so o_t = S0^T (scale q_t)
    (zero without one), and the final state is S0."""
    q, k, v, g, beta, state = random_inputs(2, 21, 2, 2, 8, 5)
    initial = state if with_state else None
    out, final = chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), torch.zeros_like(beta),
                                        scale=0.5, initial_state=initial,
                                        output_final_state=True, chunk_size=8)  # fmt: skip
    expected = 0.5 * torch.einsum("bthk,bhkv->bthv", q, state) if with_state else 0 * out
    torch.testing.assert_close(out, expected.to(out.dtype), rtol=1e-5, atol=1e-6)  # fp32 inside
    torch.testing.assert_close(final.double(), state if with_state else 0 * state)


def test_one_full_step_writes_the_value():
    """alpha = 1, beta = 1, one step with a unit key from a zero state: S = v k^T, so o = v
    (k . scale q)."""
    q, k, v, g, beta, _ = random_inputs(1, 1, 1, 1, 8, 4)
    out, _ = chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), torch.ones_like(beta))
    expected = v * (k * q * 8**-0.5).sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected)


def test_final_state_only_when_asked():
    q, k, v, g, beta, _ = random_inputs(1, 9, 1, 1, 4, 4)
    assert chunk_gated_delta_rule(q, k, v, g, beta)[1] is None


def test_qk_l2norm_in_kernel_equals_normalizing_first():
    q, k, v, g, beta, _ = random_inputs(1, 12, 2, 2, 8, 4)
    k = 3 * k
    inside, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    first, _ = chunk_gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)
    torch.testing.assert_close(inside, first)
    torch.testing.assert_close(l2norm(k), k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6))


def test_packed_sequences_run_from_their_own_states():
    q, k, v, g, beta, state = random_inputs(1, 30, 2, 2, 8, 4)
    states = torch.cat([state, -state])
    bounds = torch.tensor([0, 11, 30])
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=states,
                                        output_final_state=True, cu_seqlens=bounds,
                                        chunk_size=8)  # fmt: skip
    for index, (start, end) in enumerate([(0, 11), (11, 30)]):
        piece = [t[:, start:end] for t in (q, k, v, g, beta)]
        expected, expected_final = naive_gated_delta_rule(
            *piece, 8**-0.5, states[index : index + 1]
        )
        torch.testing.assert_close(out[:, start:end], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[index : index + 1].double(), expected_final,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_low_precision_inputs_keep_their_dtype():
    q, k, v, g, beta, _ = (t.to(torch.bfloat16) for t in random_inputs(1, 10, 1, 1, 8, 4))
    out, final = chunk_gated_delta_rule(q, k, v, g.float(), beta, output_final_state=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
