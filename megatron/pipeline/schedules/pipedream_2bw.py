"""PipeDream-2BW: asynchronous 1F1B with double-buffered weights and a constant 1-step delay.

Each stage runs 1F1B's order without a flush, the order the 2BW paper schedules
(`paci.next_action_fixed_order`: a forward whenever admission q < N - s allows, else the oldest
backward; a step after every m local backwards). What differs from PACI is which weights each
pass sees:

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

Which version a pass sees depends on microbatch numbers alone, and the order on counters alone,
so a run reproduces bit for bit without --deterministic-mode. (The order the PACI paper gives
all three, an arrived gradient before an admitted forward, is PACI's `--paci-arrival-rule
backward-first`: it loses pace on uneven stages, docs/arrival_rules.md.)
"""

from . import paci
from .base import Schedule


def forward_weight_version(microbatch: int, microbatches_per_step: int, current: int) -> int:
    """Batch b = microbatch // m forwards on W(b-1): one version behind the batch."""
    return max(0, microbatch // microbatches_per_step - 1)


SCHEDULE = Schedule(
    name="2bw",
    next_action=paci.next_action_fixed_order,
    depends_on_arrivals=False,
    flushes_every_call=False,
    extra_weight_versions=lambda stage, num_stages: 1,
    description="PipeDream-2BW: async 1F1B, double-buffered weights, constant 1-step delay",
    stashes_weights=True,
    forward_weight_version=forward_weight_version,
    min_microbatches_per_step=lambda num_stages: max(1, num_stages - 1),
)
