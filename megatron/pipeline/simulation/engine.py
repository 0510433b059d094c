"""The discrete-event engine: the runtime's own schedule definitions against a clock.

`simulate` drives a `Schedule`'s `next_action` exactly as the runtime does, each stage keeping
the same `StageState` (counters, views, action checks), with compute and transfers replaced by
durations; `SimulationResult` (`results`) holds what it measured.

Execution model (what the runtime does, minus the tensors):

* Calls. A run is `steps` calls of the schedule, as the training loop makes one per iteration.
  Call k (1-based) has ``backward_target = k * m`` and, for the whole run,
  ``forward_limit = steps * m`` (the data ends there; nothing needs to drain earlier). Counters
  are cumulative. Stages are not synchronized between calls: a stage whose call k returns DONE
  starts call k + 1 at once.
* A stage is idle or busy. When idle it builds a `StageView` (``input_ready``: the first stage
  always, otherwise the activation of microbatch ``forwards`` has arrived; ``grad_ready``: the
  last stage when it has a microbatch in flight (its own loss), otherwise the output gradient
  of microbatch ``backwards`` has arrived) and asks `next_action`:

  - FORWARD / BACKWARD / WEIGHT_GRAD run for their cost. A FORWARD or BACKWARD whose input has
    not arrived yet (static schedules such as 1F1B-flush ask for them in a fixed order) blocks
    the stage until it arrives and then runs;
  - STEP runs for ``step_cost`` and raises the stage's weight version by one;
  - WAIT idles the stage until the next arrival at it, then it asks again;
  - DONE ends the stage's call.

* A forward's output reaches stage s + 1 at its end + ``p2p_latency``; a backward's input
  gradient reaches stage s - 1 at its end + ``p2p_latency``. Events at the same instant are all
  applied before any idle stage decides, stages deciding in stage order.
* ``p2p_latency`` is pure delay: it occupies no stage, and nothing hides it. The 1F1B in-flight
  window (N - s, PACI's admission too) covers exactly the compute of a round trip, so every
  transfer shows: PACI's steady state is then N(F+B) / (N(F+B) + 2(N-1)L) busy, not 1.
* Virtual stages. A schedule with a placement (`Schedule.placement`) runs v model chunks on each
  of the N ranks (``chunks_per_rank``); a "stage" of the engine and of the results is then a
  rank. Each chunk keeps its own counters and arrivals; a forward of virtual stage k feeds
  k + 1 and a backward feeds k - 1, after ``p2p_latency`` when that virtual stage lives on
  another rank and at once when it is on the same rank (the V shape's turn). Forward, backward
  and weight-gradient costs are then per virtual stage (a number: every chunk; a list: S = N * v
  values, by virtual stage), the step cost per rank. The last virtual stage has its own loss.
* A vocabulary split over the ranks (a schedule with `vocab_passes`): the last stage's forward
  sends its hidden state to every rank (to itself at once), each rank's VF sends its shard's
  output to the last stage, whose backward of a microbatch waits for every shard's and then
  sends the statistics to every rank for their VB; each message after ``p2p_latency``. VF and
  VB cost ``vocab_forward_cost`` and ``vocab_backward_cost`` per rank. With the input
  embedding split too (`embedding_passes`), each rank's EF sends its part to the first stage,
  whose forward of a microbatch waits for every rank's, and the first stage's backward sends
  the embedding's gradient to every rank for its EB (``embed_forward_cost``,
  ``embed_backward_cost``).
* A link model (``communication``, `links.Communication`; without it every transfer takes
  ``p2p_latency`` and nothing else is counted): each pipeline message takes its link's time
  (intra- or inter-node), the output layer's vocabulary messages travel on the runtime's tree
  (`Communication.vocab_tree_arity`, `tree_arrival`: down, each rank forwards to its children
  one after another on its link; up, the path's hops), the input embedding's queue on the link
  of the rank that sends them to every rank or gathers them (one after another), and each
  step waits for its data-parallel reduction, which starts when the step's last gradient
  pass (B, or W when split; the vocabulary split's VB and EB too) ends, or with
  ``overlap_grad_reduce`` when the last B (or W) begins; the parameters' all-gather (distributed optimizer) follows
  the step. With ``deferred_step`` the reduction is launched at the step and the stage goes
  on: only the backward where the update lands waits for it. A wait is charged to the
  action that waits; an expert all-to-all is added to each forward and input-gradient
  backward (blocking, as Megatron's dispatcher is).
* Costs are per stage (a number is used for every stage). With ``noise`` (`costs.CostNoise`) each
  action's cost is its nominal cost times a seeded lognormal factor of mean 1 (per-stage CV). A schedule without a split backward
  pays ``backward_cost + weight_grad_cost`` per backward; a split one (ZB-H1) pays
  ``backward_cost`` for the input-gradient pass B and ``weight_grad_cost`` for W.
"""

import heapq
import math
from typing import Sequence

from ..schedules import placement as placements
from ..schedules.base import Action, ActionKind, Schedule, StageView, Transfer, kind_info
from ..stage_state import IllegalActionError, RankState
from ..trace import TraceEvent
from ..vocab_tree import VocabTree
from .costs import CostNoise
from .links import Communication
from .results import SimulationResult, steady_utilization

_FINISH, _ACTIVATION, _GRADIENT, _HIDDEN, _SHARD, _STATS, _EMBED, _EMBED_GRAD = range(8)
# the events a transfer becomes at its receiver
_EVENT_OF = {
    Transfer.ACTIVATION: _ACTIVATION,
    Transfer.GRADIENT: _GRADIENT,
    Transfer.HIDDEN: _HIDDEN,
    Transfer.SHARD_OUTPUT: _SHARD,
    Transfer.LOGIT_STATS: _STATS,
    Transfer.EMBEDDING: _EMBED,
    Transfer.EMBEDDING_GRADIENT: _EMBED_GRAD,
}
# counted by sender at the receiver: each rank's shard output and embedding part
_BY_SENDER = (_SHARD, _EMBED)
# the vocabulary split's messages by `Communication.message_s` kind; one rank sends the first
# three to every rank (through its outbound link, one after another) and gathers the last two
_MESSAGE_KIND = {_HIDDEN: "hidden", _STATS: "stats", _EMBED_GRAD: "embed_grad",
                 _SHARD: "shard", _EMBED: "embed"}  # fmt: skip
_FAN_IN = (_SHARD, _EMBED)
# the output layer's messages travel on a tree (`VocabTree`); the input embedding's on the fan
_TREE = (_HIDDEN, _STATS, _SHARD)


class SimulationError(RuntimeError):
    """The schedule did something impossible (a deadlock, an action that cannot run)."""


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    """Broadcast a number to every stage, or check a per-stage sequence; finite and >= 0."""
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    elif isinstance(value, str):
        raise ValueError(f"{name}: expected a number or one number per stage, got {value!r}")
    else:
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(f"{name}: {len(values)} values given for {num_stages} stages")
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}: costs must be finite and >= 0, got {v}")
    return values


class _Stage:
    """One simulated stage (a rank): the shared `RankState` plus what only a clock has
    (arrivals, busy time) and what only the simulator measures (stashed versions, delay)."""

    def __init__(self, state: RankState):
        self.state = state
        self.index = state.rank
        self.call_ends: list[float] = []
        self.finished = False
        self.busy = False
        self.current: tuple[Action, float] | None = None
        self.blocked: Action | None = None  # a FORWARD/BACKWARD waiting for its input
        self.waiting = False  # WAIT: ask again at the next arrival
        # Per chunk; arrivals are in microbatch order (FIFO, fixed latency)
        self.activations_arrived = [0] * len(state.chunks)
        self.gradients_arrived = [0] * len(state.chunks)
        self.busy_time = 0.0
        self.busy_intervals: list[tuple[float, float]] = []
        self.backward_ends: dict[int, float] = {}  # microbatch -> end of its backward
        self.stash: dict[int, int] = {}  # version -> in-flight microbatches that stashed it
        self.pending_grads: list[int] = []  # forward versions of gradients not yet applied
        self.pending_updates = 0  # deferred steps not applied yet (deferred_step)
        self.backwards_since_step = 0
        self.max_drift = 0
        self.drift_sum = 0
        self.drift_count = 0
        self.max_delay = 0
        self.peak_extra_versions = 0
        # a vocabulary split over the ranks: arrivals in microbatch order, and on the last
        # rank the shard outputs from each rank; the shard's drift (steps between VF and VB)
        self.arrived = {_HIDDEN: 0, _STATS: 0, _EMBED_GRAD: 0}
        self.from_rank = {_SHARD: [], _EMBED: []}
        self.max_shard_drift = 0
        self.max_embed_drift = 0
        # a link model (`Communication`): when the rank's links are free for the vocabulary
        # split's fan-out and fan-in, the step's gradient pass, and when the reduction is done
        self.outbound_free = 0.0
        self.inbound_free = 0.0
        self.gradient_pass = (0.0, 0.0)  # (latest B or W's start, latest gradient pass's end)
        self.reduction_end = 0.0


class _Simulator:
    def __init__(
        self,
        schedule,
        placement,
        m,
        steps,
        costs,
        p2p_latency,
        record_timeline,
        noise=None,
        vocab_costs=None,
        communication: Communication | None = None,
    ):
        self.schedule = schedule
        self.comm = communication
        self.noise = noise
        self.placement = placement
        self.n = placement.num_ranks
        self.last_virtual_stage = placement.num_virtual_stages - 1
        self.m = m
        self.calls = steps
        self.deferred_step = 0
        self.forward_cost, self.backward_cost, self.wgrad_cost, self.step_cost = costs
        self.latency = p2p_latency
        self.stages = [_Stage(self._new_state(s)) for s in range(self.n)]
        # the rank of the last virtual stage takes the shards' outputs, of the first the parts
        last_rank, _ = placement.locate(self.last_virtual_stage)
        self.stages[last_rank].from_rank[_SHARD] = [0] * self.n
        # with a link model the output layer's messages travel on the runtime's tree
        arity = communication.vocab_tree_arity if communication is not None else self.n
        self.vocab_tree = VocabTree(self.n, last_rank, max(arity, 1))
        self._broadcast: tuple | None = None  # (kind, time): arrival per tree edge
        self.stages[placement.locate(0)[0]].from_rank[_EMBED] = [0] * self.n
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.timeline: list[TraceEvent] | None = [] if record_timeline else None
        if schedule.splits_backward:
            self.full_backward_cost = self.backward_cost
        else:
            self.full_backward_cost = [b + w for b, w in zip(self.backward_cost, self.wgrad_cost)]
        # the cost per virtual stage (per rank for STEP) of each kind that runs (KIND_INFO)
        self.cost_by_kind = {
            ActionKind.FORWARD: self.forward_cost,
            ActionKind.BACKWARD: self.full_backward_cost,
            ActionKind.WEIGHT_GRAD: self.wgrad_cost,
            ActionKind.STEP: self.step_cost,
        }
        self.cost_by_kind.update(vocab_costs or {})
        # the pass that completes a microbatch's layer gradients (the bucketed overlap starts
        # in the step's last one), and the vocabulary split's row gradients (VB, EB: reduced
        # at the step, so the reduction at the step waits for them too)
        self.layer_gradient_kind = (
            ActionKind.WEIGHT_GRAD if schedule.splits_backward else ActionKind.BACKWARD
        )
        self.gradient_kinds = (self.layer_gradient_kind, ActionKind.VOCAB_BACKWARD,
                               ActionKind.EMBED_BACKWARD)  # fmt: skip

    def _new_state(self, rank: int) -> RankState:
        state = RankState(
            rank,
            self.placement,
            self.schedule.name,
            splits_backward=self.schedule.splits_backward,
            chunked=self.schedule.placement is not None,
        )
        state.begin_call(self.m, forward_limit=self.calls * self.m)
        return state

    # -- events -----------------------------------------------------------------------------

    def push(self, time: float, kind: int, stage: int, chunk: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, stage, chunk))

    def run(self) -> None:
        dirty = set(range(self.n))
        while True:
            for s in sorted(dirty):
                self.decide(self.stages[s])
            dirty.clear()
            if not self.events:
                break
            self.now = self.events[0][0]
            while self.events and self.events[0][0] <= self.now:
                _, _, kind, s, chunk = heapq.heappop(self.events)
                if self.apply(kind, self.stages[s], chunk):
                    dirty.add(s)
        unfinished = [st for st in self.stages if not st.finished]
        if unfinished:
            states = "; ".join(self.describe(st) for st in unfinished)
            raise SimulationError(f"{self.schedule.name}: deadlock at t={self.now:g}: {states}")

    def describe(self, st: _Stage) -> str:
        state = "blocked on " + str(st.blocked) if st.blocked else "waiting"
        return f"{st.state.describe()}, {state}"

    def apply(self, kind: int, st: _Stage, chunk: int) -> bool:
        """Apply one event; True when the stage must decide again."""
        if kind == _FINISH:
            self.finish(st)
            return True
        self.arrive(st, kind, chunk)
        if st.blocked is not None and self.input_ready(st, st.blocked):
            action, st.blocked = st.blocked, None
            self.start(st, action)
            return False
        if st.waiting:
            st.waiting = False
            return True
        return False

    @staticmethod
    def arrive(st: _Stage, kind: int, chunk: int) -> None:
        """Count an arrival; `chunk` is the sending rank for a shard's output."""
        if kind == _ACTIVATION:
            st.activations_arrived[chunk] += 1
        elif kind == _GRADIENT:
            st.gradients_arrived[chunk] += 1
        elif kind in _BY_SENDER:
            st.from_rank[kind][chunk] += 1
        else:
            st.arrived[kind] += 1

    # -- decisions --------------------------------------------------------------------------

    def view(self, st: _Stage) -> StageView:
        inputs, grads = [], []
        for c in range(len(st.state.chunks)):
            inputs.append(self.activation_ready(st, c))
            grads.append(self.gradient_ready(st, c))
        state = st.state
        vocab = (
            st.arrived[_HIDDEN] > state.vocab_forwards,
            st.arrived[_STATS] > state.vocab_backwards,
            st.arrived[_EMBED_GRAD] > state.embed_backwards,
        )
        return state.view(inputs_ready=inputs, grads_ready=grads, vocab_ready=vocab)

    def activation_ready(self, st: _Stage, c: int) -> bool:
        """The input of the chunk's next forward is there: on the first stage its own data
        (with the input embedding split, every rank's part of it)."""
        chunk = st.state.chunks[c]
        if chunk.stage != 0:
            return st.activations_arrived[c] > chunk.forwards
        if self.schedule.embedding_passes:
            return min(st.from_rank[_EMBED]) > chunk.forwards
        return True

    def gradient_ready(self, st: _Stage, c: int) -> bool:
        """The output gradient of the chunk's next backward is there: on the last virtual
        stage its own loss (with the vocabulary split, every shard's output of it)."""
        chunk = st.state.chunks[c]
        if chunk.stage != self.last_virtual_stage:
            return st.gradients_arrived[c] > chunk.backwards
        if self.schedule.vocab_passes:
            return min(st.from_rank[_SHARD]) > chunk.backwards
        return chunk.inflight > 0

    def input_ready(self, st: _Stage, action: Action) -> bool:
        """Whether the inputs of the action, and of the passes run together with it, are there."""
        for part in action.passes:
            needs = kind_info(part.kind).needs
            if needs is None:
                continue
            c = st.state.chunk_of(part)
            if needs is Transfer.ACTIVATION:
                ready = self.activation_ready(st, c)
            elif needs is Transfer.GRADIENT:
                ready = self.gradient_ready(st, c)
            elif needs is Transfer.HIDDEN:
                ready = st.arrived[_HIDDEN] > st.state.vocab_forwards
            elif needs is Transfer.EMBEDDING_GRADIENT:
                ready = st.arrived[_EMBED_GRAD] > st.state.embed_backwards
            else:
                ready = st.arrived[_STATS] > st.state.vocab_backwards
            if not ready:
                return False
        return True

    def decide(self, st: _Stage) -> None:
        """Ask the schedule what an idle stage does next, until it starts, blocks or waits."""
        while not (st.finished or st.busy or st.blocked or st.waiting):
            action = self.schedule.next_action(self.view(st))
            kind = action.kind
            if kind is ActionKind.DONE:
                st.call_ends.append(self.now)
                st.finished = st.state.calls >= self.calls
                if not st.finished:
                    st.state.begin_call(self.m, forward_limit=self.calls * self.m)
            elif kind is ActionKind.WAIT:
                st.waiting = True
            else:
                self.check(st, action)
                waits_for_input = any(kind_info(part.kind).needs for part in action.passes)
                if waits_for_input and not self.input_ready(st, action):
                    st.blocked = action
                else:
                    self.start(st, action)

    def check(self, st: _Stage, action: Action) -> None:
        """Reject actions no runtime could carry out (the runtime's own check)."""
        try:
            st.state.check(action)
        except IllegalActionError as error:
            raise SimulationError(str(error)) from None

    # -- execution --------------------------------------------------------------------------

    def start(self, st: _Stage, action: Action) -> None:
        s, kind = st.index, action.kind
        cost = self.cost_of(st, action)
        if self.comm is not None:
            cost += self.communication_wait(st, action)
        if kind is ActionKind.STEP:
            self.on_step(st)
        st.busy = True
        st.current = (action, self.now)
        self.push(self.now + cost, _FINISH, s)

    def communication_wait(self, st: _Stage, action: Action) -> float:
        """Seconds the action waits for the data-parallel reduction (charged to it): a step
        for what is still in flight of its reduction (plus the parameters' all-gather after
        it); under the deferred step, the backward where the update lands. Records when the
        step's gradient pass ran (`Communication.overlap_grad_reduce` starts it there)."""
        comm, s = self.comm, st.index
        if any(part.kind is self.layer_gradient_kind for part in action.passes):
            st.gradient_pass = (self.now, st.gradient_pass[1])
        if action.kind is ActionKind.STEP:
            start, end = st.gradient_pass
            launch = start if comm.overlap_grad_reduce else end
            if self.deferred_step and not comm.overlap_grad_reduce:
                launch = self.now  # launched at the step; the stage goes on
            launch = max(launch, st.reduction_end)  # one reduction at a time on the link
            st.reduction_end = launch + comm.reduce_of(s)
            if self.deferred_step:
                st.reduction_end += comm.gather_of(s)
                return 0.0
            return max(0.0, st.reduction_end - self.now) + comm.gather_of(s)
        lands = st.pending_updates and st.backwards_since_step + 1 == self.deferred_step
        if lands and any(part.kind is ActionKind.BACKWARD for part in action.passes):
            return max(0.0, st.reduction_end - self.now)
        return 0.0

    def cost_of(self, st: _Stage, action: Action) -> float:
        """The action's duration: the nominal cost of its virtual stage (the rank's, for a
        step), times the rank's noise factor if any; passes run together add up (the
        simulator does not model an overlap's speed-up)."""
        return sum(self.pass_cost(st, part) for part in action.passes)

    def pass_cost(self, st: _Stage, action: Action) -> float:
        s, state, kind = st.index, st.state, action.kind
        nominal, info = self.cost_by_kind.get(kind), kind_info(kind)
        if nominal is None:
            raise SimulationError(f"{self.schedule.name}: the simulator has no cost for {action}")
        at = state.chunks[state.chunk_of(action)].stage if info.per_chunk else s
        expert = self.expert_cost(s, kind)
        if self.noise is None:
            return nominal[at] + expert
        factor = self.noise.factor(s, kind.value, getattr(state, info.counter))
        return nominal[at] * factor + expert

    def expert_cost(self, rank: int, kind: ActionKind) -> float:
        """The expert all-to-alls inside a forward and an input-gradient backward."""
        if self.comm is None or kind not in (ActionKind.FORWARD, ActionKind.BACKWARD):
            return 0.0
        forward, backward = self.comm.expert_of(rank)
        return forward if kind is ActionKind.FORWARD else backward

    def finish(self, st: _Stage) -> None:
        action, start = st.current
        st.busy, st.current = False, None
        st.busy_time += self.now - start
        st.busy_intervals.append((start, self.now))
        unknown = [part for part in action.passes if part.kind not in self._FINISHED]
        if unknown:
            raise SimulationError(f"{self.schedule.name}: the simulator cannot run {unknown[0]}")
        if any(part.kind in self.gradient_kinds for part in action.passes):
            st.gradient_pass = (st.gradient_pass[0], self.now)  # the last gradient pass's end
        if self.timeline is not None:
            self.timeline.append(TraceEvent(st.index, action, start, self.now))
        sends = []  # passes run together send their outputs when the slot ends
        for part in action.passes:
            self._FINISHED[part.kind](self, st, part)
            sends += self._sends_of(st, part)
        for virtual_stage, kind in sends:
            self.send(st, virtual_stage, kind)

    def _sends_of(self, st: _Stage, part: Action) -> list[tuple[int, int]]:
        """(virtual stage, transfer) that `part` sends when its slot ends (KIND_INFO)."""
        info = kind_info(part.kind)
        if info.sends is Transfer.SHARD_OUTPUT:  # to the last stage, from this rank
            return [(self.last_virtual_stage, _SHARD)]
        if info.sends is Transfer.EMBEDDING:  # to the first stage, from this rank
            return [(0, _EMBED)]
        if info.sends is None:
            return []
        virtual_stage = st.state.chunks[st.state.chunk_of(part)].stage
        sends = []
        if virtual_stage == self.last_virtual_stage and self.schedule.vocab_passes:
            if info.output_sends is not None:  # to every rank
                sends = [(-rank - 1, _EVENT_OF[info.output_sends]) for rank in range(self.n)]
        if virtual_stage == 0 and self.schedule.embedding_passes and info.input_sends:
            sends += [(-rank - 1, _EVENT_OF[info.input_sends]) for rank in range(self.n)]
        if info.sends is Transfer.ACTIVATION and virtual_stage < self.last_virtual_stage:
            sends.append((virtual_stage + 1, _ACTIVATION))
        if info.sends is Transfer.GRADIENT and virtual_stage > 0:
            sends.append((virtual_stage - 1, _GRADIENT))
        return sends

    def _finished_forward(self, st: _Stage, part: Action) -> None:
        self.on_forward(st, st.state.chunk_of(part), part.microbatch)

    def _finished_backward(self, st: _Stage, part: Action) -> None:
        self.on_backward(st, st.state.chunk_of(part))
        st.backward_ends[part.microbatch] = self.now  # the rank's last backward of it

    def _finished_weight_grad(self, st: _Stage, part: Action) -> None:
        self.gradient_done(st, st.state.record_weight_grad(st.state.chunk_of(part)))

    def _finished_step(self, st: _Stage, part: Action) -> None:
        st.state.record_step()
        if self.deferred_step:
            st.pending_updates += 1
        st.backwards_since_step = 0
        self.count_versions(st)

    def _finished_vocab_forward(self, st: _Stage, part: Action) -> None:
        st.state.record_vocab_forward()

    def _finished_vocab_backward(self, st: _Stage, part: Action) -> None:
        version = st.state.record_vocab_backward()
        st.max_shard_drift = max(st.max_shard_drift, st.state.steps - version)

    def _finished_embed_forward(self, st: _Stage, part: Action) -> None:
        st.state.record_embed_forward()

    def _finished_embed_backward(self, st: _Stage, part: Action) -> None:
        version = st.state.record_embed_backward()
        st.max_embed_drift = max(st.max_embed_drift, st.state.steps - version)

    # What the end of each kind that runs does to the state (schedules.base.KIND_INFO).
    _FINISHED = {
        ActionKind.FORWARD: _finished_forward,
        ActionKind.BACKWARD: _finished_backward,
        ActionKind.WEIGHT_GRAD: _finished_weight_grad,
        ActionKind.STEP: _finished_step,
        ActionKind.VOCAB_FORWARD: _finished_vocab_forward,
        ActionKind.VOCAB_BACKWARD: _finished_vocab_backward,
        ActionKind.EMBED_FORWARD: _finished_embed_forward,
        ActionKind.EMBED_BACKWARD: _finished_embed_backward,
    }

    def send(self, st: _Stage, virtual_stage: int, kind: int) -> None:
        """A transfer for `virtual_stage` (-1 - r: rank r itself, for the vocabulary's
        messages to every rank): after the latency on another rank, at once (no transfer) on
        this one. A shard's output is counted by its sender."""
        if virtual_stage < 0:
            rank, chunk = -virtual_stage - 1, 0
        else:
            rank, chunk = self.placement.locate(virtual_stage)
        if kind in _BY_SENDER:
            chunk = st.index
        if rank != st.index:
            self.push(self.arrival_time(st, rank, kind), kind, rank, chunk)
        else:  # the rank is finishing an action: it will decide anyway
            self.arrive(st, kind, chunk)

    def arrival_time(self, st: _Stage, rank: int, kind: int) -> float:
        """When a message sent now from `st` reaches `rank`: after the fixed latency, or with
        a link model after its link's time; the vocabulary split's messages queue on the link
        of the rank that sends them to every rank, or that gathers them."""
        if self.comm is None:
            return self.now + self.latency
        name = _MESSAGE_KIND.get(kind)
        matrix = self.comm.message_s.get(name, self.comm.hop_s)
        seconds = matrix[st.index][rank]
        if name is None and not self.comm.one_link_per_rank:
            return self.now + seconds
        if kind in _TREE:
            return self.tree_arrival(matrix, rank, kind)
        if kind in _FAN_IN:
            receiver = self.stages[rank]
            receiver.inbound_free = max(self.now, receiver.inbound_free) + seconds
            return receiver.inbound_free
        st.outbound_free = max(self.now, st.outbound_free) + seconds
        return st.outbound_free

    def tree_arrival(self, matrix, rank: int, kind: int) -> float:
        """The output layer's messages on the tree (`VocabTree`, as the runtime sends them):
        down (hidden state, statistics), each node forwards on arrival to its children one
        after another through its outbound link, each edge once per broadcast; up (a shard's
        output), the path's hops to the root, the combines free and the reduction's links
        not queued (one message per link and microbatch)."""
        tree = self.vocab_tree
        if kind == _SHARD:
            path = tree.path(rank)[::-1]
            hops = sum(matrix[a][b] for a, b in zip(path, path[1:]))
            if not self.comm.one_link_per_rank or len(path) < 2:
                return self.now + hops
            sender = self.stages[path[0]]  # the first hop waits for the sender's link
            start = max(self.now, sender.outbound_free)
            sender.outbound_free = start + matrix[path[0]][path[1]]
            return start + hops
        if self._broadcast is None or self._broadcast[0] != (kind, self.now):
            arrivals = {tree.root: self.now}
            for parent in sorted(range(self.n), key=tree.depth):  # in the runtime's order
                sender = self.stages[parent]
                for child in tree.children(parent):
                    sender.outbound_free = max(arrivals[parent], sender.outbound_free)
                    sender.outbound_free += matrix[parent][child]
                    arrivals[child] = sender.outbound_free
            self._broadcast = ((kind, self.now), arrivals)
        return self._broadcast[1][rank]

    # -- versions, drift, delay ---------------------------------------------------------------

    def on_forward(self, st: _Stage, chunk: int, mb: int) -> None:
        state = st.state
        version = state.steps - st.pending_updates
        pinned = self.schedule.forward_weight_version
        if pinned is not None:
            version = pinned(mb, self.m, state.steps)
            if version > state.steps:
                raise SimulationError(
                    f"{self.schedule.name}: stage {st.index}: forward {mb} needs weight version "
                    f"{version}, only {state.steps} exist"
                )
        state.record_forward(chunk, version)
        if self.schedule.stashes_weights:
            st.stash[version] = st.stash.get(version, 0) + 1
            self.count_versions(st)

    def on_backward(self, st: _Stage, chunk: int) -> None:
        st.backwards_since_step += 1
        if st.pending_updates and st.backwards_since_step == self.deferred_step:
            st.pending_updates -= 1  # landed just before this backward
        version = st.state.record_backward(chunk)
        applied = st.state.steps - st.pending_updates
        drift = 0 if self.schedule.stashes_weights else applied - version
        st.max_drift = max(st.max_drift, drift)
        st.drift_sum += drift
        st.drift_count += 1
        if not self.schedule.splits_backward:
            self.gradient_done(st, version)

    def gradient_done(self, st: _Stage, version: int) -> None:
        """A microbatch's weight gradient is accumulated: it waits for the next step."""
        st.pending_grads.append(version)
        if self.schedule.stashes_weights:
            st.stash[version] -= 1
            if not st.stash[version]:
                del st.stash[version]

    def on_step(self, st: _Stage) -> None:
        for version in st.pending_grads:
            st.max_delay = max(st.max_delay, st.state.steps - version)
        st.pending_grads.clear()

    def count_versions(self, st: _Stage) -> None:
        if self.schedule.stashes_weights:
            versions = len(st.stash) + (0 if st.state.steps in st.stash else 1)
            st.peak_extra_versions = max(st.peak_extra_versions, versions - 1)

    # -- results ------------------------------------------------------------------------------

    def result(self) -> SimulationResult:
        n, stages = self.n, self.stages
        makespan = max((max(st.call_ends) for st in stages), default=0.0)
        busy = [st.busy_time for st in stages]
        util = [b / makespan if makespan > 0 else 1.0 for b in busy]
        mean_util = sum(util) / n
        steady = steady_utilization(
            {st.index: st.backward_ends for st in stages},
            [st.busy_intervals for st in stages],
            n,
            self.m,
            self.calls,
        )
        total = self.calls * self.m
        return SimulationResult(
            schedule=self.schedule.name,
            num_stages=n,
            microbatches_per_step=self.m,
            steps=self.calls,
            makespan=makespan,
            busy_per_stage=busy,
            utilization=util,
            mean_utilization=mean_util,
            bubble_fraction=1.0 - mean_util,
            steady_utilization=steady,
            steady_bubble_fraction=None if steady is None else 1.0 - sum(steady) / n,
            idle_per_step=[(makespan - b) / self.calls for b in busy],
            throughput_vs_ideal=max(busy) / makespan if makespan > 0 else 1.0,
            microbatches_per_second=total / makespan if makespan > 0 else math.inf,
            max_drift_per_stage=[st.max_drift for st in stages],
            mean_drift_per_stage=[st.drift_sum / max(st.drift_count, 1) for st in stages],
            max_gradient_delay_per_stage=[st.max_delay for st in stages],
            peak_inflight_per_stage=[st.state.peak_inflight for st in stages],
            extra_weight_versions=[self.schedule.extra_weight_versions(s, n) for s in range(n)],
            measured_extra_weight_versions=[st.peak_extra_versions for st in stages],
            optimizer_steps_per_stage=[st.state.steps for st in stages],
            timeline=self.timeline or [],
            placement=self.placement.shape if self.schedule.placement is not None else None,
            chunks_per_rank=self.placement.chunks_per_rank,
            virtual_stages_per_rank=[self.placement.stages_of(s) for s in range(n)],
            peak_held_per_stage=[st.state.peak_held for st in stages],
            max_shard_drift_per_stage=(
                [st.max_shard_drift for st in stages] if self.schedule.vocab_passes else None
            ),
            max_embed_drift_per_stage=(
                [st.max_embed_drift for st in stages] if self.schedule.embedding_passes else None
            ),
        )


def _check_arguments(
    schedule: Schedule, num_stages, microbatches_per_step, steps, p2p_latency, chunks_per_rank
):
    counts = {"num_stages": num_stages, "microbatches_per_step": microbatches_per_step}
    for name, value in {**counts, "steps": steps, "chunks_per_rank": chunks_per_rank}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule.placement is None and chunks_per_rank != 1:
        raise ValueError(
            f"{schedule.name} runs one model chunk per stage, got {chunks_per_rank} per rank"
        )
    if schedule.check_microbatches is not None:
        schedule.check_microbatches(num_stages, chunks_per_rank, microbatches_per_step)
    least = schedule.min_microbatches_per_step(num_stages)
    if microbatches_per_step < least:
        raise ValueError(
            f"{schedule.name} needs at least {least} microbatches per step on {num_stages} "
            f"stages, got {microbatches_per_step}"
        )
    if not math.isfinite(p2p_latency) or p2p_latency < 0:
        raise ValueError(f"p2p_latency must be finite and >= 0, got {p2p_latency}")


def _check_communication(communication, p2p_latency, num_stages) -> None:
    if communication is None:
        return
    if p2p_latency:
        raise ValueError("give p2p_latency or communication, not both")
    communication.check(num_stages)


def _vocab_costs(schedule: Schedule, num_stages: int, costs: tuple) -> dict:
    """VF, VB, EF and EB costs per rank, from their costs in that order; only a schedule that
    places a kind may have a cost for it."""
    kinds = {
        ActionKind.VOCAB_FORWARD: ("vocab_forward_cost", schedule.vocab_passes),
        ActionKind.VOCAB_BACKWARD: ("vocab_backward_cost", schedule.vocab_passes),
        ActionKind.EMBED_FORWARD: ("embed_forward_cost", schedule.embedding_passes),
        ActionKind.EMBED_BACKWARD: ("embed_backward_cost", schedule.embedding_passes),
    }
    per_rank = {}
    for (kind, (name, placed)), cost in zip(kinds.items(), costs):
        values = _per_stage(name, cost, num_stages)
        if any(values) and not placed:
            raise ValueError(
                f"{schedule.name} places no vocabulary passes ({kind.value}): {name} is unused"
            )
        if placed:
            per_rank[kind] = values
    return per_rank


def _pass_costs(per_chunk: int, num_stages: int, given) -> tuple:
    """(forward, backward, weight-gradient costs per virtual stage, step cost per rank)."""
    forward, backward, weight_grad, step = given
    return tuple(
        _per_stage(name, value, count)
        for name, value, count in (
            ("forward_cost", forward, per_chunk),
            ("backward_cost", backward, per_chunk),
            ("weight_grad_cost", weight_grad, per_chunk),
            ("step_cost", step, num_stages),
        )
    )


def simulate(
    schedule: Schedule,
    *,
    num_stages: int,
    microbatches_per_step: int,
    steps: int,
    forward_cost: float | Sequence[float],
    backward_cost: float | Sequence[float],
    weight_grad_cost: float | Sequence[float] = 0.0,
    step_cost: float | Sequence[float] = 0.0,
    p2p_latency: float = 0.0,
    record_timeline: bool = True,
    noise: CostNoise | None = None,
    chunks_per_rank: int | None = None,
    vocab_forward_cost: float | Sequence[float] = 0.0,
    vocab_backward_cost: float | Sequence[float] = 0.0,
    embed_forward_cost: float | Sequence[float] = 0.0,
    embed_backward_cost: float | Sequence[float] = 0.0,
    deferred_step: bool | int = False,
    communication: Communication | None = None,
) -> SimulationResult:
    """Run `steps` calls of `schedule` on `num_stages` stages and measure the run.

    Costs are durations in any unit (seconds for the CLI and the runtime's traces), one per
    stage or one number for all. `microbatches_per_step` is m for flush schedules and the
    accumulation factor a for PACI. `noise` draws each action's cost around its nominal value
    (`CostNoise`: seeded, per-stage CV). Raises ValueError for bad arguments and `SimulationError`
    when the schedule deadlocks or asks for an impossible action.

    Schedules with virtual stages (a `Schedule.placement`) run `chunks_per_rank` model chunks on
    each of the `num_stages` ranks (default: the schedule's `default_chunks_per_rank`); their
    forward, backward and weight-gradient costs are per chunk pass, one number or one per
    virtual stage, and the step cost is per rank.

    A schedule with `vocab_passes` also runs each rank's output shard: `vocab_forward_cost`
    and `vocab_backward_cost` per rank (VF, VB; the last stage's costs leave the output out);
    with `embedding_passes` its input embedding's rows too (`embed_forward_cost`,
    `embed_backward_cost`: EF, EB).

    `deferred_step` (PACI's --paci-deferred-step D): a STEP starts the update, which is applied
    just before the stage's D-th backward after it (True: the a-th, its next step's last; the
    passes in between run on the weights before it); drift is counted on the weights applied.

    `communication` (`links.Communication`) replaces ``p2p_latency`` by a link model's costs.
    """
    v = schedule.default_chunks_per_rank if chunks_per_rank is None else chunks_per_rank
    _check_arguments(schedule, num_stages, microbatches_per_step, steps, p2p_latency, v)
    place = schedule.placement or placements.interleaved  # one chunk: rank r is stage r
    placement = place(num_stages, v)
    costs = _pass_costs(placement.num_virtual_stages, num_stages,
                        (forward_cost, backward_cost, weight_grad_cost, step_cost))  # fmt: skip
    vocab_costs = _vocab_costs(schedule, num_stages, (vocab_forward_cost, vocab_backward_cost,
                                                      embed_forward_cost, embed_backward_cost))  # fmt: skip
    _check_communication(communication, p2p_latency, num_stages)
    sim = _Simulator(schedule, placement, microbatches_per_step, steps, costs, float(p2p_latency),
                     record_timeline, noise, vocab_costs, communication)  # fmt: skip
    # True: before the next step's last backward; a number D: before the D-th after the step
    sim.deferred_step = microbatches_per_step if deferred_step is True else int(deferred_step)
    sim.run()
    return sim.result()
