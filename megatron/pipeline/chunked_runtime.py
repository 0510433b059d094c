"""The stage runtime with virtual stages: v model chunks per rank, one schedule for all of them.

A schedule with a placement (`Schedule.placement`, e.g. interleaved 1F1B) names the chunk of
every action (`Action.chunk`); `ChunkedStageRuntime` carries it out on that chunk. Per chunk it
keeps what `StageRuntime` keeps per stage (its in-flight microbatches, its four streams), and
the rank's counters are a `RankState` (one `StageState` per chunk), the one the simulator
keeps, so actions are checked and counted alike. Everything else is the rank's: the optimizer
step (over every chunk's parameters), the statistics, the drift telemetry.

Streams. Virtual stage k (rank r, chunk c) takes its input from virtual stage k - 1 and its
output gradient from k + 1, whichever ranks run them (`ChunkChannels`). Each (sender,
receiver, chunk) pair is its own ordered stream on its own process group, so a receiver takes
each chunk's tensors in that chunk's order whatever order the sender interleaves its chunks in.

With a per-token loss the token counts ride upstream on the gradients as on one chunk per
stage, and the rank counts each microbatch once, at its chunk-0 backward (its last on the rank).

A schedule that reacts to arrivals (PACI over virtual stages) decides on the first
tensor-parallel rank of the stage, which sends kind, microbatch and chunk to the others.

Not here (rejected at argument validation): weight stashing, split backwards.
"""

import collections
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .p2p import Outbox, make_inbox
from .runtime import (
    _ACTION_CODES,
    StageRuntime,
    _InFlight,
    _loss_dict,
    _split_loss,
    call_forward_limit,
)
from .schedules.base import Action, ActionKind, Schedule, StageView
from .schedules.placement import Placement
from .stage_state import RankState


@dataclass
class ChunkChannels:
    """Where one chunk's tensors come from and go: global peer ranks and process groups (None
    at the ends of the pipeline: virtual stage 0 has no input, the last no output)."""

    input_peer: int | None = None
    input_group: object = None
    output_peer: int | None = None
    output_group: object = None
    # gradients travel the other way, on groups of their own
    grad_in_peer: int | None = None
    grad_in_group: object = None
    grad_out_peer: int | None = None
    grad_out_group: object = None


@dataclass
class _Lane:
    """One model chunk of the rank and its streams."""

    chunk: int
    module: torch.nn.Module
    is_first: bool  # virtual stage 0: reads the data, no input
    is_last: bool  # the last virtual stage: computes the loss
    activations_in: object = None
    gradients_in: object = None
    activations_out: Outbox | None = None
    gradients_out: Outbox | None = None
    inflight: collections.deque = field(default_factory=collections.deque)


class ChunkedStageRuntime(StageRuntime):
    """Executes a placement schedule's actions for one rank's model chunks.

    `model` is the rank's chunks as one module (`model.chunks[c]`, `ModelChunks`), `channels`
    one `ChunkChannels` per chunk."""

    def __init__(self, context, model, *, placement: Placement, channels: list[ChunkChannels],
                 **kwargs):  # fmt: skip
        if len(channels) != placement.chunks_per_rank:
            raise ValueError(f"{len(channels)} chunk channels for {placement}")
        self.placement, self.channels = placement, channels
        super().__init__(context, model, **kwargs)
        self.state = RankState(context.stage, placement)
        # steps between a microbatch's forward and backward, per chunk (the bound is per chunk)
        self.chunk_drift = [collections.Counter() for _ in channels]

    # ---------------------------------------------------------------- wiring
    def open_channels(self) -> None:
        ctx, placement = self.context, self.placement
        last = placement.num_virtual_stages - 1
        activation_payload = (self._activation_elements(),)
        gradient_payload = (self._gradient_elements(),)
        common = dict(backend=ctx.backend, dtype=self.dtype, device=ctx.device,
                      arrivals=self._arrivals)  # fmt: skip
        # every chunk's sends may queue: the rank's 1F1B depth times its chunks
        max_pending = placement.chunks_per_rank * (2 * ctx.num_stages + 2)
        self.lanes = []
        for chunk, links in enumerate(self.channels):
            stage = placement.virtual_stage(ctx.stage, chunk)
            lane = _Lane(chunk, self.model.chunks[chunk], stage == 0, stage == last)
            if not lane.is_first:
                lane.activations_in = make_inbox(peer=links.input_peer, group=links.input_group,
                                                 shape=activation_payload, **common)  # fmt: skip
                lane.gradients_out = Outbox(peer=links.grad_out_peer, group=links.grad_out_group,
                                            max_pending=max_pending)  # fmt: skip
            if not lane.is_last:
                lane.gradients_in = make_inbox(peer=links.grad_in_peer, group=links.grad_in_group,
                                               shape=gradient_payload, **common)  # fmt: skip
                lane.activations_out = Outbox(peer=links.output_peer, group=links.output_group,
                                              max_pending=max_pending)  # fmt: skip
            self.lanes.append(lane)
        # the single-chunk attributes, unused here
        self.activations_in = self.gradients_in = None
        self.activations_out = self.gradients_out = None

    def _activation_elements(self) -> int:
        return int(torch.Size(self.tensor_shape).numel()) + self.pipeline_drift.numel()

    def _gradient_elements(self) -> int:
        return int(torch.Size(self.tensor_shape).numel()) + self._gradient_trailer_elements()

    @property
    def inflight_microbatches(self) -> int:
        return sum(len(lane.inflight) for lane in self.lanes)

    # ---------------------------------------------------------------- calls
    def _use_schedule(self, schedule: Schedule) -> None:
        if schedule.placement is None or schedule.stashes_weights or schedule.splits_backward:
            raise RuntimeError(f"{schedule.name} cannot run on model chunks")
        self.schedule = schedule

    def _begin_call(self, schedule: Schedule, num_microbatches, microbatches_before_drain) -> None:
        """Every chunk ends the call after `num_microbatches` more backwards."""
        state = self.state
        state.schedule_name = schedule.name
        for chunk in state.chunks:
            chunk.schedule_name = schedule.name
        forward_limit = call_forward_limit(
            schedule, state.chunks[0].backward_target, num_microbatches, microbatches_before_drain
        )
        state.begin_call(num_microbatches, forward_limit)
        self._expect_inputs(forward_limit)

    def _expect_inputs(self, forward_limit: int) -> None:
        """Per chunk, the receives this call may consume and no more (every posted receive
        must be matched by a send): inputs up to the forward limit, or fewer when the schedule
        says how far a chunk may run ahead of its backwards (`Schedule.chunk_lookahead`);
        gradients up to the call's backward target."""
        lookahead = getattr(self.schedule, "chunk_lookahead", None)
        for lane, chunk in zip(self.lanes, self.state.chunks):
            if lane.activations_in is not None:
                total = forward_limit
                if lookahead is not None:
                    ahead = lookahead(self.context.stage, lane.chunk, self.placement,
                                      chunk.microbatches_per_step)  # fmt: skip
                    total = min(total, chunk.backward_target + ahead)
                lane.activations_in.expect_total(self._forward_only_microbatches + total)
            if lane.gradients_in is not None:
                lane.gradients_in.expect_total(chunk.backward_target)

    def run_training(self, schedule: Schedule, **kwargs) -> list[dict]:
        losses = super().run_training(schedule, **kwargs)
        if all(c.forwards == c.backwards == c.forward_limit for c in self.state.chunks):
            self._flush_sends()
        return losses

    def run_forward_only(self, *, forward_step_func, data_iterator, num_microbatches) -> list:
        """Forward `num_microbatches` through every chunk with no graph kept (evaluation):
        microbatch by microbatch, chunk 0 to v - 1 (each hop's input is there or on its way, as
        the ranks before it run the same order). The pipeline must be empty."""
        if self.inflight_microbatches:
            raise RuntimeError(
                f"rank {self.context.stage} has {self.inflight_microbatches} microbatch-chunks "
                "in flight: drain the pipeline before a forward-only pass"
            )
        outputs = []
        self._forward_only_microbatches += num_microbatches
        for lane in self.lanes:
            if lane.activations_in is not None:
                lane.activations_in.expect_total(lane.activations_in.expected + num_microbatches)
        with torch.no_grad():
            for _ in range(num_microbatches):
                for lane in self.lanes:
                    input_tensor = None if lane.is_first else self._receive_activation(lane)
                    output, loss_func = self._call_chunk(lane, forward_step_func, data_iterator,
                                                         input_tensor)  # fmt: skip
                    if lane.is_last:
                        outputs.append(_loss_dict(loss_func(output)))
                    else:
                        self._send_activation(lane, output)
        self._flush_sends()
        return outputs

    # ---------------------------------------------------------------- deciding
    def _view(self, step_enabled: bool) -> StageView:
        inputs = [lane.is_first or lane.activations_in.ready() for lane in self.lanes]
        grads = [
            bool(lane.inflight) if lane.is_last else lane.gradients_in.ready()
            for lane in self.lanes
        ]
        return self.state.view(inputs_ready=inputs, grads_ready=grads, step_enabled=step_enabled)

    def _nothing_to_wait_for(self) -> bool:
        for lane in self.lanes:
            for inbox in (lane.activations_in, lane.gradients_in):
                if inbox is not None and inbox.outstanding():
                    return False
            if lane.is_last and lane.inflight:
                return False
        return True

    def _share_decision(self, action: Action) -> None:
        """A reacting schedule's decision, from the first tensor-parallel rank to the others:
        kind, microbatch and chunk."""
        code = _ACTION_CODES.index(action.kind)
        microbatch = -1 if action.microbatch is None else action.microbatch
        chunk = -1 if action.chunk is None else action.chunk
        message = torch.tensor([code, microbatch, chunk])
        ctx = self.context
        dist.broadcast(message, src=ctx.decision_leader, group=ctx.decision_group)

    def _receive_decision(self) -> Action:
        message = torch.empty(3, dtype=torch.int64)
        ctx = self.context
        dist.broadcast(message, src=ctx.decision_leader, group=ctx.decision_group)
        kind, microbatch, chunk = _ACTION_CODES[int(message[0])], int(message[1]), int(message[2])
        return Action(kind, None if microbatch < 0 else microbatch, None if chunk < 0 else chunk)

    # ---------------------------------------------------------------- doing
    def _execute(self, action, forward_step_func, data_iterator, num_microbatches,
                 optimizer_step_func, losses) -> None:  # fmt: skip
        if action.kind is ActionKind.STEP:
            super()._execute(action, forward_step_func, data_iterator, num_microbatches,
                             optimizer_step_func, losses)  # fmt: skip
            return
        lane = self.lanes[action.chunk]
        start, self._blocked_s = time.perf_counter(), 0.0
        if action.kind is ActionKind.FORWARD:
            loss = self._forward_chunk(lane, forward_step_func, data_iterator, num_microbatches)
            if loss is not None:
                losses.append(loss)
        elif action.kind is ActionKind.BACKWARD:
            self._backward_chunk(lane)
        else:
            raise RuntimeError(f"the chunked runtime cannot execute {action}")
        end = time.perf_counter()
        self.stats.busy_s += end - start - self._blocked_s
        self.wait_s += self._blocked_s
        self.actions_run += 1
        if self.trace is not None:
            self.trace.append(self._trace_event(action, start + self._blocked_s, end))

    def _trace_event(self, action: Action, start: float, end: float):
        from .trace import TraceEvent

        return TraceEvent(self.context.stage, action, start, end)

    def _call_chunk(self, lane: _Lane, forward_step_func, data_iterator, input_tensor):
        set_input = getattr(lane.module, "set_input_tensor", None)
        if set_input is not None:
            set_input(input_tensor)
        return forward_step_func(data_iterator, lane.module)

    def _forward_chunk(self, lane: _Lane, forward_step_func, data_iterator,
                       num_microbatches) -> dict | None:  # fmt: skip
        input_tensor = None
        if not lane.is_first:
            input_tensor = self._receive_activation(lane).requires_grad_(True)
        version = self.state.steps
        compute_start = time.perf_counter()
        with self.meter.measure() as saved:
            output, loss_func = self._call_chunk(lane, forward_step_func, data_iterator,
                                                 input_tensor)  # fmt: skip
            loss_dict, tokens = None, 0
            if lane.is_last:
                loss, tokens, loss_dict = _split_loss(loss_func(output))
                # a per-token loss is divided by the step's token count at the step instead
                if not self.per_token_loss:
                    loss = loss / self.schedule.microbatches_per_update(num_microbatches)
                output = loss
        self.compute_s += time.perf_counter() - compute_start
        microbatch = self.state.record_forward(lane.chunk, version)
        lane.inflight.append(_InFlight(microbatch, input_tensor, output, saved[0], tokens))
        self.stats.add_activation(saved[0], self.inflight_microbatches)
        if not lane.is_last:
            self._send_activation(lane, output)
        return loss_dict

    def _backward_chunk(self, lane: _Lane) -> None:
        microbatch = lane.inflight.popleft()
        grad, tokens = None, microbatch.tokens
        if not lane.is_last:
            grad, tokens = self._receive_gradient_of(lane)
        output = microbatch.output_tensor
        if lane.is_last and self.loss_scaler is not None:
            output = output * self.loss_scaler.scale  # fp16: the rank's scale, now
        compute_start = time.perf_counter()
        torch.autograd.backward(output, grad_tensors=grad)
        self.compute_s += time.perf_counter() - compute_start
        if lane.chunk == 0:  # a microbatch's last backward on the rank: count its tokens once
            self.tokens_since_step += int(tokens)
        if not lane.is_first:
            self._send_gradient_of(lane, microbatch.input_tensor.grad, tokens)
        forward_version = self.state.record_backward(lane.chunk)
        drift = self.state.steps - forward_version
        self.stats.record_drift(drift)
        self.chunk_drift[lane.chunk][drift] += 1
        self.stats.release_activation(microbatch.saved_bytes)

    # ---------------------------------------------------------------- transfers
    def _receive_activation(self, lane: _Lane) -> torch.Tensor:
        payload = self._take(lane.activations_in)
        numel = payload.numel() - self.pipeline_drift.numel()
        # the ranks' drift figures go round the ring with the activations: keep the latest
        # of the others (our own pair is ours to write)
        mine = self.pipeline_drift[2 * self.context.stage : 2 * self.context.stage + 2].clone()
        self.pipeline_drift.copy_(payload[numel:])
        self.pipeline_drift[2 * self.context.stage : 2 * self.context.stage + 2] = mine
        return payload[:numel].view(self.tensor_shape).detach()

    def _send_activation(self, lane: _Lane, output: torch.Tensor) -> None:
        stage = self.context.stage
        self.pipeline_drift[2 * stage] = self.stats.max_drift
        self.pipeline_drift[2 * stage + 1] = self.stats.mean_drift
        telemetry = self.pipeline_drift.to(device=output.device, dtype=output.dtype)
        payload = torch.cat([output.detach().reshape(-1), telemetry])
        self._timed_send(lane.activations_out, payload)

    def _receive_gradient_of(self, lane: _Lane):
        self.gradients_in = lane.gradients_in  # the single-stream decoding, on this stream
        try:
            return self._receive_gradient()
        finally:
            self.gradients_in = None

    def _send_gradient_of(self, lane: _Lane, grad: torch.Tensor, tokens: int) -> None:
        self.gradients_out = lane.gradients_out
        try:
            self._send_gradient(grad, tokens)
        finally:
            self.gradients_out = None

    def _flush_sends(self) -> None:
        for lane in self.lanes:
            for outbox in (lane.activations_out, lane.gradients_out):
                if outbox is not None:
                    outbox.flush()

    def drift_by_stage(self) -> list[tuple[int, float]]:
        figures = self.pipeline_drift.tolist()
        figures[2 * self.context.stage] = self.stats.max_drift
        figures[2 * self.context.stage + 1] = self.stats.mean_drift
        return [(int(figures[2 * s]), figures[2 * s + 1]) for s in range(self.context.num_stages)]
