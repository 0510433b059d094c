"""Per-stage corrections for stale gradients, wrapped around any optimizer of the suite.

Both use only what the stage has: its parameters, gradients and its own last update. No
communication, no extra weight version.

* **Error feedback** (`--async-error-feedback`), at the level of updates: with `u(t)` the
  update the optimizer computes at step `t` (weight decay excluded),
  `x(t+1) = x(t) - lr * wd * x(t) - 2 u(t) + u(t-1)`, `u(-1) = 0`. Under a one-step delay
  `u(t)` comes from the gradient at `x(t-1)`, which is the rule
  `x(t+1) = x(t) - 2u(t-1) + u(t-2)` written with the delayed update's own index. Weight
  decay stays outside `u`: the optimizer steps with its decay set to zero and the stage
  applies decoupled decay `x <- x - lr * wd * x` once (for SGD this makes the decay
  decoupled instead of torch's L2 term, with EF only). Costs one parameter-sized buffer.
  With `--async-error-feedback-stretch` a stage whose gradients are up to `d > 1` steps stale
  (PACI's stages s with N - 1 - s > a) extrapolates over its `d` steps:
  `x(t+1) = x(t) - lr * wd * x(t) - (1 + d) u(t) + d u(t-1)`; where `d <= 1` the rule is the
  one above, so on 4 stages at a >= 3 the stretch changes nothing. With
  `--async-error-feedback-delayed-stages` a stage whose delay bound is 0 (PACI's last, every
  stage of a flushing schedule) steps its plain update `x(t+1) = x(t) - lr * wd * x(t) - u(t)`:
  its gradients are fresh, and extrapolating them lowers the largest step it takes stably
  (a momentum of 0.9 on a quadratic: from 38 to 12.7 in units of the curvature,
  `tools/delay_stability.py`).
* **Delay compensation** (DC-ASGD, `--delay-compensation-lambda L`): the gradient taken at
  stale weights is corrected to the current ones by a diagonal outer-product Hessian
  estimate, `g <- g + L * g * g * (x_now - x_stale)`. The stage does not keep stale weights;
  `x_now - x_stale` is its last applied change `x(t) - x(t-1)`, exact for a constant one-step
  delay (PipeDream-2BW, `delayed_reference.py`) and the one-step estimate under PACI, where
  a microbatch crosses at most ceil((N-1-s)/a) steps. Costs one parameter-sized buffer.

In a synchronous phase (`--async-sync-warmup-iters`, `--async-sync-cooldown-iters`: 1F1B-flush,
fresh gradients) there is no delay to correct: error feedback steps the plain update
`x(t+1) = x(t) - lr * wd * x(t) - u(t)` and delay compensation adds nothing, both still
recording `u(t)` and `x(t+1) - x(t)` for the first asynchronous step after the phase
(`set_synchronous_phase`, which the training loop, the single-process engine and the delayed
reference call at each switch).

The buffers are part of the optimizer's state: saved in checkpoints, counted in
`optimizer_state_bytes`.
"""

import torch

DECAY_KEYS = ("weight_decay", "weight_decay_1d")  # the second: MARS's AdamW path


class DelayMitigatedOptimizer:
    """An optimizer (torch or `OptimizerChain`) with error feedback and/or DC-ASGD."""

    def __init__(self, inner, params, *, error_feedback: bool, compensation_lambda: float = 0.0,
                 error_feedback_steps: int = 1):  # fmt: skip
        self.inner = inner
        self.params = list(params)  # the model's: the optimizer may step copies of some
        self.error_feedback = error_feedback
        self.error_feedback_steps = error_feedback_steps  # 1; d stretched; 0 fresh gradients
        self.compensation_lambda = compensation_lambda
        self.previous_update: dict[torch.Tensor, torch.Tensor] = {}  # u(t-1), EF
        self.last_change: dict[torch.Tensor, torch.Tensor] = {}  # x(t) - x(t-1), DC
        self.synchronous = False  # fresh gradients (a synchronous phase): nothing to correct

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        merged = {p: dict(s) for p, s in self.inner.state.items()}
        for name, buffers in (("ef_previous_update", self.previous_update),
                              ("dc_last_change", self.last_change)):  # fmt: skip
            for param, buffer in buffers.items():
                merged.setdefault(param, {})[name] = buffer
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def _params(self) -> list[torch.Tensor]:
        return self.params

    def _decay_rates(self) -> dict[torch.Tensor, float]:
        """lr x weight decay of each parameter's group, read now (the scheduler sets both).
        A parameter the optimizer steps through copies (Muon's split QKV) takes its copies'."""
        rates = {}
        for group in self.param_groups:
            for param in group["params"]:
                rates[param] = group["lr"] * group.get("weight_decay", 0.0)
        for param, stand_in in getattr(self.inner, "stand_ins", {}).items():
            rates[param] = rates[stand_in]
        return rates

    @torch.no_grad()
    def step(self) -> None:
        if self.compensation_lambda and not self.synchronous:
            self._compensate_gradients()
        before = {p: p.detach().clone() for p in self._params()}
        if self.error_feedback:
            self._step_with_error_feedback(before)
        else:
            self.inner.step()
        if self.compensation_lambda:
            for param, old in before.items():
                self.last_change[param] = param.detach() - old

    def _compensate_gradients(self) -> None:
        for param in self._params():
            change = self.last_change.get(param)
            if param.grad is not None and change is not None:
                grad = param.grad
                grad.add_(grad * grad * change, alpha=self.compensation_lambda)

    def _step_with_error_feedback(self, before: dict) -> None:
        rates, decays = self._decay_rates(), []
        for group in self.param_groups:
            decays.append({key: group[key] for key in DECAY_KEYS if key in group})
            for key in decays[-1]:
                group[key] = 0.0
        try:
            self.inner.step()
        finally:
            for group, saved in zip(self.param_groups, decays):
                group.update(saved)
        for param in self.params:
            old = before[param]
            update = old - param.detach()  # u(t), no decay in it
            previous = self.previous_update.get(param)
            steps = 0 if self.synchronous else self.error_feedback_steps
            param.copy_(old).sub_(old, alpha=rates[param]).sub_(update, alpha=1.0 + steps)
            if previous is not None and steps:
                param.add_(previous, alpha=steps)
            self.previous_update[param] = update

    def state_dict(self) -> dict:
        params = self._params()
        index = {param: i for i, param in enumerate(params)}
        return {
            "inner": self.inner.state_dict(),
            "ef_previous_update": {index[p]: b for p, b in self.previous_update.items()},
            "dc_last_change": {index[p]: b for p, b in self.last_change.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        params = self._params()
        self.previous_update = {
            params[i]: b.clone() for i, b in state_dict["ef_previous_update"].items()
        }
        self.last_change = {params[i]: b.clone() for i, b in state_dict["dc_last_change"].items()}


def with_delay_mitigation(optimizer, params, config):
    """Wrap `optimizer` when `--async-error-feedback` or `--delay-compensation-lambda` ask
    (an OptimizerConfig's `async_error_feedback`, `delay_compensation_lambda`)."""
    error_feedback = config.async_error_feedback
    compensation = config.delay_compensation_lambda
    if not error_feedback and not compensation:
        return optimizer
    steps = max(1, config.stage_delay) if config.async_error_feedback_stretch else 1
    if config.async_error_feedback_delayed_stages and config.stage_delay == 0:
        steps = 0  # fresh gradients: nothing to extrapolate over
    return DelayMitigatedOptimizer(optimizer, params, error_feedback=error_feedback,
                                   compensation_lambda=compensation, error_feedback_steps=steps)  # fmt: skip


def set_synchronous_phase(optimizer, synchronous: bool) -> None:
    """Whether the coming steps of `optimizer` (any of the suite's wrappers, or None) take fresh
    gradients: its delay corrections step as with no delay while `synchronous` (module doc)."""
    pending = [optimizer]
    while pending:
        current = pending.pop()
        if isinstance(current, DelayMitigatedOptimizer):
            current.synchronous = synchronous
        elif current is not None:  # a wrapper: main weights, sharding, dense and expert parts
            pending += [getattr(current, "inner", None), *getattr(current, "parts", ())]


def plan_of_iteration(pipeline, train_iters: int, iteration: int):
    """`--async-sync-warmup-iters K` / `--async-sync-cooldown-iters K`: 1F1B-flush for the
    first and last K iterations (1-based), the asynchronous schedule in between. `pipeline`
    is the run's `PipelineConfig`; returns the `PipelinePlan` of `iteration`."""
    warmup, cooldown = pipeline.async_sync_warmup_iters, pipeline.async_sync_cooldown_iters
    if iteration <= warmup or iteration > train_iters - cooldown:
        return pipeline.plan.synchronous
    return pipeline.plan


def synchronous_phase_ends(pipeline, train_iters: int) -> list[int]:
    """Iterations after which the schedule changes: the pipeline drains there, so the switch
    happens with no microbatch in flight and no partial accumulation."""
    warmup, cooldown = pipeline.async_sync_warmup_iters, pipeline.async_sync_cooldown_iters
    ends = [warmup] if warmup else []
    if cooldown:
        ends.append(train_iters - cooldown)
    return [end for end in ends if 0 < end < train_iters]
