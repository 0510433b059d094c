"""PACI: asynchronous 1F1B with no flush and local gradient accumulation.

Each stage i of N (here 0-indexed: s = i - 1) follows three local rules and nothing else:

1. Admission: start a new forward only while its outstanding forwards q < N - s
   (the paper's q_i < N + 1 - i): exactly 1F1B's peak in-flight count, so 1F1B's memory.
   With fewer microbatches per step than stages (m < N - s) 1F1B-flush holds only m; the
   ``flush`` in-flight limit (`INFLIGHT_LIMITS`, `--paci-inflight-limit`) caps the window at
   min(N - s, a) to keep flush's memory then too, at the price of a partly empty pipeline.
2. Backwards run in forward (FIFO) order, each once its output gradient is there.
3. After every `a` local backwards the stage steps its own optimizer. There is no flush and
   no global synchronization: the pipeline never drains between steps.

Drift: a microbatch's backward runs on the stage's *current* weights. Between its forward and
backward, stage s runs at most window - 1 other backwards (N - 1 - s by depth), so it crosses
at most ceil((window - 1) / a) optimizer steps (`drift_bound`); the last stage never drifts.
Accumulation is the knob that slows weight versions down relative to the pipeline delay.

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
import functools

from .base import DONE, STEP, WAIT, Action, Schedule, StageView, backward, forward, steps_due

# --paci-inflight-limit: the most microbatches stage s holds in flight.
INFLIGHT_LIMITS = {
    "depth": "N - s, the pipeline's depth below the stage (the paper's rule)",
    "flush": "min(N - s, a): never more than 1F1B-flush holds with a microbatches per step",
}
DEFAULT_INFLIGHT_LIMIT = "depth"


def window(stage: int, num_stages: int, accumulation: int, limit: str = "depth") -> int:
    """Rule 1's in-flight window of `stage` (0-indexed) under the in-flight `limit`."""
    depth = num_stages - stage
    return depth if limit == "depth" else min(depth, accumulation)


def _admitted(view: StageView, limit: str) -> bool:
    """Rule 1: a new forward only while fewer than the window's microbatches are in flight."""
    size = window(view.stage, view.num_stages, view.microbatches_per_step, limit)
    return view.inflight < size and view.forwards < view.forward_limit


def _step_or_done(view: StageView) -> Action | None:
    """Rule 3 (step after every `a` backwards) and the end of the call, before any rule."""
    if steps_due(view):
        return Action(STEP)
    if view.backwards >= view.backward_target:
        return Action(DONE)
    return None


def next_action_backward_first(view: StageView, limit: str = DEFAULT_INFLIGHT_LIMIT) -> Action:
    """The paper's order: any arrived gradient first, then an admitted forward."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    if view.inflight > 0 and view.grad_ready:
        return backward(view)
    if _admitted(view, limit) and view.input_ready:
        return forward(view)
    return Action(WAIT)


def next_action_forward_first(view: StageView, limit: str = DEFAULT_INFLIGHT_LIMIT) -> Action:
    """An admitted forward whose input has arrived first, then an arrived gradient. Keeps the
    in-flight window as full as admission allows, so a slow stage always has work queued."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    if _admitted(view, limit) and view.input_ready:
        return forward(view)
    if view.inflight > 0 and view.grad_ready:
        return backward(view)
    return Action(WAIT)


def _next_step_started(view: StageView) -> bool:
    """Whether the stage's next forward may start: every backward of the steps before that
    forward's step is done (steps counted in groups of a from where a last changed)."""
    a, start = view.microbatches_per_step, view.backwards_at_m
    return view.backwards >= start + (view.forwards - start) // a * a


def next_action_fixed_order(view: StageView, limit: str = DEFAULT_INFLIGHT_LIMIT) -> Action:
    """The same rules without looking at arrivals: forward whenever admitted, else backward
    (blocking until the input or gradient arrives). This is 1F1B's order without the flush,
    which is also what the reactive rules produce when stage times are uniform.

    Under the ``flush`` limit with a < N only a microbatches circulate, so a stage after the
    first would block on a forward whose input is a whole round trip away while gradients
    queue behind it (slower than flush). There, stages after the first keep 1F1B-flush's order
    within each step (the next step's forwards after this step's backwards), and the first
    stage starts the next step's forwards as its window frees: the overlap of steps that
    makes the pipeline faster than flush's."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    capped = limit != "depth" and view.microbatches_per_step < view.num_stages
    if _admitted(view, limit) and (not capped or view.is_first or _next_step_started(view)):
        return forward(view)
    return backward(view)


def drift_bound(
    stage: int, num_stages: int, accumulation: int, limit: str = DEFAULT_INFLIGHT_LIMIT
) -> int:
    """Most optimizer steps a microbatch can cross on `stage` (0-indexed): the other backwards
    its window holds, over a: ceil((window - 1) / a), which is ceil((N-1-s)/a) by depth."""
    return -(-(window(stage, num_stages, accumulation, limit) - 1) // accumulation)


def deferred_step_drift_bound(
    stage: int, num_stages: int, accumulation: int, limit: str = DEFAULT_INFLIGHT_LIMIT
) -> int:
    """`drift_bound` with --paci-deferred-step D, where the update of step k is applied just
    before the stage's D-th backward after the step (1 <= D <= a) instead of just after its
    last backward of step k. Updates still land once every a backwards, but right before a
    backward, which may be the microbatch's own: between a forward and its backward there are
    the window's other W - 1 backwards and its own, so at most ceil(W / a) updates,
    ceil((N - s) / a) by depth, whatever D. The last stage (W = 1) now crosses one; with
    a >= N every stage crosses at most one, as plain PACI's first stage does. (D sets how
    stale the applied gradients are: the passes before the landing run on the older weights,
    up to a whole step's with D = a.)"""
    return -(-window(stage, num_stages, accumulation, limit) // accumulation)


# --paci-arrival-rule: what a stage does when both an input and a gradient may be waiting.
# Every rule keeps admission (so the memory and the drift bound) and the per-stage step.
_RULES = {
    "forward-first": (next_action_forward_first, "an admitted forward before an arrived gradient"),
    "backward-first": (
        next_action_backward_first,
        "an arrived gradient before a forward (the paper's order)",
    ),
    "fixed": (next_action_fixed_order, "1F1B's order on counters alone"),
}
DEFAULT_ARRIVAL_RULE = "fixed"


@functools.cache
def _fixed_order(limit: str) -> Schedule:
    """The rules with arrivals ignored: what --deterministic-mode runs whatever the rule."""
    return Schedule(
        name="paci",
        next_action=functools.partial(next_action_fixed_order, limit=limit),
        depends_on_arrivals=False,
        flushes_every_call=False,
        description="PACI in 1F1B order regardless of arrivals (deterministic)",
    )


def paci_schedule(
    rule: str = DEFAULT_ARRIVAL_RULE, limit: str = DEFAULT_INFLIGHT_LIMIT
) -> Schedule:
    """PACI with arrival `rule` and in-flight `limit` (one object per pair)."""
    return _paci_schedule(rule, limit)


@functools.cache
def _paci_schedule(rule: str, limit: str) -> Schedule:
    if rule not in _RULES:
        raise ValueError(f"unknown PACI arrival rule {rule!r} (known: {', '.join(_RULES)})")
    if limit not in INFLIGHT_LIMITS:
        known = ", ".join(INFLIGHT_LIMITS)
        raise ValueError(f"unknown PACI in-flight limit {limit!r} (known: {known})")
    decide, first = _RULES[rule]
    capped = "" if limit == "depth" else "; at most min(N - s, a) microbatches in flight"
    return Schedule(
        name="paci",
        next_action=functools.partial(decide, limit=limit),
        depends_on_arrivals=rule != "fixed",
        flushes_every_call=False,
        description="Asynchronous 1F1B, no flush, per-stage step after every a local backwards; "
        f"{first}{capped}",
        fixed_order=_fixed_order(limit),
        inflight_window=functools.partial(_window_under, limit),
        drift_bound=functools.partial(_drift_bound_under, limit),
    )


def _window_under(limit: str, stage: int, num_stages: int, accumulation: int) -> int:
    return window(stage, num_stages, accumulation, limit)


def _drift_bound_under(limit: str, stage: int, num_stages: int, accumulation: int) -> int:
    return drift_bound(stage, num_stages, accumulation, limit)


ARRIVAL_RULES: dict[str, Schedule] = {rule: paci_schedule(rule) for rule in _RULES}
FIXED_ORDER = _fixed_order(DEFAULT_INFLIGHT_LIMIT)
SCHEDULE = paci_schedule()
# The paper's rule under its historical name.
next_action = next_action_backward_first


def with_weight_stashing(schedule: Schedule) -> Schedule:
    """PACI whose backwards run on the weights their forwards used (`--paci-weight-stashing`, a
    study variant). The order and the gradients' staleness are PACI's; only the mismatch between
    a microbatch's forward and backward weights is gone, at the price of up to
    ceil((N - 1 - s) / a) stashed weight versions on stage s (N - 1 - s when a = 1)."""

    def stashed(variant: Schedule) -> Schedule:
        return dataclasses.replace(
            variant,
            stashes_weights=True,
            extra_weight_versions=lambda stage, num_stages: num_stages - 1 - stage,
            description=variant.description + "; backwards on their forwards' stashed weights",
        )

    fixed = schedule.fixed_order
    return dataclasses.replace(stashed(schedule), fixed_order=fixed and stashed(fixed))


def with_paci_options(
    schedule: Schedule, rule: str | None = None, inflight_limit: str | None = None
) -> Schedule:
    """`schedule` with PACI's arrival `rule` and `inflight_limit` (None: the default). Other
    schedules accept only None or the defaults."""
    if schedule.name != "paci":
        for flag, value, default in (
            ("--paci-arrival-rule", rule, DEFAULT_ARRIVAL_RULE),
            ("--paci-inflight-limit", inflight_limit, DEFAULT_INFLIGHT_LIMIT),
        ):
            if value not in (None, default):
                raise ValueError(f"{flag} {value} applies to the paci schedule only")
        return schedule
    if rule is None and inflight_limit is None:
        return schedule
    return paci_schedule(rule or DEFAULT_ARRIVAL_RULE, inflight_limit or DEFAULT_INFLIGHT_LIMIT)
