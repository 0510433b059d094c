"""PACI over virtual stages: interleaved 1F1B without the flush, each rank stepping on its own.

Setting. N ranks hold v model chunks each, chunk c of rank r being virtual stage c * N + r
(`placement.interleaved`, Megatron's virtual pipeline). Megatron's interleaved 1F1B
(`interleaved_1f1b`) orders a step's m * v forwards of a rank by its table T: microbatches in
groups of g, each group through chunk 0, 1, ..., v - 1; the k-th backward is the k-th entry of
T with the chunk reversed (v - 1 - c). It runs W_r = 2(N - r - 1) + (v - 1) g warm-up forwards,
then one forward one backward, then drains for the step. PACI keeps that order and drops the
flush; with accumulation a (microbatches per step, the `a` of PACI), rank r follows:

1. Order. The rank's forwards follow T of a microbatches, repeated step after step (the j-th
   forward of the run is entry j mod (a v), its microbatch that chunk's next); backwards
   likewise with chunks reversed, each chunk FIFO. So at any moment the rank has exactly two
   candidates: its next forward and its next backward.
2. Admission. The next forward is admitted only while the rank holds fewer than

       K_r = min(W_r + 1, a v)

   microbatch-chunks in flight (forwarded, not yet backwarded): interleaved flush's peak
   (it holds min(W_r + 1, m v) with m = a), so never more activation memory than flush.
   Arrival rule (``forward-first``, the default): the admitted forward if its input has
   arrived, else the backward if its gradient has, else wait for either. ``fixed`` (what
   --deterministic-mode runs, reproducible bit for bit): the admitted forward, else the
   backward, blocking on whichever input that needs.
3. Step. After every a v backwards the rank steps the optimizer of all its chunks. By rule 1
   these are the backward entries of one table: each chunk has taken exactly a gradients,
   those of the same a microbatches, so a step applies the gradient of one batch, as PACI's
   per-stage step does. No flush, no collective beyond the rank's data-parallel group.

Drift bound, per chunk. Let P = a v (backwards per step) and W'_r = K_r - 1. Rule 2 admits the
j-th forward only with b >= j - W'_r backwards done, under either arrival rule (the fixed
order takes it exactly then). Take the microbatch at position i of its
group (size g) in table t, on chunk c: its forward is entry j = t P + G g v + c g + i and its
backward entry k = t P + G g v + (v - 1 - c) g + i (G its group in the table). Its backward
runs with k backwards done, its forward with b >= j - W'_r, so the rank runs at most

    D_{r,c} = k - (j - W'_r) = W'_r + (v - 1 - 2c) g

other backwards in between (a shorter last group only shrinks |(v - 1 - 2c) g|'s share, and a
forward limit before a drain only delays forwards). Steps fall every P backwards, and a window
of D backwards contains at most ceil(D / P) multiples of P, so the microbatch's backward on
chunk c sees weights at most

    drift_bound(r, c) = ceil(max(0, W'_r + (v - 1 - 2c) g) / (a v))

steps newer than its forward saw. The last virtual stage (r = N - 1, c = v - 1, W' = (v - 1) g)
never drifts; with v = 1 the rule is PACI's own order with Megatron's warm-up, bound
ceil(2(N - 1 - r) / a). Early chunks drift most: their gradient waits for the round trip
through every later virtual stage.

Pace (simulated: f = 1, b = 2 per chunk pass, 40 steps; ideal time over makespan; the same
figures for interleaved flush of the same command line). When W_r + 1 <= a v on every rank
(enough accumulation, e.g. N = 4, v = 2, a = 8) the cap does not bind, K_r is interleaved 1F1B's
steady-state window and both rules run without bubble (0.995; flush 0.842). The cap binds on
the first ranks with the fewest microbatches Megatron allows (a = g = N: a v = N v against
W_0 + 1 = N v + N - 1). Then the memory rule costs the fixed order half its pace, a rank
blocking on a forward whose input is a round trip away while its gradient waits (N = 4, v = 2,
a = 4: 0.504; N = 8, v = 2, a = 8: 0.254; N = 4, v = 4, a = 4: 0.505), and costs forward-first
nothing (0.991, 0.989, 0.995; flush 0.727, 0.696, 0.842): it runs the backward instead. Hence
forward-first is the default here, while one-chunk PACI defaults to the fixed order.
`tests/unit_tests/pipeline/test_paci_interleaved.py` checks these claims.
"""

import functools

from .base import DONE, STEP, WAIT, Action, Schedule, StageView, backward, forward
from .interleaved_1f1b import check_microbatches, chunk_order
from .placement import interleaved


def window(
    rank: int,
    num_ranks: int,
    accumulation: int,
    chunks: int,
    group_size: int | None = None,
    extra: int = 0,
) -> int:
    """Rule 2's K_r: the most microbatch-chunks rank `rank` holds in flight (`extra` more: a
    stage beyond the last virtual stage to hide, the vocabulary shards)."""
    group = num_ranks if group_size is None else group_size
    warmup = (num_ranks - rank - 1) * 2 + (chunks - 1) * group
    return min(warmup + 1, accumulation * chunks) + extra


def drift_bound(
    rank: int,
    chunk: int,
    num_ranks: int,
    accumulation: int,
    chunks: int,
    group_size: int | None = None,
    extra: int = 0,
) -> int:
    """The most optimizer steps a microbatch crosses between its forward and its backward on
    chunk `chunk` of rank `rank` (the module docstring derives it)."""
    group = num_ranks if group_size is None else group_size
    ahead = window(rank, num_ranks, accumulation, chunks, group, extra) - 1
    backwards_between = max(0, ahead + (chunks - 1 - 2 * chunk) * group)
    return -(-backwards_between // (accumulation * chunks))


def _step_or_done(view: StageView) -> Action | None:
    """Rule 3 (a step after every a v backwards, counted from where a last changed) and the
    end of the call."""
    per_step = view.microbatches_per_step * view.num_chunks
    steps_since = view.steps - view.steps_at_m
    if view.step_enabled and view.backwards - view.backwards_at_m >= (steps_since + 1) * per_step:
        return Action(STEP)
    if view.backwards >= view.backward_target:
        return Action(DONE)
    return None


def _candidates(
    view: StageView, group_size: int | None, extra: int
) -> tuple[Action | None, Action]:
    """Rule 1's next forward (None when rule 2 does not admit it) and next backward."""
    n, v, a = view.num_stages, view.num_chunks, view.microbatches_per_step
    group = n if group_size is None else group_size
    order, per_step = chunk_order(a, v, group), a * v
    admitted = view.inflight < window(view.stage, n, a, v, group, extra)
    next_forward = None
    if admitted and view.forwards < view.forward_limit:
        next_forward = forward(view, order[(view.forwards - view.backwards_at_m) % per_step])
    chunk = v - 1 - order[(view.backwards - view.backwards_at_m) % per_step]
    return next_forward, backward(view, chunk)


def next_action_fixed_order(
    view: StageView, group_size: int | None = None, extra: int = 0
) -> Action:
    """On counters alone: the admitted forward, else the backward (blocking on its input)."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    next_forward, next_backward = _candidates(view, group_size, extra)
    return next_forward or next_backward


def next_action_forward_first(
    view: StageView, group_size: int | None = None, extra: int = 0
) -> Action:
    """The admitted forward if its input has arrived, else the backward if its gradient has,
    else wait for either: the same two candidates as the fixed order, never blocked on one
    while the other could run."""
    if (ended := _step_or_done(view)) is not None:
        return ended
    next_forward, next_backward = _candidates(view, group_size, extra)
    if next_forward is not None and view.chunks[next_forward.chunk].input_ready:
        return next_forward
    if view.inflight > 0 and view.chunks[next_backward.chunk].grad_ready:
        return next_backward
    return Action(WAIT)


def chunk_lookahead(rank: int, chunk: int, placement, accumulation: int) -> int:
    """How many forwards of one chunk may run beyond its backwards: at most the rank's
    window (what the runtime posts receives for)."""
    return window(rank, placement.num_ranks, accumulation, placement.chunks_per_rank)


ARRIVAL_RULES = {
    "forward-first": next_action_forward_first,
    "fixed": next_action_fixed_order,
}
DEFAULT_ARRIVAL_RULE = "forward-first"


def paci_interleaved(
    group_size: int | None = None, rule: str = DEFAULT_ARRIVAL_RULE, extra: int = 0
) -> Schedule:
    """PACI over virtual stages with microbatch groups of `group_size` (None: N), arrival
    `rule` (``forward-first``, or ``fixed``: the counter-only order, what --deterministic-mode
    runs), and `extra` more microbatch-chunks in flight per rank (one object each)."""
    return _paci_interleaved(group_size, rule, extra)


@functools.cache
def _paci_interleaved(group_size: int | None, rule: str, extra: int) -> Schedule:

    def lookahead(rank, chunk, placement, accumulation):
        chunks = placement.chunks_per_rank
        return window(rank, placement.num_ranks, accumulation, chunks, group_size, extra)

    fixed = None if rule == "fixed" else paci_interleaved(group_size, "fixed", extra)
    decide = ARRIVAL_RULES[rule]
    return Schedule(
        name="paci-interleaved",
        next_action=functools.partial(decide, group_size=group_size, extra=extra),
        depends_on_arrivals=rule != "fixed",
        flushes_every_call=False,
        description="PACI over virtual stages: interleaved 1F1B's order without the flush, at "
        "most interleaved flush's microbatch-chunks in flight, each rank stepping after every "
        f"a backwards of each chunk; {rule}",
        placement=interleaved,
        default_chunks_per_rank=2,
        check_microbatches=functools.partial(check_microbatches, group_size=group_size),
        fixed_order=fixed,
        chunk_lookahead=lookahead,
        stage_after_last=lambda: paci_interleaved(group_size, rule, extra + 1),
    )


SCHEDULE = paci_interleaved(None, DEFAULT_ARRIVAL_RULE)
