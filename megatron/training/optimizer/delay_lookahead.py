"""Per-stage momentum settings by gradient delay, for Muon and AdamW under an asynchronous
schedule. Stage s's gradients are up to `d_s` optimizer steps stale (PACI:
ceil((N-1-s)/a); PipeDream-2BW: 1; flush: 0), and the stage knows `d_s` from the schedule.

* **Delay-aware Nesterov look-ahead** (`--async-nesterov-lookahead`), after Ajanthan et al.,
  "Nesterov Method for Asynchronous Pipeline Parallel Optimization" (ICML 2025): Nesterov's
  update is the first moment extrapolated one step along its own last change,
  `m(t) + beta (m(t) - m(t-1))` (for Muon this equals torch's `lerp(g, m(t), beta)`). A
  gradient that is `d` steps late describes the weights `d` steps back, so the look-ahead is
  stretched over the steps the gradient lags: `m(t) + (1 + d) beta (m(t) - m(t-1))`. The last
  stage (`d = 0`) runs plain Nesterov. (This stretch is the project's own rule in the paper's
  spirit, not a transcription of its equations.) For AdamW the extrapolated moment replaces Adam's first
  moment, bias-corrected by the weight its gradients carry (`lookahead_bias_correction`).
* **Momentum by delay** (`--async-delay-momentum B`): the public code of that paper raises
  the momentum with a stage's delay; here the first-moment coefficient `beta` of stage s goes
  linearly from the configured value (no delay) to `B` (the most delayed stage):
  `beta_s = beta + (B - beta) d_s / max_s d_s`. Muon's `--muon-momentum` and AdamW's
  `--adam-beta1` both.

No new buffer: `m(t) - m(t-1)` is `(1 - beta)(g - m(t-1))`, computed within the step, and the
per-stage coefficients live in the param groups (saved with the optimizer's state).
"""

import dataclasses
import math

import torch


def stage_delay_bound(pipeline, training, stage: int) -> int:
    """Most optimizer steps a gradient of pipeline stage `stage` can be stale under the run's
    schedule (`PipelineConfig`, `TrainingConfig`): PACI's drift bound, the stashed versions of
    PipeDream and 2BW, 0 for a flushing schedule."""
    plan = pipeline.plan
    if plan.flushes:
        return 0
    schedule, stages = plan.schedule, plan.num_stages
    if schedule.drift_bound is not None:
        return schedule.drift_bound(stage, stages, training.num_microbatches)
    return schedule.extra_weight_versions(stage, stages)


def for_stage(config, pipeline, training, stage: int):
    """The `OptimizerConfig` of pipeline stage `stage`: its delay and the pipeline's largest,
    when a flag of this module needs them; `config` itself otherwise."""
    if not (config.async_nesterov_lookahead or config.async_delay_momentum is not None
            or config.async_error_feedback_stretch
            or config.async_error_feedback_delayed_stages):  # fmt: skip
        return config
    delays = [stage_delay_bound(pipeline, training, s) for s in range(pipeline.plan.num_stages)]
    return dataclasses.replace(config, stage_delay=delays[stage], max_stage_delay=max(delays))


def stage_momentum(beta: float, config) -> float:
    """`--async-delay-momentum`: `beta` moved towards the flag's value by the stage's share of
    the largest delay; `beta` without the flag or without any delay."""
    target = config.async_delay_momentum
    if target is None or config.max_stage_delay == 0:
        return beta
    return beta + (target - beta) * config.stage_delay / config.max_stage_delay


def stage_lookahead_steps(config) -> int | None:
    """Steps of Nesterov look-ahead for this stage: 1 + its delay; None without the flag."""
    return 1 + config.stage_delay if config.async_nesterov_lookahead else None


def step_moment(moment: torch.Tensor, grad: torch.Tensor, beta: float, steps: int | None):
    """Advance the first moment `m <- beta m + (1 - beta) g` in place and return the direction
    to step along: `m` itself, or with `steps` the look-ahead `m + steps beta (m - m_old)`."""
    change = (grad - moment).mul_(1 - beta)
    moment.add_(change)
    if steps is None:
        return moment
    return moment.add(change, alpha=steps * beta)


def lookahead_bias_correction(beta: float, step: int, steps: int | None) -> float:
    """What the weights of the gradients in the direction sum to after `step` steps from a
    zero moment: Adam's `1 - beta^t`, plus the look-ahead's `steps (1 - beta) beta^t`."""
    correction = 1 - beta**step
    if steps is not None:
        correction += steps * (1 - beta) * beta**step
    return correction


class LookaheadAdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled decay, bias-corrected moments) whose first moment is
    the delay-aware Nesterov look-ahead of its group's `lookahead_steps`. State under torch's
    names (`step`, `exp_avg`, `exp_avg_sq`)."""

    def __init__(self, params, *, lr, betas, eps, weight_decay, lookahead_steps):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        lookahead_steps=lookahead_steps)  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, group)
        return None

    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        (beta1, beta2), lr, steps = group["betas"], group["lr"], group["lookahead_steps"]
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step, grad = int(state["step"].item()), param.grad
        direction = step_moment(state["exp_avg"], grad, beta1, steps)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        param.mul_(1 - lr * group["weight_decay"])
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        size = lr / lookahead_bias_correction(beta1, step, steps)
        param.addcdiv_(direction, denom, value=-size)
