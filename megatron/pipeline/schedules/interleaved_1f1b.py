"""Interleaved 1F1B: Megatron's 1F1B with a flush over virtual stages (Narayanan et al., SC21).

Each of the N ranks holds v model chunks, rank r chunk c being virtual stage c * N + r
(`placement.interleaved`), so a microbatch crosses the ranks v times. A rank orders the m * v
forwards of a step by a table: microbatches go in groups of g (``microbatch_group_size_per_vp_
stage``, default N), and a group runs through chunk 0, then chunk 1, ..., before the next group
starts (the last group takes what is left over):

    g = 2, m = 4, v = 2:   microbatch  0 1 0 1 2 3 2 3
                           chunk       0 0 1 1 0 0 1 1

The k-th backward is the table's k-th entry with the chunk order reversed (chunk v - 1 - c):
gradients enter at the last virtual stage. Per step, rank r runs

    warmup:    min((N - r - 1) * 2 + (v - 1) * g, m * v) forwards
    steady:    one forward, one backward, ... until all m * v forwards are done
    cooldown:  the remaining backwards
    step:      the optimizer step, once every chunk of every microbatch is back

With uniform costs, per chunk f and b, every rank idles (N - 1)(f + b) per step against
m * v * (f + b) of work: the bubble of 1F1B, (N - 1)(F + B), over v at the same model. The price
is memory, warmup + 1 chunk activations at most on rank r (rank 0: (2N - 1 + (v - 1) g) / v
whole-stage activations against 1F1B's N), and v times the transfers.

Megatron's rule on m: g must lie in [N, m], and the last group must not be shorter than N
(m % g is 0 or at least N), or a rank waits on a dependency inside a group; with the default
g = N that is m % N == 0. `check_microbatches` rejects other m with one ValueError.

Decisions depend on counters only, so the runtime (`megatron.pipeline.runtime`) runs
the very same function as the simulator: what --pipeline-schedule 1f1b becomes with Megatron's
virtual-pipeline flags.
"""

import functools

from .base import DONE, STEP, Action, Schedule, StageView, backward, forward
from .placement import interleaved


@functools.cache
def chunk_order(microbatches: int, chunks: int, group_size: int) -> tuple[int, ...]:
    """The chunk of each of a step's forwards, in order: the schedule table's chunk row."""
    order = []
    for first in range(0, microbatches, group_size):
        size = min(group_size, microbatches - first)  # the last group may be shorter
        for chunk in range(chunks):
            order.extend([chunk] * size)
    return tuple(order)


def warmup_forwards(
    rank: int, num_ranks: int, microbatches: int, chunks: int, group_size: int, extra: int = 0
) -> int:
    """Forwards rank `rank` runs before its first backward (`extra` more: a stage beyond the
    last virtual stage to hide, the vocabulary shards)."""
    warmup = (num_ranks - rank - 1) * 2 + (chunks - 1) * group_size + extra
    return min(warmup, microbatches * chunks)


def check_microbatches(
    num_ranks: int, chunks: int, microbatches: int, group_size: int | None = None
) -> None:
    """Megatron's conditions for interleaving, as one ValueError."""
    group = num_ranks if group_size is None else group_size
    if chunks < 2:
        raise ValueError(f"interleaved-1f1b needs at least 2 model chunks per rank, got {chunks}")
    rest = microbatches % group
    if num_ranks <= group <= microbatches and not 0 < rest < num_ranks:
        return
    rule = f"microbatch groups of g = {group} per model chunk: N <= g <= m, m % g 0 or >= N"
    if group_size is None:  # Megatron's default g = N: the older rule m % N == 0
        raise ValueError(
            f"interleaved-1f1b on {num_ranks} ranks needs a multiple of {num_ranks} "
            f"microbatches per step, got {microbatches} ({rule})"
        )
    raise ValueError(f"interleaved-1f1b on {num_ranks} ranks with {rule}; got m = {microbatches}")


def next_action(view: StageView, group_size: int | None = None, extra: int = 0) -> Action:
    n, v, m = view.num_stages, view.num_chunks, view.microbatches_per_step
    group = n if group_size is None else group_size
    total = m * v
    step_start = view.backward_target - total  # totals over chunks; empty pipeline here
    forwards, backwards = view.forwards - step_start, view.backwards - step_start
    if backwards == total:
        due = view.step_enabled and view.steps < view.backward_target // total
        return Action(STEP) if due else Action(DONE)
    order = chunk_order(m, v, group)
    warmup = warmup_forwards(view.stage, n, m, v, group, extra)
    if forwards < total and forwards < warmup + backwards + 1:  # 1F1B: one more in flight
        return forward(view, order[forwards])
    return backward(view, v - 1 - order[backwards])


def interleaved_1f1b(group_size: int | None = None, extra: int = 0) -> Schedule:
    """The schedule with microbatch groups of `group_size` (None: N, Megatron's default), and
    `extra` more warm-up forwards per rank (one object each)."""
    return _interleaved_1f1b(group_size, extra)


@functools.cache
def _interleaved_1f1b(group_size: int | None, extra: int) -> Schedule:
    return Schedule(
        name="interleaved-1f1b",
        next_action=functools.partial(next_action, group_size=group_size, extra=extra),
        depends_on_arrivals=False,
        flushes_every_call=True,
        description="Megatron's interleaved 1F1B: v model chunks per rank, a flush per step",
        placement=interleaved,
        default_chunks_per_rank=2,
        check_microbatches=functools.partial(check_microbatches, group_size=group_size),
        stage_after_last=lambda: interleaved_1f1b(group_size, extra + 1),
    )


SCHEDULE = interleaved_1f1b(None)
