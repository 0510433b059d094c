"""Interleaved zero bubble: interleaved 1F1B with the backward split (Qi et al., "Zero Bubble
Pipeline Parallelism", its ZB-1P schedule on virtual stages; the order of torch.distributed.
pipelining's ScheduleInterleavedZeroBubble).

Each of the N ranks holds v model chunks (default 2), rank r chunk c being virtual stage
c * N + r (`placement.interleaved`, Megatron's virtual pipeline). The backward is split into B
(input gradient, which the previous virtual stage waits for) and W (weight gradient, which
nobody waits for). Microbatches go in rounds: max(1, m // N) of them, g = m / rounds
microbatches each (m must divide evenly), and the step's k-th forward on a rank is of chunk
(k // g) mod v, its k-th B of chunk v - 1 - ((k // g) mod v): a round of g microbatches runs
through chunk 0, then chunk 1, ..., and its gradients come back through the chunks in reverse,
as in interleaved 1F1B. Per step of m microbatches, rank r runs

    warmup:    w = min((v - 1) g + N - 1 - r, m v) forwards
    steady:    F B, then the oldest W once r B have gone before it, until all m v forwards are
               done
    cooldown:  the remaining B, each followed by the oldest W under the same rule
    drain:     the W still held back (r of them), oldest first
    step:      the optimizer step (synchronous: a flush per step)

So rank r holds back r weight gradients, as ZB-H1 does on stage r, and the warmup is
interleaved 1F1B's with one forward per hop instead of two: B reaches the previous virtual
stage after one pass, not after a full backward.

The bubble, with F = B = W = t per chunk and m a multiple of N: rank r starts r t late (its
first input crosses r ranks) and every B it waits for comes back in time, so a flushed step
idles (N - 1) t per rank, ZB-V's figure for m >= 2N - 1. With fewer microbatches ZB-V's phases
lose their fill and this order is the shorter one (simulated: every m < 3N / 2, a tie from there
to 2N - 2; docs/zero_bubble.md). All ranks end the step together, so unlike ZB-V's staircase
consecutive steps do not overlap.

Memory: rank r holds at most w + 1 + r microbatch-chunks (forwarded and not yet through W):
(v - 1) g + N, the same on every rank. With v = 2 and m a multiple of N (g = N) that is 2N
chunks, N whole-stage activations: ZB-V's and 1F1B's first stage; with g > N (m = 12 on 8 ranks)
more, g - N chunks beyond ZB-V.

Decisions depend on counters only (`order_table`); the runtime runs it with
`--pipeline-schedule zb-interleaved` and the virtual-pipeline flags (default 2 chunks).
"""

import functools

from .base import Schedule, StageView
from .order_table import OrderWriter, Table, next_in_table
from .placement import interleaved


def round_size(num_ranks: int, microbatches: int) -> int:
    """g: microbatches per round, max(1, m // N) rounds of equal size."""
    return microbatches // max(1, microbatches // num_ranks)


def warmup_forwards(rank: int, num_ranks: int, microbatches: int, chunks: int) -> int:
    """Forwards rank `rank` runs before its first B."""
    warmup = (chunks - 1) * round_size(num_ranks, microbatches) + num_ranks - 1 - rank
    return min(warmup, microbatches * chunks)


@functools.cache
def rank_order(rank: int, num_ranks: int, microbatches: int, chunks: int) -> Table:
    """Rank `rank`'s passes of one step, in order."""
    group = round_size(num_ranks, microbatches)
    total = microbatches * chunks
    warmup = warmup_forwards(rank, num_ranks, microbatches, chunks)
    order = OrderWriter(chunks=chunks, keep=microbatches)
    for k in range(warmup):
        order.write(f"F{(k // group) % chunks}")
    for k in range(total):  # the k-th B, after the (warmup + k)-th forward while any is left
        if warmup + k < total:
            order.write(f"F{((warmup + k) // group) % chunks}")
        order.write(f"B{chunks - 1 - (k // group) % chunks}")
        if k >= rank:  # r weight gradients held back
            order.write("W")
    order.write("W", rank)
    return order.table()


def check_microbatches(num_ranks: int, chunks: int, microbatches: int) -> None:
    """The rounds must be of equal size, m a multiple of max(1, m // N), as torch requires."""
    if chunks < 2:
        raise ValueError(f"zb-interleaved needs at least 2 model chunks per rank, got {chunks}")
    rounds = max(1, microbatches // num_ranks)
    if microbatches % rounds:
        raise ValueError(
            f"zb-interleaved on {num_ranks} ranks needs the microbatches per step to split into "
            f"max(1, m // N) = {rounds} equal rounds, got m = {microbatches}"
        )


def next_action(view: StageView):
    n, m = view.num_stages, view.microbatches_per_step
    return next_in_table(view, rank_order(view.stage, n, m, view.num_chunks))


SCHEDULE = Schedule(
    name="zb-interleaved",
    next_action=next_action,
    depends_on_arrivals=False,
    flushes_every_call=True,
    description="Interleaved zero bubble: interleaved 1F1B's placement, split backward, a flush",
    splits_backward=True,
    placement=interleaved,
    default_chunks_per_rank=2,
    check_microbatches=check_microbatches,
)
