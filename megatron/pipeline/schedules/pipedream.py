"""PipeDream (weight stashing): asynchronous 1F1B with an optimizer step after every microbatch.

Each stage runs 1F1B's order without a flush, PipeDream's own schedule, with an accumulation
factor of 1 (`paci.next_action_fixed_order` on a view with one microbatch per step): a forward
whenever admission q < N - s allows, else the oldest backward, and an update after every local
backward. A forward uses the stage's newest weights; its
backward runs on the same version, stashed at the forward (weight stashing), so forward and
backward agree. The gradient is stale instead: between the forward and the backward of a
microbatch stage s takes up to N - 1 - s steps, and that is the delay of the update it makes,
growing with the distance from the last stage. Stage s keeps up to N - s versions: its live
weights and N - s - 1 stashes.

`microbatches_per_step` only sets the length of a call of the runtime here (how many
microbatches an iteration covers); the stage still steps after every one of them, on that one
microbatch's gradient (`microbatches_per_update` is 1: the last stage does not scale the loss).
The order decides on counters alone, so which version each forward sees repeats from run to run
without --deterministic-mode.
"""

import dataclasses

from . import paci
from .base import Action, Schedule, StageView


def _one_microbatch_per_step(view: StageView) -> StageView:
    return dataclasses.replace(view, microbatches_per_step=1)


def next_action(view: StageView) -> Action:
    return paci.next_action_fixed_order(_one_microbatch_per_step(view))


SCHEDULE = Schedule(
    name="pipedream",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=False,
    extra_weight_versions=lambda stage, num_stages: num_stages - stage - 1,
    description="PipeDream: async 1F1B, weight stashing, an update after every microbatch",
    stashes_weights=True,
    microbatches_per_update=lambda microbatches_per_step: 1,
)
