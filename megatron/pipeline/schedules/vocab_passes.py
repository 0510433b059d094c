"""The output layer split by vocabulary over the pipeline ranks, placed in any schedule.

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
   more stage's would be, and 1F1B's memory grows by one microbatch per stage).
2. A VF whose hidden state has arrived runs first: the last stage's backward waits for it.
3. Then the schedule's own action, once its input is there. Until then a VB whose statistics
   have arrived runs, else the rank waits for the next arrival: it never blocks on the
   schedule's input while it owes a VF, which the last stage may be waiting for.
4. A step takes the VB of every microbatch the stage has backwarded, so a shard's gradient
   is in the same update as the stage's; a call that drains the stage ends with every VF and
   VB done.

Shard drift: a rank's VF(i) follows its forward of i and its VB(i) precedes the step after
its backward of i, so a shard's weight version moves between the two by no more steps than
the stage's own weights between forward and backward (`drift_bound`, on N + 1 stages).
"""

import dataclasses
import functools

from .base import (
    BACKWARD,
    DONE,
    FORWARD,
    STEP,
    VOCAB_BACKWARD,
    VOCAB_FORWARD,
    WAIT,
    Action,
    Schedule,
    StageView,
)


def _input_ready(view: StageView, action: Action) -> bool:
    """Whether the schedule's action can run without blocking (its first pass's input)."""
    if action.kind is FORWARD:
        return view.input_ready
    if action.kind is BACKWARD:
        return view.grad_ready
    return True


def _owes_vocab_pass(view: StageView) -> bool:
    """The rank forwarded a microbatch its shard has not scored, or scored one whose weight
    gradient is still to take."""
    return view.vocab_forwards < view.forwards or view.vocab_backwards < view.vocab_forwards


def _vocab_backward_or_wait(view: StageView) -> Action:
    if view.stats_ready:
        return Action(VOCAB_BACKWARD, view.vocab_backwards)
    return Action(WAIT)


def next_action(base: Schedule, view: StageView) -> Action:
    if view.hidden_ready:  # rule 2
        return Action(VOCAB_FORWARD, view.vocab_forwards)
    action = base.next_action(dataclasses.replace(view, num_stages=view.num_stages + 1))
    if action.kind is STEP and view.vocab_backwards < view.backwards:  # rule 4
        return _vocab_backward_or_wait(view)
    if action.kind is DONE:
        drained = view.forwards >= view.forward_limit and view.backwards >= view.forwards
        if drained and view.vocab_backwards < view.forwards:
            return _vocab_backward_or_wait(view)
        return action
    if _input_ready(view, action) or not _owes_vocab_pass(view):  # rule 3
        return action
    return _vocab_backward_or_wait(view)


def _deeper(function):
    """A per-stage fact of the schedule (window, drift bound) on N + 1 stages (rule 1)."""
    if function is None:
        return None
    return lambda stage, num_stages, microbatches: function(stage, num_stages + 1, microbatches)


def cannot_take(schedule: Schedule) -> str | None:
    """Why `schedule` cannot place the vocabulary passes yet (None: it can)."""
    if schedule.placement is not None:
        return f"{schedule.name} runs several model chunks per rank"
    return None


@functools.cache
def with_vocab_passes(schedule: Schedule) -> Schedule:
    """`schedule` with the output layer's shards placed by the rules above. ValueError for a
    schedule that cannot take them yet (virtual stages). A weight-stashing schedule (2BW,
    PipeDream) scores each microbatch on the weight version its rank forwarded it on: the shard
    is stashed with the rank's weights."""
    problem = cannot_take(schedule)
    if problem:
        raise ValueError(f"the vocabulary split over the pipeline ranks: {problem}")
    fixed = schedule.fixed_order
    return dataclasses.replace(
        schedule,
        next_action=functools.partial(next_action, schedule),
        depends_on_arrivals=True,  # where a VF goes depends on when the hidden state arrives
        description=schedule.description + "; output layer split by vocabulary over the ranks",
        fixed_order=None if fixed is None else with_vocab_passes(fixed),
        inflight_window=_deeper(schedule.inflight_window),
        drift_bound=_deeper(schedule.drift_bound),
        # 2BW's m >= N - 1 (a batch covers the window) becomes m >= N
        min_microbatches_per_step=lambda stages: schedule.min_microbatches_per_step(stages + 1),
        vocab_passes=True,
    )
