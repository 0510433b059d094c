"""ZB-V: zero bubble with 1F1B's memory on a V-shaped placement (Qi et al., "Zero Bubble
Pipeline Parallelism", and "Pipeline Parallelism with Controllable Memory").

The model is cut into 2N chunks; rank r holds virtual stages r (chunk 0, on the way down) and
2N - 1 - r (chunk 1, on the way back up: `placement.v_shape`), so rank 0 runs both the first
and the last chunk and the turn at rank N - 1 needs no transfer. The backward is split into B
(input gradient, which the previous virtual stage waits for) and W (weight gradient, which
nobody waits for). Per step of m microbatches, rank r runs

    warmup:    2(N - r) - 1 forwards of chunk 0
               r times: F1 F0
               N - r times: F1 B1 W1
    steady:    F0 B0 W0 F1 B1 W1 until every forward is done (F0 left out once chunk 0's
               forwards are)
    cooldown:  r times: B0 B1 (their W held back)
               N - r times: B0 W0
               the held-back W of chunk 1, then of chunk 0
    step:      the optimizer step (synchronous: a flush per step)

Every rank holds at most 2N chunk activations (microbatch-chunks forwarded and not yet through
B, nor through W): N whole-stage activations, what 1F1B holds on its first stage, here on every
rank.

The bubble, with F = B = W = t per chunk: rank r starts r * t late (its first input crosses r
ranks), then runs its 6m passes without a gap and ends (N - 1 - r) * t before the last one. A
flushed step thus idles (N - 1) t per rank, half of ZB-H1's 2(N - 1) t at the same model, and
consecutive steps fit into each other's staircase: without a barrier between steps (the paper's
optimizer post-validation; the simulator never synchronizes calls) the steady state has no
bubble at all. With W <= min(F, B) the simulated steady bubble per step is
2(N - 1)(max(F, B) - W). The phases are written for m >= 2N - 1; with fewer microbatches the
passes of the missing ones are left out (the same order, a longer bubble).

Decisions depend on counters only (`order_table`); the runtime runs it with
`--pipeline-schedule zb-v`.
"""

import dataclasses
import functools

from .base import Schedule, StageView
from .order_table import OrderWriter, Table, next_in_table
from .placement import v_shape


@functools.cache
def rank_order(
    rank: int, num_ranks: int, microbatches: int, hide_stage_after: bool = False
) -> Table:
    """Rank `rank`'s passes of one step, in order. With `hide_stage_after` (a stage after the
    last virtual stage: the vocabulary shards) rank 0, which runs the last virtual stage, holds
    each W1 back by one microbatch: the previous W1 runs between F1 and B1, while the shards
    score the microbatch."""
    n, r = num_ranks, rank
    full = max(microbatches, 2 * n - 1)  # what the phases are written for
    held = hide_stage_after and r == 0
    last_chunk = "F1 W1 B1" if held else "F1 B1 W1"
    order = OrderWriter(chunks=2, keep=microbatches)
    order.write("F0", 2 * (n - r) - 1)
    order.write("F1 F0", r)
    order.write(last_chunk, n - r)
    while order.forwards(1) < full:
        order.write("F0 B0 W0" if order.forwards(0) < full else "B0 W0")
        order.write(last_chunk)
    if held:
        order.write("W1")  # the last one held back
    order.write("B0 B1", r)
    order.write("B0 W0", n - r)
    order.write("W1", r)
    order.write("W0", r)
    return order.table()


def check_microbatches(num_ranks: int, chunks: int, microbatches: int) -> None:
    if chunks != 2:
        raise ValueError(f"zb-v runs exactly 2 model chunks per rank (the V), got {chunks}")


def next_action(view: StageView, hide_stage_after: bool = False):
    n, m = view.num_stages, view.microbatches_per_step
    return next_in_table(view, rank_order(view.stage, n, m, hide_stage_after))


SCHEDULE = Schedule(
    name="zb-v",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    description="ZB-V: split backward on a V of 2 chunks per rank, 1F1B's memory, a flush",
    splits_backward=True,
    placement=v_shape,
    default_chunks_per_rank=2,
    check_microbatches=check_microbatches,
)
HIDING = dataclasses.replace(
    SCHEDULE,
    next_action=functools.partial(next_action, hide_stage_after=True),
    description=SCHEDULE.description + "; rank 0's W1 held back one microbatch",
)
SCHEDULE = dataclasses.replace(SCHEDULE, stage_after_last=lambda: HIDING)
