"""--async-nesterov-lookahead and --async-delay-momentum against hand-written updates: the
delay-aware look-ahead `m + (1 + d) beta (m - m_old)` for Muon's momentum and AdamW's first
moment, each stage's delay from its schedule, the flags' one-line errors, and a checkpoint
round trip."""

import copy
import math

import pytest
import torch
from conftest import TinyGPT, optimizer_config, schedule_config
from test_optimizer_args import validated
from test_optimizers import set_random_grads

from megatron.common.errors import UserError
from megatron.training.optimizer.build import build_lr_scheduler, build_optimizer
from megatron.training.optimizer.delay_lookahead import (
    LookaheadAdamW,
    for_stage,
    stage_delay_bound,
)
from megatron.training.optimizer.muon import COEFFICIENT_SETS, Muon, orthogonalize
from megatron.training.optimizer.suite import is_hidden_matrix


def built(model, config):
    optimizer = build_optimizer(model, config)
    build_lr_scheduler(optimizer, schedule_config(config))  # sets each group's LR
    return optimizer


def run_config(extra: list[str]):
    from megatron.training.config import RunConfig

    return RunConfig.from_args(validated(extra))


@pytest.mark.parametrize(
    "schedule, delays",
    [("paci", [1, 1, 1, 0]), ("2bw", [1, 1, 1, 1]), ("1f1b", [0, 0, 0, 0])],
)
def test_each_stage_delay_is_the_schedule_bound(schedule, delays):
    config = run_config(["--pipeline-schedule", schedule])  # 4 stages, a = 4
    bounds = [stage_delay_bound(config.pipeline, config.training, s) for s in range(4)]
    assert bounds == delays


def test_paci_delay_bound_follows_a():
    """ceil((N - 1 - s) / a) with a = 1: 3, 2, 1, 0."""
    config = run_config(["--pipeline-schedule", "paci", "--global-batch-size", "2"])
    bounds = [stage_delay_bound(config.pipeline, config.training, s) for s in range(4)]
    assert bounds == [3, 2, 1, 0]


def test_flags_reach_each_stage_config():
    config = run_config(["--pipeline-schedule", "paci", "--global-batch-size", "2",
                         "--optimizer", "muon", "--async-nesterov-lookahead",
                         "--async-delay-momentum", "0.99"])  # fmt: skip
    stages = [for_stage(config.optimizer, config.pipeline, config.training, s) for s in range(4)]
    assert [(c.stage_delay, c.max_stage_delay) for c in stages] == [(3, 3), (2, 3), (1, 3), (0, 3)]
    assert stages[0].async_nesterov_lookahead and stages[0].async_delay_momentum == 0.99
    plain = run_config(["--pipeline-schedule", "paci"])
    assert for_stage(plain.optimizer, plain.pipeline, plain.training, 0) is plain.optimizer


def test_error_feedback_stretch_reads_each_stage_delay():
    """4 stages at a = 1: delay bounds 3, 2, 1, 0; the stretch extrapolates by max(1, d)
    updates, and without it every stage by one; with --async-error-feedback-delayed-stages the
    last stage (fresh gradients) by none."""
    from megatron.training.optimizer.build import build_optimizer as build

    flags = ["--pipeline-schedule", "paci", "--global-batch-size", "2", "--async-error-feedback"]
    delayed = "--async-error-feedback-delayed-stages"
    for extra, expected in (([], [1, 1, 1, 1]), (["--async-error-feedback-stretch"], [3, 2, 1, 1]),
                            ([delayed], [1, 1, 1, 0]),
                            (["--async-error-feedback-stretch", delayed], [3, 2, 1, 0])):  # fmt: skip
        config = run_config(flags + extra)
        stages = [for_stage(config.optimizer, config.pipeline, config.training, s)
                  for s in range(4)]  # fmt: skip
        assert [build(TinyGPT(), c).error_feedback_steps for c in stages] == expected


def lookahead_config(name: str, delay: int, momentum: float | None = None, **overrides):
    return optimizer_config(name, async_nesterov_lookahead=True, async_delay_momentum=momentum,
                            stage_delay=delay, max_stage_delay=3, **overrides)  # fmt: skip


def test_muon_lookahead_against_a_hand_written_update():
    """Stage delay 2 (look-ahead 3 steps), momentum raised to 0.9 + (0.99 - 0.9) 2/3 = 0.96."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    coefficients = COEFFICIENT_SETS["simple"] * 5
    muon = Muon([weight], lr=0.02, weight_decay=0.1, momentum=0.96, nesterov=False,
                coefficients=coefficients)  # fmt: skip
    muon.param_groups[0]["lookahead_steps"] = 3
    expected, buffer = weight.detach().clone(), torch.zeros(6, 4)
    for step in range(4):
        grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        weight.grad = grad.clone()
        muon.step()
        old, buffer = buffer, 0.96 * buffer + 0.04 * grad
        direction = buffer + 3 * 0.96 * (buffer - old)
        expected = expected * (1 - 0.02 * 0.1)
        expected -= 0.02 * math.sqrt(6 / 4) * orthogonalize(direction, coefficients).float()
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-5, atol=1e-6)


def test_muon_one_step_lookahead_is_torch_nesterov():
    """Delay 0: the look-ahead of one step is Nesterov's (torch's lerp(g, m, beta))."""
    plain, ahead = TinyGPT(), TinyGPT()
    plain_opt = built(plain, optimizer_config("muon", muon_nesterov=True))
    ahead_opt = built(ahead, lookahead_config("muon", delay=0))
    for step in range(3):
        set_random_grads(plain, step), set_random_grads(ahead, step)
        plain_opt.step(), ahead_opt.step()
    for (name, p), q in zip(plain.named_parameters(), ahead.parameters()):
        if is_hidden_matrix(name, p):  # Muon's; the rest is AdamW with or without look-ahead
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def hand_adamw(weights, grads, *, lr, beta1, beta2, eps, wd, steps):
    """AdamW with the first moment's look-ahead over `steps`, written out."""
    moment, second = torch.zeros_like(weights), torch.zeros_like(weights)
    for t, grad in enumerate(grads, start=1):
        old = moment
        moment = beta1 * moment + (1 - beta1) * grad
        second = beta2 * second + (1 - beta2) * grad * grad
        direction = moment + steps * beta1 * (moment - old)
        correction = 1 - beta1**t + steps * (1 - beta1) * beta1**t
        weights = weights * (1 - lr * wd)
        denom = (second / (1 - beta2**t)).sqrt() + eps
        weights = weights - lr * direction / correction / denom
    return weights


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_adamw_lookahead_against_a_hand_written_update(steps):
    torch.manual_seed(1)
    start = torch.randn(5, 3)
    weight = torch.nn.Parameter(start.clone())
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    adamw = LookaheadAdamW([weight], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                           lookahead_steps=steps)  # fmt: skip
    for grad in grads:
        weight.grad = grad.clone()
        adamw.step()
    expected = hand_adamw(start, grads, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1,
                          steps=steps)  # fmt: skip
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-5, atol=1e-6)


def test_adamw_lookahead_is_adamw_under_a_constant_gradient():
    """Closed form: with g constant the bias-corrected look-ahead is g itself, whatever the
    delay, so the trajectory is torch's AdamW's."""
    start, grad = torch.randn(4, 4), torch.randn(4, 4)
    plain, ahead = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([plain], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ours = LookaheadAdamW([ahead], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          lookahead_steps=3)  # fmt: skip
    for _ in range(6):
        plain.grad, ahead.grad = grad.clone(), grad.clone()
        torch_adamw.step(), ours.step()
    torch.testing.assert_close(ahead, plain, rtol=1e-5, atol=1e-6)


def test_suite_builds_each_stage_settings():
    """Delay 2 of 3: look-ahead 3 steps; momentum 0.9 -> 0.96, Muon's and AdamW's."""
    optimizer = built(TinyGPT(), lookahead_config("muon", delay=2, momentum=0.99))
    adamw, muon = optimizer.optimizers["adamw"], optimizer.optimizers["muon"]
    assert isinstance(adamw, LookaheadAdamW)
    assert all(g["lookahead_steps"] == 3 for g in adamw.param_groups + muon.param_groups)
    assert all(g["momentum"] == pytest.approx(0.96) for g in muon.param_groups)
    assert all(g["betas"][0] == pytest.approx(0.96) for g in adamw.param_groups)
    plain = built(TinyGPT(), optimizer_config("muon", async_delay_momentum=0.99, stage_delay=0,
                                              max_stage_delay=3))  # fmt: skip
    assert isinstance(plain.optimizers["adamw"], torch.optim.AdamW)
    assert "lookahead_steps" not in plain.optimizers["muon"].param_groups[0]
    assert plain.optimizers["muon"].param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("name", ["adam", "muon"])
def test_state_round_trips_through_a_checkpoint(name):
    config = lookahead_config(name, delay=1, momentum=0.95)
    model = TinyGPT()
    optimizer = built(model, config)
    for step in range(2):
        set_random_grads(model, step)
        optimizer.step()
    # torch's load shares the saved tensors: a copy, as a checkpoint file is
    saved = copy.deepcopy(optimizer.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    resumed = TinyGPT()
    with torch.no_grad():
        for p, w in zip(resumed.parameters(), weights):
            p.copy_(w)
    resumed_opt = built(resumed, config)
    resumed_opt.load_state_dict(saved)
    for step in range(2, 4):
        set_random_grads(model, step), set_random_grads(resumed, step)
        optimizer.step(), resumed_opt.step()
    for p, q in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--async-nesterov-lookahead"], "--async-nesterov-lookahead needs an asynchronous"),
        (["--async-delay-momentum", "0.95"], "--async-delay-momentum needs an asynchronous"),
        (["--pipeline-schedule", "paci", "--async-delay-momentum", "1"],
         "--async-delay-momentum must be a number >= 0 and < 1, got 1.0"),
        (["--pipeline-schedule", "paci", "--async-nesterov-lookahead", "--optimizer", "sgd"],
         "--async-nesterov-lookahead with --optimizer sgd is not supported yet"),
        (["--pipeline-schedule", "paci", "--async-nesterov-lookahead", "--optimizer", "muon",
          "--muon-scalar-optimizer", "lion"],
         "--async-nesterov-lookahead with --muon-scalar-optimizer lion is not supported yet"),
        (["--pipeline-schedule", "paci", "--async-error-feedback-stretch"],
         "--async-error-feedback-stretch needs --async-error-feedback"),
        (["--pipeline-schedule", "paci", "--async-error-feedback-delayed-stages"],
         "--async-error-feedback-delayed-stages needs --async-error-feedback"),
        *[(["--pipeline-schedule", "paci", "--async-error-feedback", flag, "--num-layers", "8",
            "--num-layers-per-virtual-pipeline-stage", "1"],
           f"{flag} with virtual pipeline stages is not supported yet")
          for flag in ("--async-error-feedback-stretch", "--async-error-feedback-delayed-stages")],
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(extra, message):
    with pytest.raises(UserError, match=message):
        validated(extra)


def test_a_drift_bound_above_one_step_is_noted_at_start():
    """PACI at a = 1 on 4 stages: bounds 3 2 1 0, and the note says what keeps them at one;
    nothing at a = 4, under 1f1b, or with the in-flight limit that caps the drift at one."""
    from megatron.training.training import drift_bound_note

    note = drift_bound_note(run_config(["--pipeline-schedule", "paci", "--global-batch-size", "2"]))
    assert note == ("> note: PACI on 4 stages at a = 1 microbatches per step: drift bound by stage "
                    "3 2 1 0; a >= 3 (the same global batch at a smaller --micro-batch-size) keeps "
                    "every stage within one step")  # fmt: skip
    for quiet in (["--pipeline-schedule", "paci"], ["--global-batch-size", "2"],
                  ["--pipeline-schedule", "paci", "--global-batch-size", "2",
                   "--paci-inflight-limit", "flush"]):  # fmt: skip
        assert drift_bound_note(run_config(quiet)) is None
