"""The rank runtime: asks a schedule for the next action and carries it out.

One `RankRuntime` per rank lives for the whole run, so an asynchronous schedule's in-flight
microbatches, weight version and pending receives carry over from one call to the next. The
runtime does not decide anything: ordering is the schedule's (`megatron.pipeline.schedules`),
the work itself is injected (Megatron's `forward_step_func`, an optimizer-step callable), and
tensors travel through a transport (`megatron.pipeline.transport`: torch.distributed, a
loopback, or in-process queues).

A rank runs one *lane* per model chunk: a plain pipeline has one, a schedule with virtual
stages (`Schedule.placement`: interleaved 1F1B, ZB-V, DualPipeV, PACI over virtual stages) one
per chunk, each with its own in-flight microbatches and streams. Counters, weight versions,
the `StageView` and the check of every action are the rank's `RankState`
(`megatron.pipeline.stage_state`), the same the simulator keeps: an action the rank cannot run
raises `IllegalActionError` with its state and recent actions.

One handler per action kind: forward, backward (the full backward, or with a split-backward
schedule the input gradient only: `megatron.pipeline.split_backward`), weight gradient,
optimizer step; a slot of passes run together (DualPipeV's overlapped pairs, a full backward
in a split-backward schedule) runs each of its passes in turn.

Schedules that stash weights (PipeDream-2BW, PipeDream; one lane) run each forward on the
weight version the schedule names and its backward on the same one; the older versions and the
swap are the rank's `WeightStash` (`megatron.pipeline.weight_stash`). Gradients accumulate in
the parameters' `.grad` and are applied to the live weights at the rank's step.
"""

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .accounting import SavedTensorMeter, StageStats, preserve_versions
from .p2p import decode_scale, encode_scale, scale_elements
from .schedules.base import Action, ActionKind, Schedule, StagePosition, StageView
from .schedules.placement import Placement, interleaved
from .split_backward import PendingWeightGradient, backward_input
from .stage_state import NO_LIMIT, RankState
from .trace import TraceEvent
from .transport import DistributedTransport, LaneEnds, LaneLinks, LaneStreams
from .vocab_parallel import (
    HiddenForLoss,
    InputShard,
    OutputShard,
    combine_shards,
    hidden_message,
    per_token_loss,
    read_hidden,
    stats_message,
)
from .weight_stash import WeightStash

_ACTION_CODES = list(ActionKind)
_MAX_SLOT_PASSES = 4  # passes one shared decision carries (DualPipeV's F & B, each with its W)


@dataclass
class PipelineContext(StagePosition):
    """How this rank is wired into the pipeline. Built once by `megatron.pipeline.parallel`."""

    stage: int  # the rank's position in the pipeline group
    num_stages: int
    device: torch.device
    backend: str
    activation_group: object = None  # carries activations downstream
    gradient_group: object = None  # carries gradients upstream (a second communicator)
    prev_rank: int | None = None  # global rank of the previous stage's peer
    next_rank: int | None = None
    # Tensor-parallel ranks of one stage must take identical actions; when a schedule reacts
    # to arrivals, the first TP rank decides and tells the others over this (CPU) group.
    decision_group: object = None
    decision_leader: int = 0  # global rank of the deciding TP rank
    is_decision_leader: bool = True


def plain_links(context: PipelineContext) -> list[LaneLinks]:
    """The one lane of a plain pipeline: to and from the neighbouring stages."""
    return [
        LaneLinks(
            input_peer=context.prev_rank,
            input_group=context.activation_group,
            output_peer=context.next_rank,
            output_group=context.activation_group,
            grad_in_peer=context.next_rank,
            grad_in_group=context.gradient_group,
            grad_out_peer=context.prev_rank,
            grad_out_group=context.gradient_group,
        )
    ]


@dataclass
class _InFlight:
    microbatch: int
    input_tensor: torch.Tensor | None
    output_tensor: torch.Tensor
    saved_bytes: int
    tokens: int = 0  # last stage, per-token loss: the microbatch's loss-mask count
    pending_weight_grad: PendingWeightGradient | None = None  # split backward: after B
    # last stage with a split vocabulary: the loss is computed at the backward, from the shards
    loss_func: Callable | None = None
    for_loss: HiddenForLoss | None = None


@dataclass
class _Lane:
    """One model chunk of the rank, its streams and its microbatches."""

    chunk: int
    virtual_stage: int
    module: torch.nn.Module
    is_first: bool  # virtual stage 0: reads the data, no input
    is_last: bool  # the last virtual stage: computes the loss
    streams: LaneStreams
    inflight: collections.deque = field(default_factory=collections.deque)  # forwarded, no B
    awaiting_weight_grad: collections.deque = field(default_factory=collections.deque)  # B, no W


# A token count rides on each gradient sent upstream (per-token loss) as base-256 digits,
# exact in any payload dtype (bf16 holds integers exactly only up to 256).
COUNT_DIGITS = 4


def encode_count(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    digits = [(int(count) >> (8 * i)) & 0xFF for i in range(COUNT_DIGITS)]
    return torch.tensor(digits, dtype=dtype, device=device)


def decode_count(digits: torch.Tensor) -> int:
    return sum(int(round(float(d))) << (8 * i) for i, d in enumerate(digits.tolist()))


def call_forward_limit(
    schedule, backward_target: int, num_microbatches: int, microbatches_before_drain: int | None
) -> int:
    """No forward of this call beyond the next drain (a flush drains at every call's end):
    the stage's backwards so far plus the microbatches before the drain; none without one."""
    if schedule.flushes_every_call:
        microbatches_before_drain = num_microbatches
    if microbatches_before_drain is None:
        return NO_LIMIT
    if microbatches_before_drain < num_microbatches:
        raise ValueError("microbatches_before_drain must cover this call's microbatches")
    return backward_target + microbatches_before_drain


class RankRuntime:
    """Executes schedule actions for one pipeline rank's model chunks.

    `model` is the rank's module, or with several chunks a module with `.chunks` (one per
    chunk, `ModelChunks`). `placement` says which virtual stage each chunk runs (None: one
    chunk, the rank's stage). `transport` opens the lanes' streams (default: torch.distributed
    to the neighbouring stages of `context`)."""

    def __init__(
        self,
        context: PipelineContext,
        model: torch.nn.Module,
        *,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        placement: Placement | None = None,
        transport=None,
        record_trace: bool = False,
        deterministic: bool = False,
        per_token_loss: bool = False,
        output_shard: OutputShard | None = None,
        input_shard: InputShard | None = None,
    ):
        self.context, self.model = context, model
        self.placement = placement
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.deterministic = deterministic  # reactive schedules follow their fixed order
        # --calculate-per-token-loss: the last stage backpropagates summed losses; each
        # microbatch's token count travels upstream with its gradient, and every rank sums
        # the counts of the microbatches since its last step (the step divides by them).
        self.per_token_loss = per_token_loss
        self.tokens_since_step = 0
        # Drift reports ride on the activations: every rank overwrites its own (max, mean)
        # pair and passes the others on, so the last stage (which logs) sees every rank's
        # figures, a pipeline delay old, without any extra message or synchronization.
        self.pipeline_drift = torch.zeros(2 * context.num_stages, dtype=torch.float64)
        self._init_attachments()
        # Steps the schedule took whose update is not applied yet (PACI's deferred step): the
        # weights the passes use are version `state.steps - pending_updates`.
        self.pending_updates = 0
        layout = placement or interleaved(context.num_stages, 1)
        self.state = RankState(context.stage, layout, chunked=placement is not None)
        self._gradient_passes = [0] * len(self.state.chunks)  # per chunk, since the last step
        # steps between a microbatch's forward and its backward, per chunk (bounds are per chunk)
        self.chunk_drift = [collections.Counter() for _ in self.state.chunks]
        self._forward_only_microbatches = 0  # they share the activation stream with training
        self.stats = StageStats(stage=context.stage)
        self.meter = SavedTensorMeter(model.parameters())
        self.stash: WeightStash | None = None  # weight-stashing schedules only
        self.schedule: Schedule | None = None  # the current call's
        self.trace: list[TraceEvent] | None = [] if record_trace else None
        self._reset_timers()
        self._arrivals = threading.Condition()
        self.lanes = self._open_lanes(transport := transport or self._default_transport())
        self._hold_vocabulary(output_shard, input_shard, transport)

    def _init_attachments(self) -> None:
        """What the training loop attaches to the runtime, empty until it does."""
        # fp16: the rank's loss scaler. Every gradient message carries the scale its sender
        # computed it with; the receiver rescales to its own.
        self.loss_scaler = None
        # Called with the scale of the loss gradient before every backward pass (B and W):
        # losses added inside the model (megatron-core's MoE aux loss) take it at backward
        # time, as the main loss does (1/m for flush, 1/a for PACI, the loss scale, ...).
        self.backward_scale_listeners: list[Callable[[float], None]] = []
        # Buffers that decide what a forward computes (the MoE router's expert bias): a
        # weight-stashing schedule keeps them with each weight version (`WeightStash`).
        self.versioned_buffers: list[torch.Tensor] = []
        # Told `before_final_pass(chunk)` when the pass about to run completes a chunk's
        # gradients for the coming step, and `chunk_complete(other)` for the rank's chunks
        # already done by then (a bucketed data-parallel reduction with overlap launches its
        # buckets from then on).
        self.gradient_syncs: list = []
        self.before_weight_reads: list[Callable[[], None]] = []  # see _weights_current

    def _reset_timers(self) -> None:
        self.actions_run = 0
        self.loop_s = 0.0  # time inside training calls ...
        self.wait_s = 0.0  # ... of which waiting for arrivals (busy time is in stats.busy_s)
        self.compute_s = 0.0  # ... in the model's forward and loss, backward, optimizer step
        self.transfer_s = 0.0  # ... posting sends (blocking receives count as waiting)
        self._blocked_s = 0.0  # waiting inside the current action
        self._start_time: float | None = None

    def _hold_vocabulary(self, output_shard, input_shard, transport) -> None:
        """A split vocabulary: the rank's output rows and what they scored (until VB); its
        input embedding's rows, their lookups (until EB) and the batches EF read ahead of the
        rank's own forwards (a rank that reads the data); their streams."""
        self.output_shard, self.input_shard = output_shard, input_shard
        self.shard_scores: collections.deque = collections.deque()
        self.embed_lookups: collections.deque = collections.deque()
        self.read_ahead: _ReadAhead | None = None
        self.vocab_streams = None if output_shard is None else self._open_vocab(transport)

    # ---------------------------------------------------------------- wiring
    def _default_transport(self) -> DistributedTransport:
        if self.placement is not None:
            raise ValueError("a rank with several model chunks needs their transport")
        ctx = self.context
        return DistributedTransport(
            rank=dist.get_rank(),
            links=plain_links(ctx),
            backend=ctx.backend,
            device=ctx.device,
            dtype=self.dtype,
            max_pending=2 * ctx.num_stages + 2,
        )

    def _open_lanes(self, transport) -> list[_Lane]:
        chunks = getattr(self.model, "chunks", None) if self.placement is not None else None
        total = self.state.placement.num_virtual_stages
        activation_elements = math.prod(self.tensor_shape) + self.pipeline_drift.numel()
        gradient_elements = math.prod(self.tensor_shape) + self._gradient_trailer_elements()
        lanes = []
        for chunk, state in enumerate(self.state.chunks):
            ends = LaneEnds(state.stage, total)
            streams = transport.open(
                chunk,
                ends,
                activation_elements=activation_elements,
                gradient_elements=gradient_elements,
                arrivals=self._arrivals,
            )
            module = self.model if chunks is None else chunks[chunk]
            lanes.append(
                _Lane(chunk, state.stage, module, not ends.has_input, not ends.has_output, streams)
            )
        return lanes

    def _open_vocab(self, transport):
        """The output shard's streams (a vocabulary split over the ranks)."""
        shard, context, rows = self.output_shard, self.context, self.input_shard
        return transport.open_vocab(
            context.stage,
            context.num_stages,
            self._arrivals,
            tokens=shard.tokens or math.prod(self.tensor_shape[:-1]),
            hidden_size=shard.hidden_size,
            embed_elements=None if rows is None else rows.message_elements,
            last_stage=self._last_stage_rank,
        )

    @property
    def _last_stage_rank(self) -> int:
        """The pipeline rank that holds the last virtual stage (the V placement's: rank 0)."""
        if self.placement is None:
            return self.context.num_stages - 1
        return self.placement.locate(self.placement.num_virtual_stages - 1)[0]

    @property
    def inflight_microbatches(self) -> int:
        """Microbatch-chunks whose activations the rank holds (forwarded, weight gradient not
        yet taken)."""
        return sum(len(lane.inflight) + len(lane.awaiting_weight_grad) for lane in self.lanes)

    # ---------------------------------------------------------------- calls
    def run_training(
        self,
        schedule: Schedule,
        *,
        forward_step_func: Callable,
        data_iterator,
        num_microbatches: int,
        optimizer_step_func: Callable[[], object] | None,
        microbatches_before_drain: int | None,
    ) -> list[dict]:
        """Advance the rank by one step's worth of backwards (`num_microbatches` per chunk).

        Synchronous schedules empty the pipeline by construction. Asynchronous ones leave
        microbatches in flight for the next call; `microbatches_before_drain` (counted from the
        start of this call, None for no limit) says how many more microbatches may be forwarded
        before the pipeline must be empty, so a drain never has to undo work already started.
        It equals `num_microbatches` on the call that must end drained.
        """
        if self._start_time is None:
            self._start_time = time.perf_counter()
        if self.deterministic and schedule.fixed_order is not None:
            schedule = schedule.fixed_order
        self._use_schedule(schedule)
        self._begin_call(schedule, num_microbatches, microbatches_before_drain)
        step_enabled = optimizer_step_func is not None
        work = _CallWork(forward_step_func, data_iterator, num_microbatches, optimizer_step_func)
        loop_start = time.perf_counter()
        while True:
            action = self._decide(schedule, step_enabled)
            if action.kind is ActionKind.DONE:
                break
            self.state.check(action, step_enabled=step_enabled)
            self._execute(action, work)
        self.loop_s += time.perf_counter() - loop_start
        if all(
            c.forwards == c.backwards == c.weight_grads_done == c.forward_limit
            for c in self._chunk_totals()
        ):
            self._flush_sends()
        self.stats.wall_s = time.perf_counter() - self._start_time
        self.stats.optimizer_steps = self.state.steps
        return work.losses

    def _chunk_totals(self):
        for chunk in self.state.chunks:
            done = chunk.weight_grads if chunk.splits_backward else chunk.backwards
            yield _Totals(chunk.forwards, chunk.backwards, done, chunk.forward_limit)

    def _use_schedule(self, schedule: Schedule) -> None:
        """The call's schedule; a weight-stashing one gets the rank's `WeightStash`."""
        if (schedule.placement is not None) != (self.placement is not None):
            raise RuntimeError(
                f"{schedule.name} runs {'several model chunks' if schedule.placement else 'one'}"
                f" per rank, this rank holds {len(self.lanes)}"
            )
        if schedule.stashes_weights and self.stash is None:
            if len(self.lanes) > 1:
                raise RuntimeError(f"{schedule.name} stashes weights: one model chunk per rank")
            self.stash = WeightStash(self._stage_parameters(), self.versioned_buffers)
            self.stash.live_version = self.state.steps
        elif not schedule.stashes_weights and self.stash is not None:
            raise RuntimeError(
                f"stage {self.context.stage}: {schedule.name} after a weight-stashing schedule "
                "(the stashed versions would be lost)"
            )
        if schedule.embedding_passes != (self.input_shard is not None):
            raise RuntimeError(
                f"{schedule.name}: the schedule {'places' if schedule.embedding_passes else 'has no'}"
                f" embedding passes, the rank {'holds no' if self.input_shard is None else 'holds'}"
                " input embedding rows"
            )
        if schedule.vocab_passes != (self.output_shard is not None):
            raise RuntimeError(
                f"{schedule.name}: the schedule {'places' if schedule.vocab_passes else 'has no'}"
                f" vocabulary passes, the rank {'holds no' if self.output_shard is None else 'holds an'}"
                " output shard"
            )
        self.schedule = schedule

    def _stage_parameters(self) -> list:
        """The rank's parameters, its output shard's included (stashed with them)."""
        params = list(self.model.parameters())
        shard = self.output_shard
        if shard is not None and not any(p is shard.weight for p in params):
            params.append(shard.weight)
        return params

    def _begin_call(self, schedule: Schedule, num_microbatches, microbatches_before_drain) -> None:
        """Set the call's backward target and forward limit (per chunk), and post receives."""
        state = self.state
        state.schedule_name = schedule.name
        for chunk in state.chunks:
            chunk.schedule_name, chunk.splits_backward = schedule.name, schedule.splits_backward
        state.splits_backward = schedule.splits_backward
        forward_limit = call_forward_limit(
            schedule, state.chunks[0].backward_target, num_microbatches, microbatches_before_drain
        )
        state.begin_call(num_microbatches, forward_limit)
        self._expect_inputs(forward_limit)

    def _expect_inputs(self, forward_limit: int) -> None:
        """Per lane, post the receives this call may consume, and no more: every posted
        receive must be matched by a send upstream, or its thread would wait forever.
        Activations: up to the forward limit, or as far as the schedule lets a chunk run ahead
        of its backwards (`Schedule.chunk_lookahead`; one chunk per rank: 1F1B's admission,
        `num_stages - stage - 1` beyond the backward target). Gradients: up to the target."""
        ctx, lookahead = self.context, self.schedule.chunk_lookahead
        for lane, chunk in zip(self.lanes, self.state.chunks):
            streams = lane.streams
            if streams.activations_in is not None:
                total = forward_limit
                if lookahead is not None:
                    ahead = lookahead(
                        ctx.stage, lane.chunk, self.placement, chunk.microbatches_per_step
                    )
                    total = min(total, chunk.backward_target + ahead)
                elif self.placement is None:  # the shards are one stage more (vocab_passes)
                    depth = ctx.num_stages - ctx.stage - 1 + self.schedule.vocab_passes
                    total = min(total, chunk.backward_target + depth)
                streams.activations_in.expect_total(self._forward_only_microbatches + total)
            if streams.gradients_in is not None:
                streams.gradients_in.expect_total(chunk.backward_target)
        if self.vocab_streams is not None:
            self._expect_vocab_inputs(forward_limit)

    def _expect_vocab_inputs(self, forward_limit: int) -> None:
        """Hidden states as far as this rank may forward (the last stage forwards no further),
        statistics and shard outputs up to the backward target."""
        chunk, streams = self.state.chunks[0], self.vocab_streams
        window = self.context.num_stages - self.context.stage  # one stage deeper (rule 1)
        evaluated = self._forward_only_microbatches  # they came on the same streams
        hidden = min(forward_limit, chunk.backward_target + window)
        streams.hidden_in.expect_total(evaluated + hidden)
        streams.stats_in.expect_total(chunk.backward_target)
        for inbox in streams.shard_in:
            inbox.expect_total(evaluated + chunk.backward_target)
        if streams.embed_out is not None:  # parts as far as the first stage forwards
            streams.embed_grad_in.expect_total(chunk.backward_target)
            ahead, lookahead = self.context.num_stages, self.schedule.chunk_lookahead
            if lookahead is not None:  # the first virtual stage's
                ahead = lookahead(0, 0, self.placement, chunk.microbatches_per_step)
            elif self.placement is not None:  # a virtual-stage flush: up to the limit
                ahead = forward_limit
            first = min(forward_limit, chunk.backward_target + ahead)
            for inbox in streams.embed_in:
                inbox.expect_total(evaluated + first)

    def run_forward_only(self, *, forward_step_func, data_iterator, num_microbatches) -> list:
        """Forward `num_microbatches` through every chunk with no graph kept (evaluation):
        microbatch by microbatch, the rank's chunks in the order of their virtual stages (each
        one's input is there or on its way, as every rank runs the same order). The pipeline
        must be empty."""
        if self.inflight_microbatches:
            raise RuntimeError(
                f"stage {self.context.stage} has {self.inflight_microbatches} microbatches in "
                "flight: drain the pipeline (microbatches_before_drain) before a forward-only pass"
            )
        outputs = []
        self._forward_only_microbatches += num_microbatches
        inboxes = [lane.streams.activations_in for lane in self.lanes]
        if self.vocab_streams is not None:  # the shards score every microbatch too
            inboxes += [self.vocab_streams.hidden_in, *self.vocab_streams.shard_in]
            inboxes += self.vocab_streams.embed_in
        for inbox in inboxes:
            if inbox is not None:
                inbox.expect_total(inbox.expected + num_microbatches)
        in_order = sorted(self.lanes, key=lambda lane: lane.virtual_stage)
        with torch.no_grad():
            for _ in range(num_microbatches):
                reader = None
                if self.input_shard is not None:  # every rank's part of the first input
                    reading = _data_of(data_iterator, self._reading_lane)
                    reader = _ReadAhead(reading, keep=self._reads_data)
                    self._look_up(reader)
                for lane in in_order:
                    input_tensor = None if lane.is_first else self._receive_activation(lane)
                    if lane.is_first and self.input_shard is not None:
                        self._set_input_embedding(lane, self._embedding_input())
                    data = _data_of(data_iterator, lane)
                    if reader is not None and lane is self._reading_lane:
                        data = reader
                    output, loss_func = self._call_forward_step(
                        lane, forward_step_func, data, input_tensor
                    )
                    if not lane.is_last:
                        self._send_activation(lane, output)
                    elif self.vocab_streams is None:
                        outputs.append(_loss_dict(loss_func(output)))
                    else:
                        for_loss, last_loss_func = _hidden_for_loss(output), loss_func
                        for outbox in self.vocab_streams.hidden_out:
                            outbox.send(hidden_message(for_loss, self.dtype))
                if self.vocab_streams is not None:
                    self._score_without_gradient()
                    if self.context.stage == self._last_stage_rank:
                        outputs.append(
                            _loss_dict(last_loss_func(self._losses_from_shards(for_loss)))
                        )
        self._flush_sends()
        return outputs

    def _score_without_gradient(self) -> None:
        """Evaluation with a split vocabulary: this rank's shard scores the microbatch."""
        shard, streams = self.output_shard, self.vocab_streams
        hidden, labels = read_hidden(streams.hidden_in.take(), shard.hidden_size)
        streams.shard_out.send(shard.score(hidden, labels)[1])

    def _losses_from_shards(self, for_loss: HiddenForLoss) -> torch.Tensor:
        combined = self._combined_shards(lambda inbox: inbox.take())
        return combined.per_token_loss.view(for_loss.labels.shape)

    def _combined_shards(self, take):
        """Every shard's output of the next microbatch, taken with `take`, combined."""
        messages = [take(inbox) for inbox in self.vocab_streams.shard_in]
        shard = self.output_shard
        return combine_shards(messages, shard.hidden_size, shard.group)

    def overhead_per_action_us(self) -> float:
        """Scheduling and bookkeeping per action: time in training calls that was neither
        compute (forward and loss, backward, optimizer step), nor posting a send, nor waiting
        for an arrival (or for a tensor-parallel leader's decision). It includes deciding,
        building views, receive bookkeeping, activation accounting, drift telemetry and trace
        records, whether they run between actions or inside one."""
        if not self.actions_run:
            return 0.0
        overhead = self.loop_s - self.wait_s - self.compute_s - self.transfer_s
        return 1e6 * max(overhead, 0.0) / self.actions_run

    # ---------------------------------------------------------------- deciding
    def _view(self, step_enabled: bool) -> StageView:
        inputs = [lane.is_first or lane.streams.activations_in.ready() for lane in self.lanes]
        grads = [self._gradient_ready(lane) for lane in self.lanes]
        vocab, ready = self.vocab_streams, (False, False, False)
        if vocab is not None:
            embed_grad = vocab.embed_grad_in is not None and vocab.embed_grad_in.ready()
            ready = (vocab.hidden_in.ready(), vocab.stats_in.ready(), embed_grad)
            if vocab.embed_in:  # the first stage's input: every rank's part
                inputs[0] = all(inbox.ready() for inbox in vocab.embed_in)
        return self.state.view(
            inputs_ready=inputs, grads_ready=grads, step_enabled=step_enabled, vocab_ready=ready
        )

    def _gradient_ready(self, lane: _Lane) -> bool:
        """The next backward's output gradient is there: on the last stage its own loss, or
        with a split vocabulary every shard's output of the microbatch."""
        if not lane.is_last:
            return lane.streams.gradients_in.ready()
        if self.vocab_streams is not None:
            return bool(lane.inflight) and all(i.ready() for i in self.vocab_streams.shard_in)
        return bool(lane.inflight)

    def _decide(self, schedule: Schedule, step_enabled: bool) -> Action:
        ctx = self.context
        if schedule.depends_on_arrivals and not ctx.is_decision_leader:
            wait_start = time.perf_counter()
            action = self._receive_decision()
            self.wait_s += time.perf_counter() - wait_start
            return action
        while True:
            with self._arrivals:
                action = schedule.next_action(self._view(step_enabled))
                if action.kind is not ActionKind.WAIT:
                    break
                if self._nothing_to_wait_for():
                    raise RuntimeError(f"schedule {schedule.name} waits with nothing in flight")
                wait_start = time.perf_counter()
                self._arrivals.wait(timeout=None if ctx.backend == "gloo" else 1e-4)
                self.wait_s += time.perf_counter() - wait_start
        if schedule.depends_on_arrivals and ctx.decision_group is not None:
            self._share_decision(action)
        return action

    def _nothing_to_wait_for(self) -> bool:
        vocab = self.vocab_streams
        if vocab is not None and any(inbox.outstanding() for inbox in vocab.inboxes()):
            return False
        for lane in self.lanes:
            if any(inbox.outstanding() for inbox in lane.streams.inboxes()):
                return False
            if lane.is_last and lane.inflight:
                return False
        return True

    def _share_decision(self, action: Action) -> None:
        """A reacting schedule's decision, from the first tensor-parallel rank to the others:
        kind, microbatch and chunk of each pass of the slot (a static schedule wrapped with
        the vocabulary passes, DualPipeV, runs passes together)."""
        passes = action.passes
        if len(passes) > _MAX_SLOT_PASSES:
            raise RuntimeError(f"{action}: more than {_MAX_SLOT_PASSES} passes in one slot")
        codes = [-1] * (3 * _MAX_SLOT_PASSES)
        for index, part in enumerate(passes):
            microbatch = -1 if part.microbatch is None else part.microbatch
            chunk = -1 if part.chunk is None else part.chunk
            codes[3 * index : 3 * index + 3] = [_ACTION_CODES.index(part.kind), microbatch, chunk]
        message = torch.tensor(codes)
        dist.broadcast(message, src=self.context.decision_leader, group=self.context.decision_group)

    def _receive_decision(self) -> Action:
        message = torch.empty(3 * _MAX_SLOT_PASSES, dtype=torch.int64)
        dist.broadcast(message, src=self.context.decision_leader, group=self.context.decision_group)
        passes = []
        for code, microbatch, chunk in message.view(-1, 3).tolist():
            if code < 0:
                break
            passes.append(Action(_ACTION_CODES[code], None if microbatch < 0 else microbatch,
                                 None if chunk < 0 else chunk))  # fmt: skip
        first, *together = passes
        return Action(first.kind, first.microbatch, first.chunk, tuple(together))

    # ---------------------------------------------------------------- doing
    def _execute(self, action: Action, work: "_CallWork") -> None:
        """Run one slot: the action and the passes run together with it, in order."""
        start, self._blocked_s = time.perf_counter(), 0.0
        if self._is_full_backward(action):
            self._backward(self._lane_of(action), work, split=False)
        else:
            for part in action.passes:
                self._run_pass(part, work)
        end = time.perf_counter()
        self.stats.busy_s += end - start - self._blocked_s  # waiting for an input is idle time
        self.wait_s += self._blocked_s
        self.actions_run += 1
        if self.trace is not None:  # the action starts once its input is there, as simulated
            self.trace.append(TraceEvent(self.context.stage, action, start + self._blocked_s, end))

    def _run_pass(self, part: Action, work: "_CallWork") -> None:
        handler = self._PASS_HANDLERS.get(part.kind)
        if handler is None:
            raise RuntimeError(f"the runtime cannot execute {part}")
        handler(self, part, work)

    def _run_forward(self, part: Action, work: "_CallWork") -> None:
        loss = self._forward(self._lane_of(part), work)
        if loss is not None:
            work.losses.append(loss)

    def _run_backward(self, part: Action, work: "_CallWork") -> None:
        self._backward(self._lane_of(part), work, split=self.state.splits_backward)

    def _run_weight_grad(self, part: Action, work: "_CallWork") -> None:
        self._weight_grad(self._lane_of(part))

    def _run_step(self, part: Action, work: "_CallWork") -> None:
        self._step(work.optimizer_step_func)

    def _run_vocab_forward(self, part: Action, work: "_CallWork") -> None:
        """VF: score the last stage's hidden state with this rank's output shard; with weight
        stashing on the version the rank forwarded the microbatch on."""
        shard, streams = self.output_shard, self.vocab_streams
        hidden, labels = read_hidden(self._take(streams.hidden_in), shard.hidden_size)
        version = self.state.steps  # a stashing schedule (one chunk): the forward's version
        if self.stash is not None:
            version = self.state.chunks[0].forward_versions[self.state.vocab_forwards]
        self._weights_current()  # the shard's passes are no module forward: no hook waits
        compute_start = time.perf_counter()
        with self._on_weights(version) as redirection, self.meter.measure(redirection):
            score, message = shard.score(hidden, labels)
        self.compute_s += time.perf_counter() - compute_start
        self.state.record_vocab_forward(version)
        self.shard_scores.append(score)
        self._timed_send(streams.shard_out, message)
        # the statistics of every microbatch scored will come down the tree: receive (and
        # relay to this rank's children) that many, whatever this call's backward target, so
        # that no child's VB waits for this rank's step
        streams.stats_in.expect_total(self.state.vocab_forwards)

    def _run_vocab_backward(self, part: Action, work: "_CallWork") -> None:
        """VB: the shard's weight gradient of its oldest scored microbatch."""
        stats = self._take(self.vocab_streams.stats_in)
        self._weights_current()
        compute_start = time.perf_counter()
        self.output_shard.weight_gradient(self.shard_scores.popleft(), stats)
        self.compute_s += time.perf_counter() - compute_start
        self.shard_drift[self.state.steps - self.state.record_vocab_backward()] += 1

    def _run_embed_forward(self, part: Action, work: "_CallWork") -> None:
        """EF: the next microbatch's tokens looked up in this rank's embedding rows, sent to
        the first stage; the batch is kept for this rank's own forward if it reads the data."""
        if self.read_ahead is None:
            self.read_ahead = _ReadAhead(keep=self._reads_data)
        self.read_ahead.source = _data_of(work.data_iterator, self._reading_lane)
        self.embed_lookups.append(self._look_up(self.read_ahead))
        self.state.record_embed_forward()

    def _look_up(self, reader: "_ReadAhead") -> torch.Tensor:
        rows_of = self.input_shard
        tokens = rows_of.tokens_of(reader.read_next())
        self._weights_current()
        compute_start = time.perf_counter()
        rows = rows_of.look_up(tokens)
        self.compute_s += time.perf_counter() - compute_start
        self._timed_send(self.vocab_streams.embed_out, rows.detach().reshape(-1).to(self.dtype))
        return rows

    def _run_embed_backward(self, part: Action, work: "_CallWork") -> None:
        """EB: the embedding rows' gradient of the oldest microbatch looked up, from the first
        stage's backward (brought to this rank's loss scale)."""
        payload = self._take(self.vocab_streams.embed_grad_in)
        numel = self.input_shard.message_elements
        grad = payload[:numel]
        sender, mine = decode_scale(payload[numel:]), self._loss_scale()
        if sender != mine:
            grad = grad.float() * (mine / sender)
        self._weights_current()
        compute_start = time.perf_counter()
        self.input_shard.weight_gradient(self.embed_lookups.popleft(), grad)
        self.compute_s += time.perf_counter() - compute_start
        version = self.state.record_embed_backward()
        self.stats.embed_drift_histogram[self.state.steps - version] += 1

    @property
    def _reads_data(self) -> bool:
        """Whether a forward of this rank reads the microbatch (the first or the last stage)."""
        lane = self._reading_lane
        return lane.is_first or lane.is_last

    @property
    def _reading_lane(self) -> "_Lane":
        """The lane whose data EF reads: the first virtual stage's (the tokens' reader), else
        the last's, else any: the rank's own forward of that lane then takes the batch."""
        for wanted in ("is_first", "is_last"):
            for lane in self.lanes:
                if getattr(lane, wanted):
                    return lane
        return self.lanes[0]

    def _embedding_input(self) -> torch.Tensor:
        """The first stage's input embedding: every rank's part of the next microbatch,
        summed; a leaf whose gradient goes back to every rank after the backward."""
        parts = [self._take(inbox) for inbox in self.vocab_streams.embed_in]
        numel = self.input_shard.message_elements
        combined = self.input_shard.combine([part[:numel] for part in parts])
        return combined.detach().requires_grad_(True)

    @staticmethod
    def _set_input_embedding(lane: "_Lane", embedded: torch.Tensor) -> None:
        set_embedding = getattr(lane.module, "set_input_embedding", None)
        if set_embedding is None:
            raise RuntimeError(
                "the split input embedding needs a first stage with set_input_embedding"
            )
        set_embedding(embedded)

    def _send_embedding_gradient(self, grad: torch.Tensor) -> None:
        """The first stage's backward: the input embedding's gradient to every rank's EB."""
        scale = encode_scale(self._loss_scale(), self.dtype, grad.device)
        message = torch.cat([grad.reshape(-1).to(self.dtype), scale])
        for outbox in self.vocab_streams.embed_grad_out:
            self._timed_send(outbox, message)

    @property
    def shard_drift(self) -> collections.Counter:
        """Steps the output shard took between scoring a microbatch and its weight gradient."""
        return self.stats.shard_drift_histogram

    # One handler per kind that runs (schedules.base.KIND_INFO: `runs`).
    _PASS_HANDLERS = {
        ActionKind.FORWARD: _run_forward,
        ActionKind.BACKWARD: _run_backward,
        ActionKind.WEIGHT_GRAD: _run_weight_grad,
        ActionKind.STEP: _run_step,
        ActionKind.VOCAB_FORWARD: _run_vocab_forward,
        ActionKind.VOCAB_BACKWARD: _run_vocab_backward,
        ActionKind.EMBED_FORWARD: _run_embed_forward,
        ActionKind.EMBED_BACKWARD: _run_embed_backward,
    }

    def _is_full_backward(self, action: Action) -> bool:
        """B with the W of the same microbatch in one slot, nothing older awaiting its W: one
        ordinary backward does both."""
        if action.kind is not ActionKind.BACKWARD or len(action.together) != 1:
            return False
        weight = action.together[0]
        return (
            weight.kind is ActionKind.WEIGHT_GRAD
            and weight.chunk == action.chunk
            and weight.microbatch == action.microbatch
            and not self._lane_of(action).awaiting_weight_grad
        )

    def _lane_of(self, action: Action) -> _Lane:
        return self.lanes[0 if action.chunk is None else action.chunk]

    def _call_forward_step(self, lane: _Lane, forward_step_func, data_iterator, input_tensor):
        set_input = getattr(lane.module, "set_input_tensor", None)
        if set_input is not None:
            set_input(input_tensor)
        return forward_step_func(data_iterator, lane.module)

    def _forward(self, lane: _Lane, work: "_CallWork") -> dict | None:
        input_tensor, embedded = None, None
        if not lane.is_first:
            input_tensor = self._receive_activation(lane).requires_grad_(True)
        elif self.input_shard is not None:  # the input is every rank's embedding part
            embedded = self._embedding_input()
            self._set_input_embedding(lane, embedded)
        version = self._forward_version()
        compute_start = time.perf_counter()
        with self._on_weights(version) as redirection, self.meter.measure(redirection) as saved:
            data = work.data_iterator
            if self.input_shard is not None and lane is self._reading_lane:
                data = self.read_ahead
            output, loss_func = self._call_forward_step(
                lane, work.forward_step_func, _data_of(data, lane), input_tensor
            )
            loss_dict, tokens, for_loss = None, 0, None
            if lane.is_last and self.output_shard is not None:  # the loss comes at the backward
                for_loss = _hidden_for_loss(output)
                output = for_loss.hidden
            elif lane.is_last:
                loss, tokens, loss_dict = _split_loss(loss_func(output))
                # flush scales by 1/m, PACI by 1/a, PipeDream (a step per microbatch) by 1;
                # a per-token loss is divided by the step's token count at the step instead
                if not self.per_token_loss:
                    loss = loss / self.schedule.microbatches_per_update(work.num_microbatches)
                output = loss
        self.compute_s += time.perf_counter() - compute_start
        microbatch = self.state.record_forward(lane.chunk, version)
        # the first stage's embedded input takes the input's place: B computes its gradient
        inflight = _InFlight(microbatch, input_tensor if embedded is None else embedded, output,
                             saved[0], tokens)  # fmt: skip
        if for_loss is not None:
            inflight.loss_func, inflight.for_loss = loss_func, for_loss
            message = hidden_message(for_loss, self.dtype)
            for outbox in self.vocab_streams.hidden_out:  # down the tree: every shard scores it
                self._timed_send(outbox, message)
        lane.inflight.append(inflight)
        self.stats.add_activation(saved[0], self.inflight_microbatches)
        if not lane.is_last:
            self._send_activation(lane, output)
        return loss_dict

    def _forward_version(self) -> int:
        """The weight version the next forward runs on: the current one, unless the schedule
        pins it (PipeDream-2BW: batch b on W(b-1); one lane)."""
        state, pinned = self.state.chunks[0], self.schedule.forward_weight_version
        if pinned is None:
            return state.steps - self.pending_updates
        version = pinned(state.forwards, state.microbatches_per_step, state.steps)
        if version > state.steps:
            raise RuntimeError(
                f"{self.schedule.name}: stage {self.context.stage}: forward {state.forwards} "
                f"needs weight version {version}, only {state.steps} exist"
            )
        return version

    @contextlib.contextmanager
    def _on_weights(self, version: int):
        """Run the block on weight `version`; yields the saved-tensor redirection (None when
        the schedule does not stash weights, then the current weights are used)."""
        if self.stash is None:
            yield None
            return
        with self.stash.swapped_in(version):
            yield self.stash.redirection(version)

    def _still_needed(self, version: int) -> bool:
        """A weight version is needed while a microbatch in flight was forwarded on it, or a
        forward still to come is pinned to it (2BW's next batch forwards on the version
        before the newest)."""
        state, pinned = self.state.chunks[0], self.schedule.forward_weight_version
        if version in state.forward_versions.values():
            return True
        if pinned is None:
            return False
        return version >= pinned(state.forwards, state.microbatches_per_step, state.steps)

    def _backward(self, lane: _Lane, work: "_CallWork", *, split: bool) -> None:
        """The backward of the lane's oldest microbatch in flight; with `split`, only its input
        gradient (the weight gradient waits for its WEIGHT_GRAD action)."""
        microbatch = lane.inflight.popleft()
        grad, tokens, output, shards = None, microbatch.tokens, microbatch.output_tensor, None
        if not lane.is_last:
            grad, received = self._receive_gradient(lane)
            tokens = received if self.per_token_loss else tokens
        elif microbatch.for_loss is not None:
            output, tokens, shards = self._loss_from_shards(microbatch, work)
        if lane.is_last and self.loss_scaler is not None:
            output = output * self.loss_scaler.scale  # fp16: the rank's scale, now
        version = self.state.chunks[lane.chunk].forward_versions[microbatch.microbatch]
        self._weights_current()
        self._announce_backward_scale()
        if not split:
            self._announce_gradient_pass(lane.chunk)
        compute_start = time.perf_counter()
        with self._on_weights(version):
            if split:
                microbatch.pending_weight_grad = backward_input(
                    output, grad, microbatch.input_tensor
                )
            else:
                torch.autograd.backward(output, grad_tensors=grad)
        self.compute_s += time.perf_counter() - compute_start
        if shards is not None:  # the statistics down the tree, for every shard's VB
            combined, loss_gradient = shards
            message = stats_message(combined, loss_gradient[0])
            for outbox in self.vocab_streams.stats_out:
                self._timed_send(outbox, message)
        if lane.chunk == 0:  # a microbatch's last backward on the rank: count its tokens once
            self.tokens_since_step += int(tokens)
        if not lane.is_first:
            self._send_gradient(lane, microbatch.input_tensor.grad, tokens)
        elif self.input_shard is not None:
            self._send_embedding_gradient(microbatch.input_tensor.grad)
        microbatch.input_tensor = microbatch.output_tensor = None  # the graph lives in W's part
        forward_version = self.state.record_backward(lane.chunk)
        if split:
            lane.awaiting_weight_grad.append(microbatch)
            return
        if self.state.splits_backward:  # a full backward: the W of the same slot is done too
            forward_version = self.state.record_weight_grad(lane.chunk)
        self._record_gradient_taken(lane, microbatch, forward_version)

    def _loss_from_shards(self, microbatch: _InFlight, work: "_CallWork"):
        """The last stage, split vocabulary: every shard's output combined into the per-token
        losses (differentiable in the hidden state), the loss function applied and the loss
        scaled as at the forward of an unsplit model. Returns (loss, tokens, (combined, where
        the loss's gradient lands))."""
        compute_start = time.perf_counter()
        blocked = self._blocked_s
        combined = self._combined_shards(self._take)
        compute_start += self._blocked_s - blocked  # waiting for a shard is not compute
        loss_gradient: list = []
        losses = per_token_loss(microbatch.for_loss, combined, loss_gradient)
        loss, tokens, loss_dict = _split_loss(microbatch.loss_func(losses))
        if not self.per_token_loss:
            loss = loss / self.schedule.microbatches_per_update(work.num_microbatches)
        self.compute_s += time.perf_counter() - compute_start
        work.losses.append(loss_dict)
        microbatch.for_loss = microbatch.loss_func = None
        return loss, tokens, (combined, loss_gradient)

    def _weight_grad(self, lane: _Lane) -> None:
        microbatch = lane.awaiting_weight_grad.popleft()
        self._weights_current()
        self._announce_backward_scale()
        self._announce_gradient_pass(lane.chunk)
        compute_start = time.perf_counter()
        microbatch.pending_weight_grad.run()
        self.compute_s += time.perf_counter() - compute_start
        microbatch.pending_weight_grad = None
        self._record_gradient_taken(lane, microbatch, self.state.record_weight_grad(lane.chunk))

    def _weights_current(self) -> None:
        """Before a pass that reads the stage's weights outside a module's forward (a backward,
        B, W, the vocabulary split's passes): the distributed optimizer's parameter gathers
        still in flight since the step land first (--overlap-param-gather; a forward's own
        hooks wait for what it reads)."""
        for finish in self.before_weight_reads:
            finish()

    def _announce_backward_scale(self) -> None:
        """The loss gradient's scale for this backward, to the listeners: the loss scale over
        the microbatches one update takes (with a per-token loss, the step divides instead)."""
        if not self.backward_scale_listeners:
            return
        scale = self._loss_scale()
        if not self.per_token_loss:
            microbatches = self.state.chunks[0].microbatches_per_step
            scale /= self.schedule.microbatches_per_update(microbatches)
        for listener in self.backward_scale_listeners:
            listener(scale)

    def _announce_gradient_pass(self, chunk: int) -> None:
        """A pass that accumulates weight gradients (a full backward, or W) is about to run on
        `chunk`: tell the gradient syncs when it is the last one before the step. A step takes
        `microbatches_per_update` passes per chunk (the whole rank's under an asynchronous
        schedule with several chunks, whose chunks need not take equal shares before a step);
        a flushing schedule gives each chunk exactly its share, so a chunk is done early."""
        if not self.gradient_syncs:
            return
        per_chunk = self.schedule.microbatches_per_update(
            self.state.chunks[0].microbatches_per_step
        )
        passes = self._gradient_passes
        passes[chunk] += 1
        for sync in self.gradient_syncs:  # a deferred update may land before this pass
            before = getattr(sync, "before_gradient_pass", None)
            if before is not None:
                with preserve_versions(self.model.parameters()):
                    before(chunk, sum(passes))
        last_of_step = sum(passes) == per_chunk * len(passes)
        if last_of_step or (self.schedule.flushes_every_call and passes[chunk] == per_chunk):
            compute_start = time.perf_counter()
            with preserve_versions(self.model.parameters()):  # a deferred update may land
                for sync in self.gradient_syncs:
                    if last_of_step:  # the rank's other chunks are done
                        for other in range(len(passes)):
                            if other != chunk:
                                sync.chunk_complete(other)
                    sync.before_final_pass(chunk)
            self.compute_s += time.perf_counter() - compute_start
        if sum(passes) >= per_chunk * len(passes):
            self._gradient_passes = [0] * len(passes)  # the next pass is the next step's

    def _record_gradient_taken(
        self, lane: _Lane, microbatch: _InFlight, forward_version: int
    ) -> None:
        """The microbatch's weight gradient is in: its drift (steps since its forward), and its
        activations are released."""
        steps_since_forward = self.state.steps - self.pending_updates - forward_version
        self.chunk_drift[lane.chunk][steps_since_forward] += 1
        if self.stash is None:
            self.stats.record_drift(steps_since_forward, self.state.chunks[0].microbatches_per_step)
        else:  # the backward ran on its forward's weights; the gradient is that stale
            self.stats.record_drift(0)
            self.stats.record_delay(steps_since_forward)
            self.stash.release_unneeded(self._still_needed)
        self.stats.release_activation(microbatch.saved_bytes)

    def _step(self, optimizer_step_func) -> None:
        stash = self.stash
        compute_start = time.perf_counter()
        if stash is not None and self._still_needed(stash.live_version):
            stash.keep_live_version()  # the step overwrites weights a microbatch still needs
        with preserve_versions(self.model.parameters()):
            optimizer_step_func()  # with a per-token loss it reads tokens_since_step
        if stash is not None:  # its forwards swap weight versions in: nothing may land then
            self._weights_current()
        self.compute_s += time.perf_counter() - compute_start
        self.tokens_since_step = 0
        self._gradient_passes = [0] * len(self._gradient_passes)
        self.state.record_step()
        if stash is not None:
            stash.stepped()
            stash.release_unneeded(self._still_needed)
            self.stats.extra_weight_versions = stash.peak_versions
            self.stats.extra_weight_bytes = stash.peak_bytes

    # ---------------------------------------------------------------- transfers
    def _take(self, inbox) -> torch.Tensor:
        """Next tensor of `inbox`, blocking if a static schedule asked for it before arrival."""
        waits = not inbox.ready()
        start = time.perf_counter()
        tensor = inbox.take()
        blocked = time.perf_counter() - start
        self._blocked_s += blocked
        if waits and self.vocab_streams is not None and inbox in self.vocab_streams.inboxes():
            self.stats.vocab_wait_s += blocked
        return tensor

    def _receive_activation(self, lane: _Lane) -> torch.Tensor:
        payload = self._take(lane.streams.activations_in)
        numel = payload.numel() - self.pipeline_drift.numel()
        # keep the latest figures of the other ranks (our own pair is ours to write)
        own = slice(2 * self.context.stage, 2 * self.context.stage + 2)
        mine = self.pipeline_drift[own].clone()
        self.pipeline_drift.copy_(payload[numel:])
        self.pipeline_drift[own] = mine
        return payload[:numel].view(self.tensor_shape).detach()

    def _send_activation(self, lane: _Lane, output: torch.Tensor) -> None:
        stage = self.context.stage
        self.pipeline_drift[2 * stage] = self.stats.max_drift
        self.pipeline_drift[2 * stage + 1] = self.stats.mean_drift
        telemetry = self.pipeline_drift.to(device=output.device, dtype=output.dtype)
        payload = torch.cat([output.detach().reshape(-1), telemetry])
        self._timed_send(lane.streams.activations_out, payload)

    def _timed_send(self, outbox, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        outbox.send(tensor)
        self.transfer_s += time.perf_counter() - start

    def drift_by_stage(self) -> list[tuple[int, float]]:
        """(max, mean) drift of every rank as last reported to this rank (upstream ranks are a
        pipeline delay old; those not heard from yet read as 0)."""
        figures = self.pipeline_drift.tolist()
        figures[2 * self.context.stage] = self.stats.max_drift
        figures[2 * self.context.stage + 1] = self.stats.mean_drift
        return [(int(figures[2 * s]), figures[2 * s + 1]) for s in range(self.context.num_stages)]

    def _loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def _gradient_trailer_elements(self) -> int:
        """What rides after a gradient's elements: the sender's loss scale, and with a
        per-token loss the microbatch's token count."""
        return scale_elements(self.dtype) + (COUNT_DIGITS if self.per_token_loss else 0)

    def _receive_gradient(self, lane: _Lane) -> tuple[torch.Tensor, int]:
        """The gradient, brought from its sender's loss scale to this rank's (in fp32), and
        the token count it carries (0 without a per-token loss)."""
        payload = self._take(lane.streams.gradients_in)
        numel = math.prod(self.tensor_shape)
        count_start = numel + scale_elements(self.dtype)
        grad = payload[:numel].view(self.tensor_shape)
        sender, mine = decode_scale(payload[numel:count_start]), self._loss_scale()
        if sender != mine:
            grad = (grad.float() * (mine / sender)).to(self.dtype)
        tokens = decode_count(payload[count_start:]) if self.per_token_loss else 0
        return grad, tokens

    def _send_gradient(self, lane: _Lane, grad: torch.Tensor, tokens: int) -> None:
        parts = [grad.reshape(-1), encode_scale(self._loss_scale(), grad.dtype, grad.device)]
        if self.per_token_loss:
            parts.append(encode_count(tokens, grad.dtype, grad.device))
        self._timed_send(lane.streams.gradients_out, torch.cat(parts))

    def _flush_sends(self) -> None:
        outboxes = [o for lane in self.lanes for o in lane.streams.outboxes()]
        if self.vocab_streams is not None:
            outboxes += self.vocab_streams.outboxes()
        for outbox in outboxes:
            outbox.flush()


@dataclass
class _CallWork:
    """What one training call works with: the injected functions and the losses it collects."""

    forward_step_func: Callable
    data_iterator: object
    num_microbatches: int
    optimizer_step_func: Callable[[], object] | None
    losses: list = field(default_factory=list)


@dataclass(frozen=True)
class _Totals:
    forwards: int
    backwards: int
    weight_grads_done: int
    forward_limit: int


class _ReadAhead:
    """The rank's data iterator, read by its EF passes first: with `keep` (a rank whose own
    forward reads the data) the batches they read wait for its forwards, in order."""

    def __init__(self, source=None, *, keep: bool):
        self.source, self.keep = source, keep
        self.batches: collections.deque = collections.deque()

    def read_next(self):
        batch = next(self.source)
        if self.keep:
            self.batches.append(batch)
        return batch

    def __iter__(self):
        return self

    def __next__(self):
        if not self.batches:
            raise RuntimeError("a forward read the data before its EF pass looked it up")
        return self.batches.popleft()


def _data_of(data_iterator, lane: _Lane):
    """The lane's data: one iterator per model chunk (a list, as Megatron passes them), or one
    shared by every chunk."""
    if isinstance(data_iterator, (list, tuple)):
        return data_iterator[lane.chunk]
    return data_iterator


def _split_loss(result) -> tuple[torch.Tensor, int, dict]:
    """(loss, number of tokens, reduced dict): Megatron loss functions return (loss,
    reduced-dict), or with a per-token loss (loss sum, number of tokens, reduced-dict)."""
    if isinstance(result, tuple) and len(result) == 3:
        loss, tokens, reduced = result
        return loss, int(tokens), reduced
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError("loss_func must return (loss, {'lm loss': ...})")
    return result[0], 0, result[1]


def _hidden_for_loss(output) -> HiddenForLoss:
    if not isinstance(output, HiddenForLoss):
        raise TypeError(
            "with the vocabulary split over the ranks the last stage's forward step must "
            f"return a HiddenForLoss (hidden state and labels), got {type(output).__name__}"
        )
    return output


def _loss_dict(result) -> dict:
    return _split_loss(result)[2]
