"""1F1B with a flush: Megatron's synchronous pipeline schedule (PipeDream-Flush).

Per step of m microbatches, stage s of N runs

    warmup:    min(N - s - 1, m) forwards
    steady:    one forward, one backward, ... until all m forwards are done
    cooldown:  the remaining backwards
    step:      the optimizer step, once every microbatch of the step is back

Every backward of the step sees the weights its forward saw, so the result equals a
non-pipelined run with gradient accumulation over m microbatches. The price is the bubble:
a fraction (N - 1) / (m + N - 1) of each step is idle.

The order depends only on counters, never on arrival times: a stage blocks on the input or
gradient it needs next.
"""

from .base import DONE, STEP, Action, Schedule, StageView, backward, forward


def next_action(view: StageView) -> Action:
    m = view.microbatches_per_step
    step_start = view.backward_target - m  # the pipeline was empty when this step began
    forwards, backwards = view.forwards - step_start, view.backwards - step_start
    if backwards == m:
        steps_for_m = (view.backward_target - view.backwards_at_m) // m
        due = view.step_enabled and view.steps - view.steps_at_m < steps_for_m
        return Action(STEP) if due else Action(DONE)
    warmup = min(view.num_stages - view.stage - 1, m)
    if forwards < warmup or (forwards < m and forwards - backwards <= warmup):
        return forward(view)
    return backward(view)


SCHEDULE = Schedule(
    name="1f1b",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    max_inflight=lambda stage, num_stages, m: min(num_stages - stage, m),
    description="Megatron's synchronous 1F1B with a pipeline flush before every optimizer step",
)
