"""The vocabulary layers split over the pipeline ranks, their passes placed in any schedule.

Vocabulary Parallelism (Yeung et al., 2025) shows the output layer need not sit on the last
stage: each of the N ranks holds 1/N of its rows and runs its share of every microbatch's loss
as passes of its own schedule. Here a microbatch's loss takes one round trip and two passes
per rank (`megatron.pipeline.vocab_parallel` has the arithmetic):

    the last stage's forward   sends its output hidden state to every rank          HIDDEN
    VF on every rank           the shard's logits: their max, sum of exponentials and
                               the target's logit, and the shard's part of the hidden
                               state's gradient; sent to the last stage             SHARD_OUTPUT
    the last stage's backward  combines the shards into the loss and the hidden state's
                               gradient, runs its own backward, and sends the
                               softmax statistics to every rank                     LOGIT_STATS
    VB on every rank           the shard's weight gradient from those statistics

No collective: every message is point to point, and no rank waits for another rank's step,
so the same passes fit a synchronous schedule and PACI without a flush.

`with_vocab_passes` wraps a schedule with four rules, the same for every schedule:

1. The shards are one more stage after the last: the schedule decides as on N + 1 stages, so
   every stage admits one more microbatch (the round trip to the shards is hidden as one
   more stage's would be, and 1F1B's memory grows by one microbatch per stage). A schedule
   with virtual stages is defined on its own ranks: it hides the round trip in its own terms
   (`Schedule.stage_after_last`: one more microbatch-chunk in flight, or weight gradients
   held back between the last virtual stage's forward and backward).
2. A VF whose hidden state has arrived runs first: the last stage's backward waits for it.
3. Then the schedule's own action, once its input is there. Until then a VB whose statistics
   have arrived runs (once the rank has backwarded its microbatch), else the rank waits for
   the next arrival: it never blocks on the schedule's input while it owes a VF, which the
   last stage may be waiting for.
4. A step takes the VB of every microbatch the stage has backwarded, so a shard's gradient
   is in the same update as the stage's; a call that drains the stage ends with every VF and
   VB done.

Shard drift: a rank's VF(i) follows its forward of i and its VB(i) precedes the step after
its backward of i, so a shard's weight version moves between the two by no more steps than
the stage's own weights between forward and backward (`drift_bound`, on N + 1 stages).

The input embedding split the same way (`with_vocab_passes(schedule, split_input=True)`):
each rank holds the same rows of the embedding as of the output layer (with tied embeddings
they are one weight) and runs two more passes per microbatch:

    EF on every rank           the microbatch's tokens looked up in the rank's rows (zero
                               for a token outside them), sent to the first stage       EMBEDDING
    the first stage's forward  sums every rank's part into its input
    the first stage's backward sends the input's gradient to every rank       EMBEDDING_GRADIENT
    EB on every rank           the rows' gradient from it

5. An EF runs first while it is owed: EF(i) is due once i is within the first stage's
   in-flight window W0 of the rank's own backwards (`embedding_lookahead`), so the first
   stage never waits for it (it cannot forward i before the rank backwarded i - W0).
6. An EB runs when its gradient has arrived and the rank would otherwise wait, or before a
   step; a step waits for the EBs still owed only where the stage is drained (a flush, or
   an asynchronous drain): an asynchronous rank never waits for the first stage's backward,
   so an embedding gradient may land steps later than the stage's own: at most
   ceil(2 W0 / a) steps after its lookup (the runtime measures it, `embed_drift_histogram`).

With several model chunks per rank (virtual stages) the rules count microbatches: one is
through the rank once its last chunk forwarded it, backwarded once its first chunk did.
"""

import dataclasses
import functools

from .base import (
    BACKWARD,
    DONE,
    EMBED_BACKWARD,
    EMBED_FORWARD,
    FORWARD,
    STEP,
    VOCAB_BACKWARD,
    VOCAB_FORWARD,
    WAIT,
    Action,
    Schedule,
    StageView,
)


# With several model chunks per rank (virtual stages) the view's counters are totals over the
# chunks; the vocabulary passes count microbatches: the rank's last chunk forwards a microbatch
# last (then the last stage can score it), its first chunk backwards it last.
def _forwarded(view: StageView) -> int:
    """Microbatches through the rank's last chunk (or its only one)."""
    return view.chunks[-1].forwards if view.chunks else view.forwards


def _backwarded(view: StageView) -> int:
    """Microbatches whose backward the rank has finished (its first chunk's)."""
    return view.chunks[0].backwards if view.chunks else view.backwards


def _per_microbatch(view: StageView, total: int) -> int:
    """A limit or target over the chunks, as microbatches."""
    return total // view.num_chunks if view.chunks else total


def _input_ready(view: StageView, action: Action) -> bool:
    """Whether the schedule's action can run without blocking (its first pass's input)."""
    if action.kind not in (FORWARD, BACKWARD):
        return True
    if view.chunks:
        chunk = view.chunks[action.chunk]
        return chunk.input_ready if action.kind is FORWARD else chunk.grad_ready
    return view.input_ready if action.kind is FORWARD else view.grad_ready


def _owes_vocab_pass(view: StageView) -> bool:
    """The rank forwarded a microbatch its shard has not scored, or scored one whose weight
    gradient is still to take."""
    return view.vocab_forwards < _forwarded(view) or view.vocab_backwards < view.vocab_forwards


def _arrived_backward_or_wait(view: StageView) -> Action:
    """A shard's or an embedding's weight gradient whose input has arrived, else WAIT. A VB
    waits for the rank's own backward of its microbatch, so it lands in the same step as the
    stage's gradient whatever the arrival order (a schedule without a flush may receive the
    statistics of its next step's microbatches before it takes this step)."""
    if view.stats_ready and view.vocab_backwards < _backwarded(view):
        return Action(VOCAB_BACKWARD, view.vocab_backwards)
    if view.embed_grad_ready:
        return Action(EMBED_BACKWARD, view.embed_backwards)
    return Action(WAIT)


def embedding_lookahead(base: Schedule, view: StageView) -> int | None:
    """Rule 5: how far beyond its own backwards a rank looks its rows up: the first stage's
    in-flight bound W0 (on N + 1 stages; with virtual stages the first chunk's lookahead). The
    first stage forwards i only once its backward of i - W0 is done, so once this rank's is:
    EF(i) is due by then. None: the schedule bounds no window (GPipe, interleaved 1F1B), the
    rank looks up the whole call."""
    if view.chunks:
        if base.chunk_lookahead is None:
            return None
        placement = base.placement(view.num_stages, view.num_chunks)
        return base.chunk_lookahead(0, 0, placement, view.microbatches_per_step) + 1
    window = base.inflight_window or base.max_inflight
    if window is None:
        return None
    return window(0, view.num_stages + 1, view.microbatches_per_step)


def _embedding_due(base: Schedule, view: StageView) -> bool:
    limit = _per_microbatch(view, view.forward_limit)
    if base.flushes_every_call:  # never a microbatch of the next step before this step's step
        limit = min(limit, _per_microbatch(view, view.backward_target))
    lookahead = embedding_lookahead(base, view)
    if lookahead is not None:
        limit = min(limit, _backwarded(view) + lookahead)
    return view.embed_forwards < limit


def _drained(base: Schedule, view: StageView) -> bool:
    """The stage has backwarded all it forwarded, and forwards no more before its step: at
    the end of every call of a flush, at an asynchronous schedule's drain."""
    end = view.backward_target if base.flushes_every_call else view.forward_limit
    return view.forwards >= end and view.backwards >= view.forwards


def _owed_when_drained(base: Schedule, view: StageView, split_input: bool) -> bool:
    """Whether a drained stage still owes a weight gradient of its rows (VB or EB)."""
    forwarded = _forwarded(view)
    owed = view.vocab_backwards < forwarded or (split_input and view.embed_backwards < forwarded)
    return owed and _drained(base, view)


def _owed_before_step(base: Schedule, view: StageView, split_input: bool) -> bool:
    """Rules 4 and 6: what a step must take first."""
    if view.vocab_backwards < _backwarded(view) or view.embed_grad_ready:
        return True
    return _owed_when_drained(base, view, split_input)


def next_action(base: Schedule, view: StageView, split_input: bool = False) -> Action:
    if view.hidden_ready:  # rule 2
        return Action(VOCAB_FORWARD, view.vocab_forwards)
    if split_input and _embedding_due(base, view):  # rule 5
        return Action(EMBED_FORWARD, view.embed_forwards)
    # rule 1 (virtual stages: `with_vocab_passes` took the schedule's stage_after_last)
    deeper = view if view.chunks else dataclasses.replace(view, num_stages=view.num_stages + 1)
    action = base.next_action(deeper)
    if action.kind is STEP and _owed_before_step(base, view, split_input):  # rules 4 and 6
        return _arrived_backward_or_wait(view)
    if action.kind is DONE:
        if _owed_when_drained(base, view, split_input):
            return _arrived_backward_or_wait(view)
        return action
    if _input_ready(view, action):
        return action
    if _owes_vocab_pass(view) or view.embed_grad_ready:  # rules 3 and 6
        return _arrived_backward_or_wait(view)
    return action


def _deeper(function):
    """A per-stage fact of the schedule (window, drift bound) on N + 1 stages (rule 1)."""
    if function is None:
        return None
    return lambda stage, num_stages, microbatches: function(stage, num_stages + 1, microbatches)


def splits_input(schedule: Schedule) -> bool:
    """Whether --enable-vocab-parallel splits the input embedding too under `schedule`: every
    schedule that does not stash weights (an EF runs ahead of the rank's forward, before the
    version a stashing schedule would pin)."""
    return not schedule.stashes_weights


def _one_stage_deeper(schedule: Schedule) -> dict:
    """Rule 1's facts of a one-chunk schedule: its windows and bounds on N + 1 stages."""
    return dict(
        inflight_window=_deeper(schedule.inflight_window),
        drift_bound=_deeper(schedule.drift_bound),
        max_inflight=_deeper(schedule.max_inflight),
        # 2BW's m >= N - 1 (a batch covers the window) becomes m >= N
        min_microbatches_per_step=lambda stages: schedule.min_microbatches_per_step(stages + 1),
    )


def cannot_take(schedule: Schedule, split_input: bool = False) -> str | None:
    """Why `schedule` cannot place the vocabulary passes yet (None: it can)."""
    if split_input and not splits_input(schedule):
        # an EF runs ahead of the rank's forward, before the version the forward will use
        return f"{schedule.name} stashes weights: the input embedding stays on the first stage"
    return None


@functools.cache
def with_vocab_passes(schedule: Schedule, split_input: bool = False) -> Schedule:
    """`schedule` with the output layer's shards placed by the rules above, and with
    `split_input` the input embedding's too. ValueError for the input split under weight
    stashing (`cannot_take`). A weight-stashing schedule
    (2BW, PipeDream) scores each microbatch on the weight version its rank forwarded it on:
    the shard is stashed with the rank's weights."""
    problem = cannot_take(schedule, split_input)
    if problem:
        raise ValueError(f"the vocabulary split over the pipeline ranks: {problem}")
    if schedule.stage_after_last is not None:  # rule 1 with virtual stages
        schedule = schedule.stage_after_last()
    fixed = schedule.fixed_order
    what = "output layer and input embedding" if split_input else "output layer"
    return dataclasses.replace(
        schedule,
        next_action=functools.partial(next_action, schedule, split_input=split_input),
        depends_on_arrivals=True,  # where a VF goes depends on when the hidden state arrives
        description=schedule.description + f"; {what} split by vocabulary over the ranks",
        fixed_order=None if fixed is None else with_vocab_passes(fixed, split_input),
        **(_one_stage_deeper(schedule) if schedule.placement is None else {}),
        vocab_passes=True,
        embedding_passes=split_input,
    )
