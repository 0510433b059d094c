"""The learning-rate schedule counts iterations, also for schedules that step more often.

PipeDream steps each stage after every microbatch, m times per iteration. Megatron's LR flags
(--lr-warmup-iters, --lr-decay-iters, ...) count iterations, so the schedule advances once per
m steps: every step of an iteration uses that iteration's learning rate, as the single step of
an iteration does under every other schedule.
"""


class SchedulerPerIteration:
    """Wraps an `OptimizerParamScheduler`: `step` advances it every `updates_per_iteration`-th
    call; everything else is the wrapped scheduler's."""

    def __init__(self, scheduler, updates_per_iteration: int):
        object.__setattr__(self, "_scheduler", scheduler)
        object.__setattr__(self, "_updates_per_iteration", updates_per_iteration)
        object.__setattr__(self, "_calls", 0)

    def step(self, increment: int = 1) -> None:
        calls = self._calls + 1
        object.__setattr__(self, "_calls", calls % self._updates_per_iteration)
        if calls == self._updates_per_iteration:
            self._scheduler.step(increment=increment)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def __setattr__(self, name, value):
        setattr(self._scheduler, name, value)


def per_iteration(scheduler, plan, microbatches: int):
    """`scheduler`, advanced once per iteration under the run's `PipelinePlan` with
    `microbatches` per iteration (unchanged when the schedule steps once per iteration)."""
    updates = microbatches // plan.microbatches_per_update(microbatches)
    return scheduler if updates == 1 else SchedulerPerIteration(scheduler, updates)
