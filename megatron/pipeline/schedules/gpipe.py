"""GPipe: all forwards of the step, then all backwards, then a flush and the optimizer step.

Per step of m microbatches, every stage

    forward:   runs the m forwards, as their inputs arrive
    backward:  runs the m backwards, as their gradients arrive
    step:      steps the optimizer once the last backward is done

Synchronous like 1F1B-flush, with the same bubble (N - 1) / (m + N - 1), but each stage holds
the activations of all m microbatches at once (1F1B holds N - s). A reference for the
simulator; the runtime does not run it. Backwards run in FIFO order here (the paper runs them
last-in first-out, which takes the same time when stage costs are uniform across microbatches).
"""

from .base import DONE, STEP, Action, Schedule, StageView, backward, forward


def next_action(view: StageView) -> Action:
    m = view.microbatches_per_step
    step_start = view.backward_target - m  # the pipeline was empty when this step began
    if view.backwards - step_start == m:
        due = view.step_enabled and view.steps < view.backward_target // m
        return Action(STEP) if due else Action(DONE)
    if view.forwards - step_start < m:
        return forward(view)
    return backward(view)


SCHEDULE = Schedule(
    name="gpipe",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    description="GPipe: all forwards, then all backwards, then a flush and the optimizer step",
)
