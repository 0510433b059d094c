"""DualPipeV: DeepSeek's DualPipe cut in half onto a V-shaped placement (DeepSeek-V3 report;
the V variant as in torch.distributed.pipelining's ScheduleDualPipeV).

DualPipe feeds microbatches from both ends of the pipeline at once and keeps two copies of the
weights; folding its two directions onto one V (rank r holds virtual stages r and 2N - 1 - r,
`placement.v_shape`) keeps its order with one copy. Its hallmark is the overlapped pair: a
forward of one chunk and a full backward of the other run together, so one's communication
hides behind the other's compute. Per step of m >= 2N microbatches, rank r runs

    1. 2(N - r - 1) forwards of chunk 0
    2. r + 1 times: F0 F1
    3. N - r - 1 times: B1 W F1 (a backward of chunk 1, its W at once, a forward)
    4. m - 2N + r + 1 times: (F0 & B1) (F1 & B0), the overlapped pairs, backwards full (on
       the last rank the first pair runs apart: F0, then B1)
    5. N - r - 1 times: B1 (F1 & B0)
    6. r + 1 times: B1 B0, full backwards in the first half, then only B, the W held back
       (from the pair's B1 on odd ranks, from its B0 on even ranks)
    7. N - r - 1 times: W B0 (the oldest held-back W, then a B of chunk 0, W held back)
    8. the r + 1 W still held back, oldest first
    then the optimizer step (synchronous: a flush per step).

DeepSeek's figures, with F, B (full backward), W per chunk and F&B the time of an overlapped
pair: a bubble of (N - 1)(F&B + B - 3W) per rank and step, and 2N + 1 chunk activations at most
on every rank (their "PP + 1" with PP = 2N virtual stages).

Here an overlapped pair is one slot (`Action.together`): both passes must have their inputs,
both outputs leave when the slot ends, as in the overlapped execution; a full backward is one
slot too (B with its W, the gradient sent after both). The simulator does not model the
overlap's speed-up: a slot lasts the sum of its passes, so F&B = F + B, and with split costs
f, b, w per chunk (B = b + w) DeepSeek's bubble reads (N - 1)(f + 2b - w): 2(N - 1) t at
f = b = w = t, which the simulation reproduces (with f = b and w <= b). A real overlap makes
each of rank r's 2(m - 2N + r + 1) + N - r - 1 pairs last F&B < F + B: the step shortens by
that many times F + B - F&B, the bubble's first term with it, while the order, the memory and
the dependencies stay as simulated.

Decisions depend on counters only (`order_table`); the runtime runs it with
`--pipeline-schedule dualpipe-v` (the passes of a pair one after the other, sends at once).
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
    """Rank `rank`'s passes of one step, in order (phases numbered as in the docstring). With
    `hide_stage_after` (a stage after the last virtual stage: the vocabulary shards) the
    backwards of phases 3 to 5 hold their W back to the end of their slot group, so a B1 never
    follows its microbatch's F1 at once: the shards score it meanwhile."""
    n, r, m = num_ranks, rank, microbatches
    order = OrderWriter(chunks=2, keep=m)
    order.write("F0", 2 * (n - r - 1))  # 1
    order.write("F0 F1", r + 1)  # 2
    order.write("B1 F1 W" if hide_stage_after else "B1 W F1", n - r - 1)  # 3
    pairs = m - 2 * n + r + 1  # 4
    if r == n - 1:  # the last rank runs its first pair apart, as DeepSeek's: a shorter bubble
        order.write("F0 B1 F1&B0 W W" if hide_stage_after else "F0 BW1 F1&BW0")
        pairs -= 1
    order.write("F0&B1 F1&B0 W W" if hide_stage_after else "F0&BW1 F1&BW0", pairs)
    order.write("B1 F1&B0 W W" if hide_stage_after else "BW1 F1&BW0", n - r - 1)  # 5
    half = (r + 1) // 2  # 6: the pair where the held-back W begin
    for i in range(r + 1):
        if i < half:
            order.write("BW1 BW0")
        elif i == half:
            order.write("B1 B0" if r % 2 else "BW1 B0")
        else:
            order.write("B1 B0")
    order.write("W B0", n - r - 1)  # 7
    order.write("W", r + 1)  # 8
    return order.table()


def check_microbatches(num_ranks: int, chunks: int, microbatches: int) -> None:
    if chunks != 2:
        raise ValueError(f"dualpipe-v runs exactly 2 model chunks per rank (the V), got {chunks}")
    if microbatches < 2 * num_ranks:
        raise ValueError(
            f"dualpipe-v needs at least {2 * num_ranks} microbatches per step (2N) on "
            f"{num_ranks} ranks, got {microbatches}"
        )


def next_action(view: StageView, hide_stage_after: bool = False):
    n, m = view.num_stages, view.microbatches_per_step
    return next_in_table(view, rank_order(view.stage, n, m, hide_stage_after))


SCHEDULE = Schedule(
    name="dualpipe-v",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    description="DualPipeV: DualPipe's overlapped F&B pairs folded onto a V of 2 chunks per rank",
    splits_backward=True,
    placement=v_shape,
    default_chunks_per_rank=2,
    check_microbatches=check_microbatches,
    min_microbatches_per_step=lambda num_ranks: 2 * num_ranks,
)
HIDING = dataclasses.replace(
    SCHEDULE,
    next_action=functools.partial(next_action, hide_stage_after=True),
    description=SCHEDULE.description + "; W held back within phases 3 to 5",
)
SCHEDULE = dataclasses.replace(SCHEDULE, stage_after_last=lambda: HIDING)
