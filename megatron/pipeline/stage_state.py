"""One stage's state around a schedule, shared by the runtime and the simulator.

A schedule (`megatron.pipeline.schedules`) decides from a `StageView`; `StageState` is what that
view is built from and what every action changes: the cumulative counters, the current call's
backward target and forward limit, the weight version each in-flight microbatch's forward used,
and the last few actions. The runtime (`megatron.pipeline.runtime`) and the event engine
(`megatron.pipeline.simulation.engine`) both keep one per stage, so they count, build views and
validate actions the same way; only what an action costs (tensors and transfers, or a clock)
differs.

`RankState` holds one `StageState` per model chunk for schedules with virtual stages (several
chunks per rank, `megatron.pipeline.schedules.placement`) and builds the rank's view from them.

`check` rejects an action no stage could carry out (a forward that skips a microbatch or goes
past the forward limit, a backward of a microbatch never forwarded, ...) with a message that
shows the stage's state and its recent actions, before anything is changed.
"""

import collections
from dataclasses import dataclass, field

from .schedules.base import Action, ActionKind, ChunkView, StageView, kind_info

NO_LIMIT = 2**62  # forward limit of a call that need not drain
RECENT_ACTIONS = 12  # how many past actions an error message shows


class IllegalActionError(RuntimeError):
    """A schedule named an action the stage cannot carry out."""


@dataclass
class StageState:
    """Counters, weight versions and recent actions of one pipeline stage."""

    stage: int
    num_stages: int
    schedule_name: str = "schedule"
    splits_backward: bool = False  # BACKWARD is the input gradient only; WEIGHT_GRAD follows
    forwards: int = 0
    backwards: int = 0
    weight_grads: int = 0
    steps: int = 0  # optimizer steps taken: the stage's current weight version
    vocab_forwards: int = 0  # the rank's output-shard passes (a vocabulary split over ranks)
    vocab_backwards: int = 0
    embed_forwards: int = 0  # the rank's input-embedding passes (the input split too)
    embed_backwards: int = 0
    calls: int = 0
    microbatches_per_step: int = 1
    backward_target: int = 0  # cumulative backwards the current call must reach
    backwards_at_m: int = 0  # backwards and steps when microbatches_per_step last changed
    steps_at_m: int = 0
    forward_limit: int = NO_LIMIT  # no forward beyond this count in the current call
    # microbatch -> weight version its forward used, until its weight gradient is accumulated
    forward_versions: dict[int, int] = field(default_factory=dict)
    # microbatch -> weight version the output shard scored it with, until its VB
    shard_versions: dict[int, int] = field(default_factory=dict)
    # microbatch -> weight version the embedding rows looked it up with, until its EB
    embed_versions: dict[int, int] = field(default_factory=dict)
    peak_inflight: int = 0
    recent: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_ACTIONS)
    )

    @property
    def inflight(self) -> int:
        return self.forwards - self.backwards

    # ------------------------------------------------------------------ calls and views
    def begin_call(self, microbatches_per_step: int, forward_limit: int = NO_LIMIT) -> None:
        """Start a call that ends after `microbatches_per_step` more backwards."""
        if self.calls and microbatches_per_step != self.microbatches_per_step:
            # the previous call ended on a step boundary: steps fall every m from there
            self.backwards_at_m, self.steps_at_m = self.backward_target, self.steps
        self.calls += 1
        self.microbatches_per_step = microbatches_per_step
        self.backward_target += microbatches_per_step
        self.forward_limit = forward_limit

    def view(
        self,
        *,
        input_ready: bool,
        grad_ready: bool,
        step_enabled: bool = True,
        hidden_ready: bool = False,
        stats_ready: bool = False,
        embed_grad_ready: bool = False,
    ) -> StageView:
        return StageView(
            stage=self.stage,
            num_stages=self.num_stages,
            microbatches_per_step=self.microbatches_per_step,
            forwards=self.forwards,
            backwards=self.backwards,
            steps=self.steps,
            forward_limit=self.forward_limit,
            backward_target=self.backward_target,
            input_ready=input_ready,
            grad_ready=grad_ready,
            step_enabled=step_enabled,
            weight_grads=self.weight_grads,
            backwards_at_m=self.backwards_at_m,
            steps_at_m=self.steps_at_m,
            vocab_forwards=self.vocab_forwards,
            vocab_backwards=self.vocab_backwards,
            hidden_ready=hidden_ready,
            stats_ready=stats_ready,
            embed_forwards=self.embed_forwards,
            embed_backwards=self.embed_backwards,
            embed_grad_ready=embed_grad_ready,
        )

    # ------------------------------------------------------------------ validation
    def problem_with(self, action: Action, *, step_enabled: bool = True) -> str | None:
        """Why `action` cannot run on this stage now (None: it can)."""
        check = self._CHECKS.get(action.kind)
        if check is None:
            return "is not an action a stage can run"
        return check(self, action.microbatch, step_enabled)

    def _forward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.forwards:
            return f"names microbatch {microbatch}, the stage's next forward is {self.forwards}"
        if self.forwards >= self.forward_limit:
            return f"forwards past the forward limit {self.forward_limit} (end of the data)"
        return None

    def _backward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.backwards:
            return f"names microbatch {microbatch}, the stage's next backward is {self.backwards}"
        if self.backwards >= self.forwards:
            return "backwards a microbatch that was not forwarded"
        return None

    def _weight_grad_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if not self.splits_backward:
            return "is a weight-gradient pass, but the schedule does not split its backward"
        if microbatch != self.weight_grads:
            return f"names weight gradient {microbatch}, the stage's next is {self.weight_grads}"
        if self.weight_grads >= self.backwards:
            return "computes a weight gradient before its input gradient"
        return None

    def _step_problem(self, microbatch: None, step_enabled: bool) -> str | None:
        if not step_enabled:
            return "steps the optimizer, but the caller steps it itself"
        return None

    def _vocab_forward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.vocab_forwards:
            return f"names microbatch {microbatch}, the shard's next is {self.vocab_forwards}"
        return None

    def _vocab_backward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.vocab_backwards:
            return f"names microbatch {microbatch}, the shard's next is {self.vocab_backwards}"
        if self.vocab_backwards >= self.vocab_forwards:
            return "takes a shard's weight gradient before the shard scored the microbatch"
        return None

    def _embed_forward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.embed_forwards:
            return f"names microbatch {microbatch}, the embedding's next is {self.embed_forwards}"
        if self.embed_forwards >= self.forward_limit:
            return f"looks up past the forward limit {self.forward_limit} (end of the data)"
        return None

    def _embed_backward_problem(self, microbatch: int, step_enabled: bool) -> str | None:
        if microbatch != self.embed_backwards:
            return f"names microbatch {microbatch}, the embedding's next is {self.embed_backwards}"
        if self.embed_backwards >= self.embed_forwards:
            return "takes an embedding gradient before the rows looked the microbatch up"
        return None

    # One check per kind a stage runs (schedules.base.KIND_INFO); WAIT and DONE are no work.
    _CHECKS = {
        ActionKind.FORWARD: _forward_problem,
        ActionKind.BACKWARD: _backward_problem,
        ActionKind.WEIGHT_GRAD: _weight_grad_problem,
        ActionKind.STEP: _step_problem,
        ActionKind.VOCAB_FORWARD: _vocab_forward_problem,
        ActionKind.VOCAB_BACKWARD: _vocab_backward_problem,
        ActionKind.EMBED_FORWARD: _embed_forward_problem,
        ActionKind.EMBED_BACKWARD: _embed_backward_problem,
    }

    def check(self, action: Action, *, step_enabled: bool = True) -> None:
        """Raise `IllegalActionError` with the stage's state if `action` cannot run."""
        problem = self.problem_with(action, step_enabled=step_enabled)
        if problem:
            raise IllegalActionError(
                f"{self.schedule_name}: stage {self.stage}: {action} {problem}\n"
                f"  state: {self.describe()}\n"
                f"  recent actions (oldest first): {self.recent_actions()}"
            )

    def describe(self) -> str:
        limit = "none" if self.forward_limit >= NO_LIMIT else str(self.forward_limit)
        vocab = self._describe_vocab()
        return (
            f"stage {self.stage} of {self.num_stages}, call {self.calls}: F={self.forwards} "
            f"B={self.backwards} W={self.weight_grads} S={self.steps}, in flight {self.inflight}, "
            f"backward target {self.backward_target}, forward limit {limit}{vocab}"
        )

    def _describe_vocab(self) -> str:
        vocab = ""
        if self.vocab_forwards:
            vocab += f", VF={self.vocab_forwards} VB={self.vocab_backwards}"
        if self.embed_forwards:
            vocab += f", EF={self.embed_forwards} EB={self.embed_backwards}"
        return vocab

    def recent_actions(self) -> str:
        return " ".join(str(action) for action in self.recent) or "(none)"

    # ------------------------------------------------------------------ bookkeeping
    def record_forward(self, version: int | None = None) -> int:
        """A forward ran on weight `version` (default: the current one); returns its microbatch."""
        microbatch = self.forwards
        self.forward_versions[microbatch] = self.steps if version is None else version
        self.forwards += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        self.recent.append(Action(ActionKind.FORWARD, microbatch))
        return microbatch

    def record_backward(self) -> int:
        """A backward ran; returns the weight version its forward used."""
        microbatch = self.backwards
        if self.splits_backward:
            version = self.forward_versions[microbatch]
        else:
            version = self.forward_versions.pop(microbatch)
        self.backwards += 1
        self.recent.append(Action(ActionKind.BACKWARD, microbatch))
        return version

    def record_weight_grad(self) -> int:
        """A weight-gradient pass ran; returns the weight version its forward used."""
        microbatch = self.weight_grads
        version = self.forward_versions.pop(microbatch)
        self.weight_grads += 1
        self.recent.append(Action(ActionKind.WEIGHT_GRAD, microbatch))
        return version

    def record_step(self) -> None:
        self.steps += 1
        self.recent.append(Action(ActionKind.STEP))

    def record_vocab_forward(self, version: int | None = None) -> int:
        """The rank's output shard scored its next microbatch on weight `version` (default:
        the current one); returns the microbatch."""
        microbatch = self.vocab_forwards
        self.shard_versions[microbatch] = self.steps if version is None else version
        self.vocab_forwards += 1
        self.recent.append(Action(ActionKind.VOCAB_FORWARD, microbatch))
        return microbatch

    def record_vocab_backward(self) -> int:
        """The shard took a microbatch's weight gradient; returns the version that scored it."""
        version = self.shard_versions.pop(self.vocab_backwards)
        self.recent.append(Action(ActionKind.VOCAB_BACKWARD, self.vocab_backwards))
        self.vocab_backwards += 1
        return version

    def record_embed_forward(self, version: int | None = None) -> int:
        """The rank's embedding rows looked its next microbatch up on weight `version`
        (default: the current one); returns the microbatch."""
        microbatch = self.embed_forwards
        self.embed_versions[microbatch] = self.steps if version is None else version
        self.embed_forwards += 1
        self.recent.append(Action(ActionKind.EMBED_FORWARD, microbatch))
        return microbatch

    def record_embed_backward(self) -> int:
        """The rows took a microbatch's gradient; returns the version that looked it up."""
        version = self.embed_versions.pop(self.embed_backwards)
        self.recent.append(Action(ActionKind.EMBED_BACKWARD, self.embed_backwards))
        self.embed_backwards += 1
        return version


class RankState:
    """One rank's state around a schedule: a `StageState` per model chunk it holds.

    Each chunk's `StageState` counts that chunk's microbatches, with the chunk's virtual stage as
    its stage (so its checks and messages speak of virtual stages); the optimizer step is the
    rank's and steps every chunk at once. Without virtual stages (`chunked` False: the schedule
    has no placement) the rank has one chunk and its views and checks are that `StageState`'s,
    unchanged. `peak_inflight` is the most microbatch-chunks forwarded and not yet through B;
    `peak_held` the most not yet through their last backward pass (W when it is split off), the
    activations the rank keeps alive.
    """

    def __init__(
        self, rank, placement, schedule_name="schedule", *, splits_backward=False, chunked=True
    ):
        self.rank = rank
        self.placement = placement
        self.chunked = chunked
        self.splits_backward = splits_backward
        self.schedule_name = schedule_name
        total = placement.num_virtual_stages
        self.chunks = [
            StageState(stage, total, schedule_name, splits_backward=splits_backward)
            for stage in placement.stages_of(rank)
        ]
        self.peak_inflight = 0
        self.peak_held = 0
        self.recent: collections.deque = collections.deque(maxlen=RECENT_ACTIONS)

    # totals over the chunks
    @property
    def forwards(self) -> int:
        return sum(c.forwards for c in self.chunks)

    @property
    def backwards(self) -> int:
        return sum(c.backwards for c in self.chunks)

    @property
    def weight_grads(self) -> int:
        return sum(c.weight_grads for c in self.chunks)

    @property
    def steps(self) -> int:
        return self.chunks[0].steps

    @property
    def calls(self) -> int:
        return self.chunks[0].calls

    @property
    def inflight(self) -> int:
        return self.forwards - self.backwards

    @property
    def forward_limit(self) -> int:
        """The call's forward limit over all chunks (the view's)."""
        return min(self.chunks[0].forward_limit * len(self.chunks), NO_LIMIT)

    @property
    def held(self) -> int:
        return self.forwards - (self.weight_grads if self.splits_backward else self.backwards)

    def begin_call(self, microbatches_per_step: int, forward_limit: int = NO_LIMIT) -> None:
        """Start a call that ends after `microbatches_per_step` more backwards of every chunk."""
        for chunk in self.chunks:
            chunk.begin_call(microbatches_per_step, forward_limit)

    def view(
        self,
        *,
        inputs_ready,
        grads_ready,
        step_enabled: bool = True,
        vocab_ready=(False, False, False),
    ) -> StageView:
        """The schedule's view; `inputs_ready`/`grads_ready`: one flag per chunk;
        `vocab_ready`: whether the next VF's, VB's and EB's inputs have arrived (a vocabulary
        split over the ranks; one chunk per rank)."""
        if not self.chunked:
            hidden_ready, stats_ready, embed_grad_ready = vocab_ready
            return self.chunks[0].view(
                input_ready=inputs_ready[0],
                grad_ready=grads_ready[0],
                step_enabled=step_enabled,
                hidden_ready=hidden_ready,
                stats_ready=stats_ready,
                embed_grad_ready=embed_grad_ready,
            )
        first = self.chunks[0]
        views = tuple(
            ChunkView(c.stage, c.forwards, c.backwards, c.weight_grads, i, g)
            for c, i, g in zip(self.chunks, inputs_ready, grads_ready)
        )
        v = len(self.chunks)
        return StageView(
            stage=self.rank,
            num_stages=self.placement.num_ranks,
            microbatches_per_step=first.microbatches_per_step,
            forwards=self.forwards,
            backwards=self.backwards,
            steps=self.steps,
            forward_limit=min(first.forward_limit * v, NO_LIMIT),
            backward_target=first.backward_target * v,
            input_ready=any(inputs_ready),
            grad_ready=any(grads_ready),
            step_enabled=step_enabled,
            weight_grads=self.weight_grads,
            backwards_at_m=first.backwards_at_m * v,
            steps_at_m=first.steps_at_m,
            chunks=views,
            **self._vocabulary_view(vocab_ready),
        )

    def _vocabulary_view(self, ready) -> dict:
        """The rank's vocabulary passes (counted on chunk 0) and their inputs' arrivals."""
        hidden_ready, stats_ready, embed_grad_ready = ready
        first = self.chunks[0]
        return dict(
            vocab_forwards=first.vocab_forwards, vocab_backwards=first.vocab_backwards,
            hidden_ready=hidden_ready, stats_ready=stats_ready,
            embed_forwards=first.embed_forwards, embed_backwards=first.embed_backwards,
            embed_grad_ready=embed_grad_ready,
        )  # fmt: skip

    def chunk_of(self, action: Action) -> int:
        """The chunk index an action runs on (0 without virtual stages)."""
        return 0 if action.chunk is None else action.chunk

    def check(self, action: Action, *, step_enabled: bool = True) -> None:
        """Raise `IllegalActionError` if `action` (with the passes run together with it) cannot
        run on this rank now."""
        if not self.chunked and not action.together:
            self.chunks[0].check(action, step_enabled=step_enabled)
            return
        problem, in_slot = None, set()  # (chunk, microbatch) whose B runs in this slot
        for part in action.passes:
            problem = self._problem_with(part, step_enabled, in_slot)
            if problem:
                break
            if part.kind is ActionKind.BACKWARD:
                in_slot.add((self.chunk_of(part), part.microbatch))
        if problem:
            raise IllegalActionError(
                f"{self.schedule_name}: rank {self.rank}: {action} {problem}\n"
                f"  state: {self.describe()}\n"
                f"  recent actions (oldest first): {self.recent_actions()}"
            )

    def _problem_with(self, part: Action, step_enabled: bool, in_slot: set) -> str | None:
        if not kind_info(part.kind).per_chunk:  # the rank's (STEP): any chunk's state says
            return self.chunks[0].problem_with(part, step_enabled=step_enabled)
        if self.chunked and part.chunk is None:
            return "names no model chunk (the schedule places several on each rank)"
        index = self.chunk_of(part)
        if not 0 <= index < len(self.chunks):
            return f"names chunk {index}, the rank holds {len(self.chunks)}"
        chunk = self.chunks[index]
        if part.kind is ActionKind.WEIGHT_GRAD and (index, part.microbatch) in in_slot:
            # its input gradient runs in the same slot, just before it
            if not self.splits_backward or part.microbatch != chunk.weight_grads:
                return f"runs weight gradient {part.microbatch} out of turn ({chunk.describe()})"
            return None
        return chunk.problem_with(Action(part.kind, part.microbatch), step_enabled=step_enabled)

    def describe(self) -> str:
        if not self.chunked:
            return self.chunks[0].describe()
        parts = ", ".join(
            f"chunk {i} (virtual stage {c.stage}): F={c.forwards} B={c.backwards} "
            f"W={c.weight_grads}"
            for i, c in enumerate(self.chunks)
        )
        return (
            f"rank {self.rank} of {self.placement.num_ranks}, call {self.calls}, "
            f"S={self.steps}: {parts}"
        )

    def recent_actions(self) -> str:
        if not self.chunked:
            return self.chunks[0].recent_actions()
        return " ".join(str(action) for action in self.recent) or "(none)"

    # bookkeeping: each returns what the chunk's `StageState` returns
    def record_forward(self, chunk: int, version: int | None = None) -> int:
        microbatch = self.chunks[chunk].record_forward(version)
        self._note(Action(ActionKind.FORWARD, microbatch, chunk))
        return microbatch

    def record_backward(self, chunk: int) -> int:
        version = self.chunks[chunk].record_backward()
        self._note(Action(ActionKind.BACKWARD, self.chunks[chunk].backwards - 1, chunk))
        return version

    def record_weight_grad(self, chunk: int) -> int:
        version = self.chunks[chunk].record_weight_grad()
        self._note(Action(ActionKind.WEIGHT_GRAD, self.chunks[chunk].weight_grads - 1, chunk))
        return version

    def record_step(self) -> None:
        for chunk in self.chunks:
            chunk.record_step()
        self._note(Action(ActionKind.STEP))

    # the output shard is the rank's (one chunk per rank): its counters live in chunk 0's state
    def record_vocab_forward(self, version: int | None = None) -> int:
        microbatch = self.chunks[0].record_vocab_forward(version)
        self._note(Action(ActionKind.VOCAB_FORWARD, microbatch))
        return microbatch

    def record_vocab_backward(self) -> int:
        version = self.chunks[0].record_vocab_backward()
        self._note(Action(ActionKind.VOCAB_BACKWARD, self.chunks[0].vocab_backwards - 1))
        return version

    def record_embed_forward(self, version: int | None = None) -> int:
        microbatch = self.chunks[0].record_embed_forward(version)
        self._note(Action(ActionKind.EMBED_FORWARD, microbatch))
        return microbatch

    def record_embed_backward(self) -> int:
        version = self.chunks[0].record_embed_backward()
        self._note(Action(ActionKind.EMBED_BACKWARD, self.chunks[0].embed_backwards - 1))
        return version

    @property
    def embed_forwards(self) -> int:
        return self.chunks[0].embed_forwards

    @property
    def embed_backwards(self) -> int:
        return self.chunks[0].embed_backwards

    @property
    def vocab_forwards(self) -> int:
        return self.chunks[0].vocab_forwards

    @property
    def vocab_backwards(self) -> int:
        return self.chunks[0].vocab_backwards

    def _note(self, action: Action) -> None:
        self.recent.append(action)
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        self.peak_held = max(self.peak_held, self.held)
