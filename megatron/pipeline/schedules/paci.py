"""PACI: asynchronous 1F1B with no flush and local gradient accumulation.

Each stage i of N (here 0-indexed: s = i - 1) follows three local rules and nothing else:

1. Admission: start a new forward only while its outstanding forwards q < N - s
   (the paper's q_i < N + 1 - i): exactly 1F1B's peak in-flight count, so 1F1B's memory.
2. A backward runs as soon as its output gradient is there (FIFO order).
3. After every `a` local backwards the stage steps its own optimizer. There is no flush and
   no global synchronization: the pipeline never drains between steps.

Drift: a microbatch's backward runs on the stage's *current* weights. Between its forward and
backward, stage s runs at most N - 1 - s other backwards, so it crosses at most
ceil((N - 1 - s) / a) optimizer steps; the last stage never drifts. Accumulation is the knob
that slows weight versions down relative to the pipeline delay.

The decision depends on which of input and gradient has arrived, so stages never idle on a
fixed order when stage times differ. The price is that the order, and so the weight version
each forward sees, depends on timing: two runs can differ in the last bits. With
--deterministic-mode the stage follows the fixed 1F1B order instead (`FIXED_ORDER`); the
drift bound and memory are the same.
"""

from .base import DONE, STEP, WAIT, Action, Schedule, StageView, backward, forward, steps_due


def next_action(view: StageView) -> Action:
    if steps_due(view):
        return Action(STEP)
    if view.backwards >= view.backward_target:
        return Action(DONE)
    if view.inflight > 0 and view.grad_ready:
        return backward(view)
    admitted = view.inflight < view.num_stages - view.stage
    if admitted and view.forwards < view.forward_limit and view.input_ready:
        return forward(view)
    return Action(WAIT)


def next_action_fixed_order(view: StageView) -> Action:
    """The same rules without looking at arrivals: forward whenever admitted, else backward
    (blocking until the input or gradient arrives). This is 1F1B's order without the flush,
    which is also what the reactive rules produce when stage times are uniform."""
    if steps_due(view):
        return Action(STEP)
    if view.backwards >= view.backward_target:
        return Action(DONE)
    admitted = view.inflight < view.num_stages - view.stage
    if admitted and view.forwards < view.forward_limit:
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

SCHEDULE = Schedule(
    name="paci",
    next_action=next_action,
    depends_on_arrivals=True,
    flushes_every_call=False,
    description="Asynchronous 1F1B, no flush, per-stage step after every a local backwards",
    fixed_order=FIXED_ORDER,
)
