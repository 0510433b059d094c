"""Error feedback and DC-ASGD against their closed forms, for every optimizer of the suite.

With a linear loss the gradients do not depend on the weights, so every optimizer's update
u(t) depends on the gradient history only and is the same with and without the correction.
Error feedback `x(t+1) = x(t) - 2u(t) + u(t-1)` must then give exactly the plain trajectory
extrapolated by one update: `x_ef(t) = 2 x(t) - x(t-1)`.
"""

import copy

import pytest
import torch
from conftest import TinyGPT, optimizer_config, schedule_config
from test_optimizers import set_random_grads

from megatron.training.optimizer.build import build_lr_scheduler, build_optimizer
from megatron.training.optimizer.delay_mitigation import (
    DelayMitigatedOptimizer,
    set_synchronous_phase,
)
from megatron.training.optimizer.suite import OPTIMIZERS
from megatron.training.reporting import _optimizer_state_bytes


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def built(model, config):
    optimizer = build_optimizer(model, config)
    build_lr_scheduler(
        optimizer, schedule_config(config)
    )  # sets each group's LR (Muon's scale multipliers)
    return optimizer


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_error_feedback_extrapolates_the_plain_trajectory_by_one_update(name):
    plain, corrected = TinyGPT(), TinyGPT()
    plain_opt = built(plain, optimizer_config(name))
    corrected_opt = built(corrected, optimizer_config(name, async_error_feedback=True))
    assert isinstance(corrected_opt, DelayMitigatedOptimizer)
    history = [flat(plain)]
    for step in range(4):
        set_random_grads(plain, step), set_random_grads(corrected, step)
        plain_opt.step(), corrected_opt.step()
        history.append(flat(plain))
        expected = 2 * history[-1] - history[-2]
        torch.testing.assert_close(flat(corrected), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(flat(corrected), history[-1])  # the correction did something


@pytest.mark.parametrize(
    "delay,stretch,delayed_stages,steps",
    [(0, True, False, 1), (1, True, False, 1), (2, True, False, 2), (3, True, False, 3),
     (0, False, True, 0), (1, False, True, 1), (2, False, True, 1), (0, True, True, 0),
     (2, True, True, 2)],
)  # fmt: skip
def test_error_feedback_extrapolates_by_the_stage_delay(delay, stretch, delayed_stages, steps):
    """On a stage d steps stale, x(t+1) = x(t) - (1 + k) u(t) + k u(t-1), the plain trajectory
    extrapolated by k updates, x_ef(t) = (1 + k) x(t) - k x(t-1): k = max(1, d) with
    --async-error-feedback-stretch, 1 without; with --async-error-feedback-delayed-stages k = 0
    (the plain trajectory itself) where d = 0."""
    plain, corrected = TinyGPT(), TinyGPT()
    plain_opt = built(plain, optimizer_config("adam"))
    config = optimizer_config("adam", async_error_feedback=True, stage_delay=delay,
                              async_error_feedback_stretch=stretch,
                              async_error_feedback_delayed_stages=delayed_stages)  # fmt: skip
    corrected_opt = built(corrected, config)
    history = [flat(plain)]
    for step in range(4):
        set_random_grads(plain, step), set_random_grads(corrected, step)
        plain_opt.step(), corrected_opt.step()
        history.append(flat(plain))
        expected = (1 + steps) * history[-1] - steps * history[-2]
        torch.testing.assert_close(flat(corrected), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "muon", "lion"])
def test_error_feedback_keeps_weight_decay_outside_the_update(name):
    """x(t+1) = x(t) - lr wd x(t) - 2u(t) + u(t-1), with u from a run without decay."""
    lr, wd = 1e-2, 0.1
    plain, corrected = TinyGPT(), TinyGPT()
    plain_opt = built(plain, optimizer_config(name, lr=lr))
    corrected_opt = built(corrected, optimizer_config(name, lr=lr, weight_decay=wd,
                                                    async_error_feedback=True))  # fmt: skip
    decayed = torch.cat(
        [torch.full((p.numel(),), float(p.ndim >= 2)) for p in corrected.parameters()]
    )
    previous_update, x = torch.zeros_like(flat(plain)), flat(corrected)
    for step in range(3):
        before = flat(plain)
        set_random_grads(plain, step), set_random_grads(corrected, step)
        plain_opt.step(), corrected_opt.step()
        update = before - flat(plain)
        x = x - lr * wd * decayed * x - 2 * update + previous_update
        previous_update = update
        torch.testing.assert_close(flat(corrected), x, rtol=1e-5, atol=1e-6)


def test_delay_compensation_adds_the_diagonal_hessian_term():
    """SGD without momentum: x2 = x1 - lr (g1 + L g1 * g1 * (x1 - x0))."""
    lr, lam = 0.1, 0.5
    model = TinyGPT()
    config = optimizer_config("sgd", lr=lr, sgd_momentum=0.0, delay_compensation_lambda=lam)
    optimizer = built(model, config)
    x0 = flat(model)
    set_random_grads(model, 0)
    optimizer.step()
    x1 = flat(model)
    g1 = torch.cat([g.reshape(-1) for g in set_random_grads(model, 1).values()])
    optimizer.step()
    torch.testing.assert_close(flat(model), x1 - lr * (g1 + lam * g1 * g1 * (x1 - x0)))


@pytest.mark.parametrize("name", ["adam", "muon"])
def test_error_feedback_steps_the_plain_update_in_a_synchronous_phase(name):
    """Two synchronous steps (fresh gradients) then two asynchronous ones: the first two follow
    the plain trajectory, x(t+1) = x(t) - u(t); the third extrapolates from the second's update,
    recorded in the phase: x(3) = x(2) - 2u(2) + u(1), as the closed form with u from the plain
    run says."""
    plain, corrected = TinyGPT(), TinyGPT()
    plain_opt = built(plain, optimizer_config(name))
    corrected_opt = built(corrected, optimizer_config(name, async_error_feedback=True))
    updates, x = [], flat(corrected)
    for step in range(4):
        set_synchronous_phase(corrected_opt, step < 2)
        before = flat(plain)
        set_random_grads(plain, step), set_random_grads(corrected, step)
        plain_opt.step(), corrected_opt.step()
        updates.append(before - flat(plain))
        x = x - updates[-1] if step < 2 else x - 2 * updates[-1] + updates[-2]
        torch.testing.assert_close(flat(corrected), x, rtol=1e-5, atol=1e-6)
        if step < 2:
            torch.testing.assert_close(flat(corrected), flat(plain), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(flat(corrected), flat(plain))  # extrapolated after the phase


def test_delay_compensation_adds_nothing_in_a_synchronous_phase():
    """SGD, L = 0.5: the step after a synchronous one is compensated with the synchronous
    step's change; a synchronous step is not, though a change is recorded before it."""
    lr, lam = 0.1, 0.5
    config = optimizer_config("sgd", lr=lr, sgd_momentum=0.0, delay_compensation_lambda=lam)
    model = TinyGPT()
    optimizer = built(model, config)
    steps = []
    for step, synchronous in enumerate((False, True, False)):
        set_synchronous_phase(optimizer, synchronous)
        before = flat(model)
        grads = torch.cat([g.reshape(-1) for g in set_random_grads(model, step).values()])
        optimizer.step()
        steps.append((before, grads, flat(model)))
    (x0, _, x1), (_, g1, x2), (_, g2, x3) = steps
    torch.testing.assert_close(x2, x1 - lr * g1)
    torch.testing.assert_close(x3, x2 - lr * (g2 + lam * g2 * g2 * (x2 - x1)))
    assert not torch.allclose(x2, x1 - lr * (g1 + lam * g1 * g1 * (x1 - x0)))


def test_the_synchronous_phase_reaches_the_corrections_under_a_main_weights_wrapper():
    """bf16 weights: error feedback runs on the fp32 main weights, inside the wrapper that
    holds them; the switch reaches it there, and leaves an optimizer without corrections be."""
    model = TinyGPT().to(torch.bfloat16)
    wrapper = built(model, optimizer_config("adam", async_error_feedback=True, bf16=True))
    assert not isinstance(wrapper, DelayMitigatedOptimizer)
    assert isinstance(wrapper.inner, DelayMitigatedOptimizer)
    set_synchronous_phase(wrapper, True)
    assert wrapper.inner.synchronous
    set_synchronous_phase(wrapper, False)
    assert not wrapper.inner.synchronous
    set_synchronous_phase(built(TinyGPT(), optimizer_config("adam")), True)  # nothing to set
    set_synchronous_phase(None, True)


@pytest.mark.parametrize("name", ["adam", "muon"])
def test_mitigation_state_survives_a_checkpoint(name):
    config = optimizer_config(name, async_error_feedback=True, delay_compensation_lambda=0.1)
    model = TinyGPT()
    optimizer = built(model, config)
    for step in range(2):
        set_random_grads(model, step)
        optimizer.step()
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(
        optimizer.state_dict()
    )
    resumed = TinyGPT(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = built(resumed, config)
    resumed_optimizer.load_state_dict(saved_state)
    for step in range(2, 4):
        set_random_grads(model, step), set_random_grads(resumed, step)
        optimizer.step(), resumed_optimizer.step()
    assert torch.equal(flat(model), flat(resumed))


def test_mitigation_buffers_count_as_optimizer_state():
    config = optimizer_config("adam")
    plain, corrected = TinyGPT(), TinyGPT()
    plain_opt = built(plain, config)
    corrected_opt = built(corrected, optimizer_config("adam", async_error_feedback=True))
    set_random_grads(plain, 0), set_random_grads(corrected, 0)
    plain_opt.step(), corrected_opt.step()
    param_bytes = sum(p.numel() * 4 for p in corrected.parameters())
    assert _optimizer_state_bytes(corrected_opt) == _optimizer_state_bytes(plain_opt) + param_bytes
