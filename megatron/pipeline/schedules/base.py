"""Schedules as data: a schedule is a per-stage decision procedure.

A schedule looks at what one stage knows (a `StageView`: counters, whether the next input or
gradient has arrived) and names the next `Action`. It never touches tensors, clocks or process
groups, so the very same function drives the real runtime (`megatron.pipeline.runtime`) and the
discrete-event simulator (`megatron.pipeline.simulation`).

Conventions shared by every schedule:

* stages are 0-indexed (`stage` in `[0, num_stages)`); microbatches are numbered from 0 in the
  order the stage forwards them, and backwards run in the same (FIFO) order, so an action only
  needs its kind: the microbatch is `view.forwards` for a forward, `view.backwards` for a backward;
* counters are cumulative over the whole run, not per call; a call to the schedule function sets
  `backward_target` (the call returns once the stage has done that many backwards and the steps
  they make due) and `forward_limit` (no forward beyond it: the end of the data, or of the step
  when the pipeline must drain);
* the optimizer step is an action of the schedule (`STEP`), so asynchronous schedules can step
  in the middle of a call, and synchronous ones at its end.

Virtual stages (`placement`): a schedule with a `Schedule.placement` runs several model chunks
per rank. Its view is then the rank's (`stage` is the rank, `num_stages` the number of ranks),
with one `ChunkView` per chunk in `StageView.chunks`, and each of its FORWARD, BACKWARD and
WEIGHT_GRAD actions names the chunk by its id local to the rank (`Action.chunk`). Per chunk the
conventions above hold: microbatches in order, FIFO backwards.
"""

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .placement import Placement


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"
    WAIT = "wait"  # nothing runnable yet: block until an input or gradient arrives
    DONE = "done"  # this call's work on the stage is finished
    # Split-backward schedules only (zero-bubble): BACKWARD then computes the input gradient
    # alone, and WEIGHT_GRAD computes the weight gradient of the oldest such microbatch later.
    WEIGHT_GRAD = "W"
    # A vocabulary split over the pipeline ranks (`vocab_passes`) only: the rank's shard of the
    # output layer scores a microbatch's last hidden state (VF: the shard's logits, softmax
    # statistics and input-gradient part), and later takes its weight gradient (VB) once the
    # statistics over every shard are back.
    VOCAB_FORWARD = "VF"
    VOCAB_BACKWARD = "VB"
    # The input embedding split the same way (`vocab_passes` with the input split): the rank's
    # rows of the embedding look up a microbatch's tokens (EF: its part of the first stage's
    # input, zero where a token is not its own) and take their gradient (EB) once the first
    # stage's backward sent it.
    EMBED_FORWARD = "EF"
    EMBED_BACKWARD = "EB"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int | None = None  # forwards/backwards only
    # Schedules with virtual stages: the model chunk (its id on the rank, not the virtual
    # stage). None for one chunk per stage, so those actions read as before: "F3".
    chunk: int | None = None
    # Passes run in the same slot as this one, outputs sent when the slot ends: DualPipe's
    # overlapped forward and backward of two chunks, or a full backward (B with its W) in a
    # split-backward schedule. Each is checked and counted as if run on its own.
    together: tuple["Action", ...] = ()

    def __str__(self) -> str:
        if self.microbatch is None:
            return self.kind.value
        suffix = "" if self.chunk is None else f"c{self.chunk}"
        return "&".join([f"{self.kind.value}{self.microbatch}{suffix}", *map(str, self.together)])

    @property
    def passes(self) -> tuple["Action", ...]:
        """This pass and those run together with it, in order."""
        return (Action(self.kind, self.microbatch, self.chunk), *self.together)


VOCAB_FORWARD, VOCAB_BACKWARD = ActionKind.VOCAB_FORWARD, ActionKind.VOCAB_BACKWARD
EMBED_FORWARD, EMBED_BACKWARD = ActionKind.EMBED_FORWARD, ActionKind.EMBED_BACKWARD
FORWARD, BACKWARD, STEP, WAIT, DONE = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.STEP,
    ActionKind.WAIT,
    ActionKind.DONE,
)
WEIGHT_GRAD = ActionKind.WEIGHT_GRAD


class Transfer(enum.Enum):
    """What travels between virtual stages: an activation goes to the next one, the gradient
    of an activation back to the previous one."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"
    # A vocabulary split over the ranks: the last stage's output hidden state goes to every
    # rank, each shard's part of the loss and of its gradient comes back to the last stage,
    # and the softmax statistics over all shards go out to every rank again.
    HIDDEN = "hidden"
    SHARD_OUTPUT = "shard output"
    LOGIT_STATS = "logit statistics"
    # The input embedding split too: every rank's part of a microbatch's embedding goes to the
    # first stage, and the embedding's gradient from the first stage's backward to every rank.
    EMBEDDING = "embedding part"
    EMBEDDING_GRADIENT = "embedding gradient"


@dataclass(frozen=True)
class KindInfo:
    """What an action kind is, said once for everything that handles actions: the stage
    checks (stage_state.py), the runtime's handler table, the simulator (what a pass waits for,
    what it sends, what it costs) and the trace. A new kind is an entry here plus a handler
    in the runtime, the simulator and the stage checks; each of them refuses a kind it has
    no handler for."""

    runs: bool  # takes the rank's time (WAIT and DONE only steer the loop)
    per_chunk: bool  # names a microbatch of a model chunk (STEP is the whole rank's)
    needs: Transfer | None = None  # waits for it, except at the pipeline's end that makes it
    sends: Transfer | None = None  # sent when its slot ends, except at the pipeline's end
    counter: str | None = None  # the stage counter it advances (its index for costs, noise)
    # With the vocabulary split over the ranks, at the last stage only: what the pass waits
    # for from every rank (each shard's output) and what it sends to every rank.
    output_needs: Transfer | None = None
    output_sends: Transfer | None = None
    # With the input embedding split too, at the first stage only: the same, from and to
    # every rank's embedding rows.
    input_needs: Transfer | None = None
    input_sends: Transfer | None = None


KIND_INFO: dict[ActionKind, KindInfo] = {
    FORWARD: KindInfo(runs=True, per_chunk=True, needs=Transfer.ACTIVATION,
                      sends=Transfer.ACTIVATION, counter="forwards",
                      output_sends=Transfer.HIDDEN, input_needs=Transfer.EMBEDDING),
    BACKWARD: KindInfo(runs=True, per_chunk=True, needs=Transfer.GRADIENT,
                       sends=Transfer.GRADIENT, counter="backwards",
                       output_needs=Transfer.SHARD_OUTPUT, output_sends=Transfer.LOGIT_STATS,
                       input_sends=Transfer.EMBEDDING_GRADIENT),
    WEIGHT_GRAD: KindInfo(runs=True, per_chunk=True, counter="weight_grads"),
    VOCAB_FORWARD: KindInfo(runs=True, per_chunk=False, needs=Transfer.HIDDEN,
                            sends=Transfer.SHARD_OUTPUT, counter="vocab_forwards"),
    VOCAB_BACKWARD: KindInfo(runs=True, per_chunk=False, needs=Transfer.LOGIT_STATS,
                             counter="vocab_backwards"),
    EMBED_FORWARD: KindInfo(runs=True, per_chunk=False, sends=Transfer.EMBEDDING,
                            counter="embed_forwards"),
    EMBED_BACKWARD: KindInfo(runs=True, per_chunk=False, needs=Transfer.EMBEDDING_GRADIENT,
                             counter="embed_backwards"),
    STEP: KindInfo(runs=True, per_chunk=False, counter="steps"),
    WAIT: KindInfo(runs=False, per_chunk=False),
    DONE: KindInfo(runs=False, per_chunk=False),
}  # fmt: skip


def kind_info(kind: ActionKind) -> KindInfo:
    try:
        return KIND_INFO[kind]
    except KeyError:
        raise ValueError(f"action kind {kind} has no entry in KIND_INFO") from None


class StagePosition:
    """`is_first` and `is_last` for a class with `stage` (0-indexed) and `num_stages` fields:
    the schedules' `StageView` and the runtime's `PipelineContext`."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class ChunkView:
    """One model chunk of a rank, for schedules with virtual stages: its counters (microbatches
    of this chunk, cumulative) and whether its next input and gradient have arrived."""

    virtual_stage: int
    forwards: int
    backwards: int
    weight_grads: int
    input_ready: bool  # the activation for forward number `forwards` is there
    grad_ready: bool  # the output gradient for backward number `backwards` is there

    @property
    def inflight(self) -> int:
        return self.forwards - self.backwards


@dataclass(frozen=True)
class StageView(StagePosition):
    """Everything a schedule may base its decision on, for one stage at one instant."""

    stage: int
    num_stages: int
    microbatches_per_step: int  # m for flush schedules, the accumulation factor a for PACI
    forwards: int  # forwards done so far
    backwards: int  # backwards done so far
    steps: int  # optimizer steps done so far: the stage's current weight version
    forward_limit: int  # forwards must not go beyond this count
    backward_target: int  # the call ends when backwards reach this and due steps are done
    input_ready: bool  # the input of forward number `forwards` has arrived (first stage: always)
    grad_ready: bool  # the output gradient of backward number `backwards` has arrived
    step_enabled: bool = True  # False when the caller steps the optimizer itself
    weight_grads: int = 0  # split-backward schedules: weight-gradient passes done so far
    # Backwards and steps when `microbatches_per_step` took its current value (0, 0 unless it
    # changed during the run, as with a batch-size ramp): steps fall every m backwards from here.
    backwards_at_m: int = 0
    steps_at_m: int = 0
    # Virtual stages: one view per model chunk of the rank (empty: one chunk per stage). The
    # counters above, the backward target and the forward limit are then totals over the
    # chunks, and `input_ready`/`grad_ready` say whether any chunk has its input/gradient.
    chunks: tuple[ChunkView, ...] = ()
    # A vocabulary split over the ranks (schedules with `vocab_passes`): the rank's output
    # shard passes so far, and whether the next one's input has arrived (VF: the last stage's
    # hidden state of microbatch `vocab_forwards`; VB: the statistics of `vocab_backwards`).
    vocab_forwards: int = 0
    vocab_backwards: int = 0
    hidden_ready: bool = False
    stats_ready: bool = False
    # The input embedding split too: the rank's embedding passes so far, and whether the
    # first stage sent the gradient of microbatch `embed_backwards` (the first stage's own
    # `input_ready` says whether every rank's part of its next forward's input has arrived).
    embed_forwards: int = 0
    embed_backwards: int = 0
    embed_grad_ready: bool = False

    @property
    def inflight(self) -> int:
        """Microbatches forwarded but not yet backwarded on this stage (microbatch-chunks, with
        virtual stages: the activations the rank holds)."""
        return self.forwards - self.backwards

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunks))


def forward(view: StageView, chunk: int | None = None) -> Action:
    """The stage's next forward; with `chunk`, that chunk's next one."""
    if chunk is None:
        return Action(FORWARD, view.forwards)
    return Action(FORWARD, view.chunks[chunk].forwards, chunk)


def backward(view: StageView, chunk: int | None = None) -> Action:
    if chunk is None:
        return Action(BACKWARD, view.backwards)
    return Action(BACKWARD, view.chunks[chunk].backwards, chunk)


def weight_grad(view: StageView, chunk: int | None = None) -> Action:
    if chunk is None:
        return Action(WEIGHT_GRAD, view.weight_grads)
    return Action(WEIGHT_GRAD, view.chunks[chunk].weight_grads, chunk)


@dataclass(frozen=True)
class Schedule:
    """A named decision procedure plus the facts about it that do not depend on timing."""

    name: str
    next_action: Callable[[StageView], Action]
    # True when the decision depends on arrival order (not only on counters). Tensor-parallel
    # ranks of a stage then must agree on each decision: their arrivals are not simultaneous.
    depends_on_arrivals: bool
    # True when the pipeline is empty at the end of every call (synchronous schedules).
    flushes_every_call: bool
    # Parameter copies a stage keeps besides its live weights (weight stashing, double buffers).
    extra_weight_versions: Callable[[int, int], int] = lambda stage, num_stages: 0
    description: str = ""
    # Weight stashing: a backward runs on the weight version its forward used (PipeDream,
    # PipeDream-2BW), so forward and backward never disagree; the gradient is then stale by
    # the steps taken since that forward. False: the backward sees the current weights (PACI).
    stashes_weights: bool = False
    # The weight version a forward must use, from (microbatch, microbatches_per_step, current
    # version); None: the current version. PipeDream-2BW pins each batch to one version.
    forward_weight_version: Callable[[int, int, int], int] | None = None
    # Fewest microbatches per step the schedule is defined for, given the number of stages.
    min_microbatches_per_step: Callable[[int], int] = lambda num_stages: 1
    # The backward is split into BACKWARD (input gradient) and WEIGHT_GRAD actions.
    splits_backward: bool = False
    # For schedules that react to arrivals: the same rules with arrivals ignored (a fixed,
    # counter-only order), used by --deterministic-mode so runs reproduce bit for bit.
    fixed_order: "Schedule | None" = None
    # Microbatches whose gradients one optimizer step takes, given the microbatches of a call:
    # m for every schedule that steps once per call's worth of backwards; 1 for PipeDream,
    # which steps after every microbatch. The last stage scales each loss by its inverse.
    microbatches_per_update: Callable[[int], int] = lambda microbatches_per_step: (
        microbatches_per_step
    )
    # Virtual stages: the placement of the model chunks from (ranks, chunks per rank); None:
    # one chunk per stage. `default_chunks_per_rank` is v when the caller gives none, and
    # `check_microbatches(ranks, chunks per rank, m)` raises ValueError for an m the schedule
    # is not defined for.
    placement: "Callable[[int, int], Placement] | None" = None
    default_chunks_per_rank: int = 1
    check_microbatches: Callable[[int, int, int], None] | None = None
    # Asynchronous schedules with virtual stages: how many forwards of a chunk may run beyond
    # its backwards, from (rank, chunk, placement, microbatches per step); the runtime posts
    # that many receives ahead. None: up to the call's forward limit.
    chunk_lookahead: Callable | None = None
    # Virtual stages: the schedule's variant that hides one more stage after its last virtual
    # stage (rule 1 of `schedules.vocab_passes`: the round trip to the vocabulary shards), such
    # as one more microbatch-chunk in flight per rank. None: none; a schedule with one chunk per
    # rank decides as on N + 1 stages instead.
    stage_after_last: "Callable[[], Schedule] | None" = None
    # Schedules that admit forwards by a window (PACI's rule 1): microbatches stage s may hold
    # in flight, from (stage, stages, microbatches per step); None: no such window.
    inflight_window: Callable[[int, int, int], int] | None = None
    # The most microbatches stage s ever holds in flight, from (stage, stages, microbatches per
    # step), where the schedule keeps such a bound without admitting by it (1F1B: N - s).
    max_inflight: Callable[[int, int, int], int] | None = None
    # The most optimizer steps a microbatch can cross on stage s, from (stage, stages,
    # microbatches per step), where the schedule has a closed form (PACI); None: none.
    drift_bound: Callable[[int, int, int], int] | None = None
    # The output layer and the loss are split by vocabulary over the ranks, and the schedule
    # places their passes (VOCAB_FORWARD, VOCAB_BACKWARD; `schedules.vocab_passes`).
    vocab_passes: bool = False
    # ... and the input embedding too (EMBED_FORWARD, EMBED_BACKWARD).
    embedding_passes: bool = False

    @property
    def global_grad_norm(self) -> bool:
        """Whether a step may take the gradient norm over the whole model. That reduction spans
        every stage, which only a schedule whose pipeline is empty at each step boundary (a
        flush) can afford; the others take it over the stage's own parameters."""
        return self.flushes_every_call

    @property
    def steps_within_call(self) -> bool:
        """Whether stages step their optimizer in the middle of a call, so the caller must pass
        the step (`optimizer_step_func`) instead of stepping after the call returns."""
        return not self.flushes_every_call


def steps_due(view: StageView) -> bool:
    """A step is due once `microbatches_per_step` backwards have accumulated since the last one."""
    steps_since = view.steps - view.steps_at_m
    due_at = view.backwards_at_m + (steps_since + 1) * view.microbatches_per_step
    return view.step_enabled and view.backwards >= due_at
