"""PACI: asynchronous 1F1B with no flush and local gradient accumulation.

Each stage i of N (here 0-indexed: s = i - 1) follows three local rules and nothing else:

1. Admission: start a new forward only while its outstanding forwards q < N - s
   (the paper's q_i < N + 1 - i): exactly 1F1B's peak in-flight count, so 1F1B's memory.
2. Backwards run in forward (FIFO) order, each once its output gradient is there.
3. After every `a` local backwards the stage steps its own optimizer. There is no flush and
   no global synchronization: the pipeline never drains between steps.

Drift: a microbatch's backward runs on the stage's *current* weights. Between its forward and
backward, stage s runs at most N - 1 - s other backwards, so it crosses at most
ceil((N - 1 - s) / a) optimizer steps; the last stage never drifts. Accumulation is the knob
that slows weight versions down relative to the pipeline delay.

What a stage does when both an input and a gradient could run is the *arrival rule*
(`ARRIVAL_RULES`, `--paci-arrival-rule`); rules 1 and 3, so the memory and the drift bound,
are the same under every rule:

* ``fixed`` (the default): 1F1B's order without the flush: forward whenever admitted, else
  backward, blocking on whichever input that needs. It decides on counters only, so runs
  reproduce bit for bit, and it keeps the pipeline at its slowest stage's pace with uneven
  and noisy stage times (docs/arrival_rules.md);
* ``backward-first``: the paper's order: an arrived gradient first, then an admitted forward.
  With one slow stage it loses up to 13% of that stage's pace: the slow stage drains its
  gradients, runs out of admitted work and then waits for the next gradient;
* ``forward-first``: an admitted forward whose input has arrived, else an arrived gradient.
  At the pace without noise; with noise it loses a few percent against ``fixed``, because a
  backward run while the input is late delays that forward's activation to the stages after
  it, whose windows (N - s) are smaller.

With --deterministic-mode the stage follows the fixed order (`FIXED_ORDER`) whatever the rule.
"""

import dataclasses

from .base import DONE, STEP, WAIT, Action, Schedule, StageView, backward, forward, steps_due


def _admitted(view: StageView) -> bool:
    """Rule 1: a new forward only while fewer than N - s microbatches are in flight."""
    return view.inflight < view.num_stages - view.stage and view.forwards < view.forward_limit


def _step_or_done(view: StageView) -> Action | None:
    """Rule 3 (step after every `a` backwards) and the end of the call, before any rule."""
    if steps_due(view):
        return Action(STEP)
    if view.backwards >= view.backward_target:
        return Action(DONE)
    return None


def next_action_backward_first(view: StageView) -> Action:
    """The paper's order: any arrived gradient first, then an admitted forward."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    if view.inflight > 0 and view.grad_ready:
        return backward(view)
    if _admitted(view) and view.input_ready:
        return forward(view)
    return Action(WAIT)


def next_action_forward_first(view: StageView) -> Action:
    """An admitted forward whose input has arrived first, then an arrived gradient. Keeps the
    in-flight window as full as admission allows, so a slow stage always has work queued."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    if _admitted(view) and view.input_ready:
        return forward(view)
    if view.inflight > 0 and view.grad_ready:
        return backward(view)
    return Action(WAIT)


def next_action_fixed_order(view: StageView) -> Action:
    """The same rules without looking at arrivals: forward whenever admitted, else backward
    (blocking until the input or gradient arrives). This is 1F1B's order without the flush,
    which is also what the reactive rules produce when stage times are uniform."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    if _admitted(view):
        return forward(view)
    return backward(view)


def drift_bound(stage: int, num_stages: int, accumulation: int) -> int:
    """Most optimizer steps a microbatch can cross on `stage` (0-indexed): ceil((N-1-s)/a)."""
    return -(-(num_stages - 1 - stage) // accumulation)


FIXED_ORDER = Schedule(
    name="paci",
    next_action=next_action_fixed_order,
    depends_on_arrivals=False,
    flushes_every_call=False,
    description="PACI in 1F1B order regardless of arrivals (deterministic)",
)


def _reactive(next_action, description: str) -> Schedule:
    return Schedule(
        name="paci",
        next_action=next_action,
        depends_on_arrivals=True,
        flushes_every_call=False,
        description=description,
        fixed_order=FIXED_ORDER,
    )


# --paci-arrival-rule: what a stage does when both an input and a gradient may be waiting.
# Every rule keeps admission (so 1F1B's memory and the drift bound) and the per-stage step.
ARRIVAL_RULES: dict[str, Schedule] = {
    "forward-first": _reactive(
        next_action_forward_first,
        "Asynchronous 1F1B, no flush, per-stage step after every a local backwards; an admitted "
        "forward before an arrived gradient",
    ),
    "backward-first": _reactive(
        next_action_backward_first,
        "Asynchronous 1F1B, no flush, per-stage step after every a local backwards; an arrived "
        "gradient before a forward (the paper's order)",
    ),
    "fixed": dataclasses.replace(
        FIXED_ORDER,
        description="Asynchronous 1F1B, no flush, per-stage step after every a local backwards; "
        "1F1B's order on counters alone",
        fixed_order=FIXED_ORDER,
    ),
}
DEFAULT_ARRIVAL_RULE = "fixed"
SCHEDULE = ARRIVAL_RULES[DEFAULT_ARRIVAL_RULE]
# The paper's rule under its historical name: the PipeDream and 2BW references run PACI's order
# as the paper defines it.
next_action = next_action_backward_first


def with_arrival_rule(schedule: Schedule, rule: str | None) -> Schedule:
    """`schedule` with PACI's arrival `rule` (None: unchanged); other schedules ignore the rule
    only when it is None or the default, and reject any other."""
    if rule is None:
        return schedule
    if rule not in ARRIVAL_RULES:
        known = ", ".join(ARRIVAL_RULES)
        raise ValueError(f"unknown PACI arrival rule {rule!r} (known: {known})")
    if schedule.name != "paci":
        if rule == DEFAULT_ARRIVAL_RULE:
            return schedule
        raise ValueError(f"--paci-arrival-rule {rule} applies to the paci schedule only")
    return ARRIVAL_RULES[rule]
