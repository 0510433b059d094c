"""PipeDream-2BW: asynchronous 1F1B with double-buffered weights and a constant 1-step delay.

Each stage runs PACI's order (`paci.next_action`: admission q < N - s, a backward as soon as its
gradient is there, a step after every m local backwards, no flush). What differs is which
weights each pass sees:

* the m microbatches of batch b (microbatch numbers b*m .. b*m + m - 1) all run their forward,
  on every stage, on weight version W(b-1) (version 0 for b = 0): the version made from the
  gradients of batch b - 2. W(b), although it may already exist on later stages, is first used
  by batch b + 1;
* each backward runs on the version its forward used (weight stashing);
* the step after batch b's m backwards applies batch b's gradient, computed at W(b-1), to W(b):

      W(b+1) = W(b) - lr * grad f(W(b-1)),

  one step of delay on every stage, whatever its depth (batch 0: no delay).

A stage then needs at most two versions, the live one and one stash (double buffering), as long
as a batch covers the in-flight window: m >= N - 1.

Which version a pass sees depends on microbatch numbers alone, never on arrival order, so the
numbers of a run do not depend on timing; --deterministic-mode also fixes the order
(`FIXED_ORDER`, PACI's).
"""

import dataclasses

from . import paci
from .base import Schedule


def forward_weight_version(microbatch: int, microbatches_per_step: int, current: int) -> int:
    """Batch b = microbatch // m forwards on W(b-1): one version behind the batch."""
    return max(0, microbatch // microbatches_per_step - 1)


SCHEDULE = Schedule(
    name="2bw",
    next_action=paci.next_action,
    depends_on_arrivals=True,
    flushes_every_call=False,
    extra_weight_versions=lambda stage, num_stages: 1,
    description="PipeDream-2BW: async 1F1B, double-buffered weights, constant 1-step delay",
    stashes_weights=True,
    forward_weight_version=forward_weight_version,
    min_microbatches_per_step=lambda num_stages: max(1, num_stages - 1),
)
FIXED_ORDER = dataclasses.replace(
    SCHEDULE,
    next_action=paci.next_action_fixed_order,
    depends_on_arrivals=False,
    description="PipeDream-2BW in 1F1B order regardless of arrivals (deterministic)",
)
SCHEDULE = dataclasses.replace(SCHEDULE, fixed_order=FIXED_ORDER)
