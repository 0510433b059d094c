"""ZB-H1: zero-bubble pipeline schedule with 1F1B's memory (Qi et al., "Zero Bubble Pipeline
Parallelism", handcrafted schedule H1).

The backward is split in two: B computes the input gradient, which the previous stage waits
for, and W the weight gradient, which nobody waits for. Stage s of N follows 1F1B and only
moves the W passes:

    warmup:    min(N - s - 1, m) forwards, as in 1F1B
    steady:    one forward, one B, ... as in 1F1B; stage s holds back up to s W passes, and runs
               the oldest one after a B once s are held back (the last stage defers the most:
               every stage then has N microbatches whose W is not done)
    cooldown:  the remaining B passes, each followed by a W, then the W passes held back
    step:      the optimizer step once the m-th W is done (synchronous: a flush per step)

B reaches the previous stage earlier than 1F1B's full backward would, and the held-back W
passes fill the tail of the step. With costs F, B, W per pass, every stage idles
(N - 1)(F + B - W) per step instead of 1F1B's (N - 1)(F + B + W). The order depends only on
counters; the runtime runs it with `--pipeline-schedule zb-h1`.
"""

from .base import DONE, STEP, Action, Schedule, StageView, backward, forward, weight_grad


def next_action(view: StageView) -> Action:
    m = view.microbatches_per_step
    step_start = view.backward_target - m  # the pipeline was empty when this step began
    forwards = view.forwards - step_start
    backwards = view.backwards - step_start
    weight_grads = view.weight_grads - step_start
    if weight_grads == m:
        due = view.step_enabled and view.steps < view.backward_target // m
        return Action(STEP) if due else Action(DONE)
    held_back = backwards - weight_grads
    if held_back > view.stage or backwards == m:
        return weight_grad(view)
    warmup = min(view.num_stages - view.stage - 1, m)
    if forwards < min(warmup + backwards + 1, m):  # 1F1B: forwards - backwards <= warmup
        return forward(view)
    return backward(view)


SCHEDULE = Schedule(
    name="zb-h1",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    max_inflight=lambda stage, num_stages, m: min(num_stages - stage, m),
    description="Zero-bubble H1: 1F1B with the weight-gradient pass split off and delayed",
    splits_backward=True,
)
