"""The stage runtime: asks a schedule for the next action and carries it out.

One `StageRuntime` per rank lives for the whole run, so an asynchronous schedule's in-flight
microbatches, weight version and pending receives carry over from one call to the next. The
runtime does not decide anything: ordering is the schedule's (`megatron.pipeline.schedules`),
and the work itself is injected (Megatron's `forward_step_func`, an optimizer-step callable).
Counters, weight versions, the `StageView` and the check of every action are the stage's
`StageState` (`megatron.pipeline.stage_state`), the same the simulator keeps: an action the
stage cannot run raises `IllegalActionError` with the stage's state and recent actions.

Schedules that stash weights (PipeDream-2BW, PipeDream) run each forward on the weight version
the schedule names and its backward on the same one; the older versions and the swap are the
stage's `WeightStash` (`megatron.pipeline.weight_stash`). The gradient is accumulated into the
parameters' `.grad` and applied to the live weights at the stage's step.
"""

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .accounting import SavedTensorMeter, StageStats, preserve_versions
from .p2p import Outbox, decode_scale, encode_scale, make_inbox, scale_elements
from .schedules.base import Action, ActionKind, Schedule, StagePosition, StageView
from .stage_state import NO_LIMIT, StageState
from .trace import TraceEvent
from .weight_stash import WeightStash

_ACTION_CODES = list(ActionKind)


@dataclass
class PipelineContext(StagePosition):
    """How this rank is wired into the pipeline. Built once by `megatron.pipeline.parallel`."""

    stage: int
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


@dataclass
class _InFlight:
    microbatch: int
    input_tensor: torch.Tensor | None
    output_tensor: torch.Tensor
    saved_bytes: int
    tokens: int = 0  # last stage, per-token loss: the microbatch's loss-mask count


# A token count rides on each gradient sent upstream (per-token loss) as base-256 digits,
# exact in any payload dtype (bf16 holds integers exactly only up to 256).
COUNT_DIGITS = 4


def encode_count(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    digits = [(int(count) >> (8 * i)) & 0xFF for i in range(COUNT_DIGITS)]
    return torch.tensor(digits, dtype=dtype, device=device)


def decode_count(digits: torch.Tensor) -> int:
    return sum(int(round(float(d))) << (8 * i) for i, d in enumerate(digits.tolist()))


def call_forward_limit(schedule, backward_target: int, num_microbatches: int,
                       microbatches_before_drain: int | None) -> int:  # fmt: skip
    """No forward of this call beyond the next drain (a flush drains at every call's end):
    the stage's backwards so far plus the microbatches before the drain; none without one."""
    if schedule.flushes_every_call:
        microbatches_before_drain = num_microbatches
    if microbatches_before_drain is None:
        return NO_LIMIT
    if microbatches_before_drain < num_microbatches:
        raise ValueError("microbatches_before_drain must cover this call's microbatches")
    return backward_target + microbatches_before_drain


class StageRuntime:
    """Executes schedule actions for one pipeline stage of `model`."""

    def __init__(
        self,
        context: PipelineContext,
        model: torch.nn.Module,
        *,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        record_trace: bool = False,
        deterministic: bool = False,
        per_token_loss: bool = False,
    ):
        self.context, self.model = context, model
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.deterministic = deterministic  # reactive schedules follow their fixed order
        # --calculate-per-token-loss: the last stage backpropagates summed losses; each
        # microbatch's token count travels upstream with its gradient, and every stage sums
        # the counts of the backwards since its last step (the step divides by them).
        self.per_token_loss = per_token_loss
        self.tokens_since_step = 0
        # Drift reports ride on the activations: every stage overwrites its own (max, mean)
        # pair and passes the rest on, so the last stage (which logs) sees every stage's
        # figures, a pipeline delay old, without any extra message or synchronization.
        self.pipeline_drift = torch.zeros(2 * context.num_stages, dtype=torch.float64)
        # fp16: the stage's loss scaler (set by the training loop). Every gradient message
        # carries the scale its sender computed it with; the receiver rescales to its own.
        self.loss_scaler = None
        # Counters, weight versions, views and action checks, as the simulator keeps them.
        self.state = StageState(context.stage, context.num_stages)
        self._forward_only_microbatches = 0  # they share the activation stream with training
        self.inflight: collections.deque[_InFlight] = collections.deque()
        self.stats = StageStats(stage=context.stage)
        self.meter = SavedTensorMeter(model.parameters())
        self.stash: WeightStash | None = None  # weight-stashing schedules only
        self.schedule: Schedule | None = None  # the current call's
        self.trace: list[TraceEvent] | None = [] if record_trace else None
        self.actions_run = 0
        self.loop_s = 0.0  # time inside training calls ...
        self.wait_s = 0.0  # ... of which waiting for arrivals (busy time is in stats.busy_s)
        self.compute_s = 0.0  # ... in the model's forward and loss, backward, optimizer step
        self.transfer_s = 0.0  # ... posting sends (blocking receives count as waiting)
        self._blocked_s = 0.0  # waiting inside the current action
        self._start_time: float | None = None
        self._arrivals = threading.Condition()
        self.open_channels()

    # ---------------------------------------------------------------- wiring
    def open_channels(self) -> None:
        """The four streams to the neighbouring stages (`megatron.pipeline.p2p`); a test can
        replace them with in-process ones."""
        ctx = self.context
        activation_payload = (math.prod(self.tensor_shape) + self.pipeline_drift.numel(),)
        gradient_payload = (math.prod(self.tensor_shape) + self._gradient_trailer_elements(),)
        common = dict(backend=ctx.backend, dtype=self.dtype, device=ctx.device,
                      arrivals=self._arrivals)  # fmt: skip
        self.activations_in = self.gradients_in = None
        self.activations_out = self.gradients_out = None
        max_pending = 2 * ctx.num_stages + 2
        if not ctx.is_first:
            self.activations_in = make_inbox(
                peer=ctx.prev_rank, group=ctx.activation_group, shape=activation_payload, **common
            )
            self.gradients_out = Outbox(
                peer=ctx.prev_rank, group=ctx.gradient_group, max_pending=max_pending
            )
        if not ctx.is_last:
            self.gradients_in = make_inbox(
                peer=ctx.next_rank, group=ctx.gradient_group, shape=gradient_payload, **common
            )
            self.activations_out = Outbox(
                peer=ctx.next_rank, group=ctx.activation_group, max_pending=max_pending
            )

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
        """Advance the stage by one step's worth of backwards (`num_microbatches`).

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
        losses: list[dict] = []
        loop_start = time.perf_counter()
        while True:
            action = self._decide(schedule, step_enabled)
            if action.kind is ActionKind.DONE:
                break
            self.state.check(action, step_enabled=step_enabled)
            self._execute(action, forward_step_func, data_iterator, num_microbatches,
                          optimizer_step_func, losses)  # fmt: skip
        self.loop_s += time.perf_counter() - loop_start
        state = self.state
        if state.forwards == state.backwards == state.forward_limit:
            self._flush_sends()
        self.stats.wall_s = time.perf_counter() - self._start_time
        self.stats.optimizer_steps = state.steps
        return losses

    def _use_schedule(self, schedule: Schedule) -> None:
        """The call's schedule; a weight-stashing one gets the stage's `WeightStash`."""
        if schedule.stashes_weights and self.stash is None:
            self.stash = WeightStash(self.model.parameters())
            self.stash.live_version = self.state.steps
        elif not schedule.stashes_weights and self.stash is not None:
            raise RuntimeError(
                f"stage {self.context.stage}: {schedule.name} after a weight-stashing schedule "
                "(the stashed versions would be lost)"
            )
        self.schedule = schedule

    def _begin_call(self, schedule: Schedule, num_microbatches, microbatches_before_drain) -> None:
        """Set the call's backward target and forward limit, and post its receives."""
        state = self.state
        state.schedule_name, state.splits_backward = schedule.name, schedule.splits_backward
        forward_limit = call_forward_limit(
            schedule, state.backward_target, num_microbatches, microbatches_before_drain
        )
        state.begin_call(num_microbatches, forward_limit)
        self._expect_inputs(forward_limit)

    def run_forward_only(self, *, forward_step_func, data_iterator, num_microbatches) -> list:
        """Forward `num_microbatches` with no graph kept (evaluation). The pipeline must be empty."""
        if self.inflight:
            raise RuntimeError(
                f"stage {self.context.stage} has {len(self.inflight)} microbatches in flight: "
                "drain the pipeline (microbatches_before_drain) before a forward-only pass"
            )
        ctx, outputs = self.context, []
        self._forward_only_microbatches += num_microbatches
        if self.activations_in is not None:
            self.activations_in.expect_total(self.activations_in.expected + num_microbatches)
        with torch.no_grad():
            for _ in range(num_microbatches):
                input_tensor = None if ctx.is_first else self._receive_activation()
                output, loss_func = self._call_forward_step(
                    forward_step_func, data_iterator, input_tensor
                )
                if ctx.is_last:
                    outputs.append(_loss_dict(loss_func(output)))
                else:
                    self._send_activation(output)
        self._flush_sends()
        return outputs

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
        ctx = self.context
        input_ready = ctx.is_first or self.activations_in.ready()
        if ctx.is_last:
            grad_ready = self.state.inflight > 0  # its own loss
        else:
            grad_ready = self.gradients_in.ready()
        return self.state.view(
            input_ready=input_ready, grad_ready=grad_ready, step_enabled=step_enabled
        )

    def _decide(self, schedule: Schedule, step_enabled: bool) -> Action:
        ctx = self.context
        if schedule.depends_on_arrivals and not ctx.is_decision_leader:
            wait_start = time.perf_counter()
            action = self._receive_decision()
            self.wait_s += time.perf_counter() - wait_start
            return action
        while True:
            with self._arrivals:
                view = self._view(step_enabled)
                action = schedule.next_action(view)
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
        pending = 0
        for inbox in (self.activations_in, self.gradients_in):
            if inbox is not None:
                pending += inbox.outstanding()
        return pending == 0 and not (self.context.is_last and self.inflight)

    def _share_decision(self, action: Action) -> None:
        code = _ACTION_CODES.index(action.kind)
        message = torch.tensor([code, -1 if action.microbatch is None else action.microbatch])
        dist.broadcast(message, src=self.context.decision_leader, group=self.context.decision_group)

    def _receive_decision(self) -> Action:
        message = torch.empty(2, dtype=torch.int64)
        dist.broadcast(message, src=self.context.decision_leader, group=self.context.decision_group)
        kind, microbatch = _ACTION_CODES[int(message[0])], int(message[1])
        return Action(kind, None if microbatch < 0 else microbatch)

    def _expect_inputs(self, forward_limit: int) -> None:
        """Post the receives this call may consume, and no more: every posted receive must be
        matched by a send upstream, or its thread would wait forever. A stage forwards at most
        `num_stages - stage - 1` microbatches beyond its backward target (1F1B admission), and
        its upstream neighbour at least as many. Forward-only passes used some receives before.
        """
        if self.activations_in is not None:
            ctx = self.context
            lookahead = self.state.backward_target + ctx.num_stages - ctx.stage - 1
            self.activations_in.expect_total(
                self._forward_only_microbatches + min(forward_limit, lookahead)
            )
        if self.gradients_in is not None:
            self.gradients_in.expect_total(self.state.backward_target)

    # ---------------------------------------------------------------- doing
    def _execute(self, action, forward_step_func, data_iterator, num_microbatches,
                 optimizer_step_func, losses) -> None:  # fmt: skip
        start, self._blocked_s = time.perf_counter(), 0.0
        if action.kind is ActionKind.FORWARD:
            loss = self._forward(forward_step_func, data_iterator, num_microbatches)
            if loss is not None:
                losses.append(loss)
        elif action.kind is ActionKind.BACKWARD:
            self._backward()
        elif action.kind is ActionKind.STEP:
            self._step(optimizer_step_func)
        else:
            raise RuntimeError(f"the runtime cannot execute {action}")
        end = time.perf_counter()
        self.stats.busy_s += end - start - self._blocked_s  # waiting for an input is idle time
        self.wait_s += self._blocked_s
        self.actions_run += 1
        if self.trace is not None:  # the action starts once its input is there, as simulated
            self.trace.append(TraceEvent(self.context.stage, action, start + self._blocked_s, end))

    def _call_forward_step(self, forward_step_func, data_iterator, input_tensor):
        set_input = getattr(self.model, "set_input_tensor", None)
        if set_input is not None:
            set_input(input_tensor)
        return forward_step_func(data_iterator, self.model)

    def _forward(self, forward_step_func, data_iterator, num_microbatches) -> dict | None:
        ctx = self.context
        input_tensor = None
        if not ctx.is_first:
            input_tensor = self._receive_activation().requires_grad_(True)
        version = self._forward_version()
        compute_start = time.perf_counter()
        with self._on_weights(version) as redirection, self.meter.measure(redirection) as saved:
            output, loss_func = self._call_forward_step(
                forward_step_func, data_iterator, input_tensor
            )
            loss_dict, tokens = None, 0
            if ctx.is_last:
                loss, tokens, loss_dict = _split_loss(loss_func(output))
                # flush scales by 1/m, PACI by 1/a, PipeDream (a step per microbatch) by 1;
                # a per-token loss is divided by the step's token count at the step instead
                if not self.per_token_loss:
                    output = loss / self.schedule.microbatches_per_update(num_microbatches)
                else:
                    output = loss
        self.compute_s += time.perf_counter() - compute_start
        microbatch = self.state.record_forward(version)
        self.inflight.append(_InFlight(microbatch, input_tensor, output, saved[0], tokens))
        self.stats.add_activation(saved[0], len(self.inflight))
        if not ctx.is_last:
            self._send_activation(output)
        return loss_dict

    def _forward_version(self) -> int:
        """The weight version the next forward runs on: the current one, unless the schedule
        pins it (PipeDream-2BW: batch b on W(b-1))."""
        state, pinned = self.state, self.schedule.forward_weight_version
        if pinned is None:
            return state.steps
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
        state, pinned = self.state, self.schedule.forward_weight_version
        if version in state.forward_versions.values():
            return True
        if pinned is None:
            return False
        return version >= pinned(state.forwards, state.microbatches_per_step, state.steps)

    def _take(self, inbox) -> torch.Tensor:
        """Next tensor of `inbox`, blocking if a static schedule asked for it before arrival."""
        start = time.perf_counter()
        tensor = inbox.take()
        self._blocked_s += time.perf_counter() - start
        return tensor

    def _receive_activation(self) -> torch.Tensor:
        payload = self._take(self.activations_in)
        numel = payload.numel() - self.pipeline_drift.numel()
        self.pipeline_drift.copy_(payload[numel:])
        self.pipeline_drift[2 * self.context.stage :] = 0  # overwritten by us and downstream
        return payload[:numel].view(self.tensor_shape).detach()

    def _send_activation(self, output: torch.Tensor) -> None:
        stage = self.context.stage
        self.pipeline_drift[2 * stage] = self.stats.max_drift
        self.pipeline_drift[2 * stage + 1] = self.stats.mean_drift
        telemetry = self.pipeline_drift.to(device=output.device, dtype=output.dtype)
        payload = torch.cat([output.detach().reshape(-1), telemetry])
        self._timed_send(self.activations_out, payload)

    def _timed_send(self, outbox, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        outbox.send(tensor)
        self.transfer_s += time.perf_counter() - start

    def drift_by_stage(self) -> list[tuple[int, float]]:
        """(max, mean) drift of every stage as last reported to this stage (upstream stages
        are a pipeline delay old; downstream ones are unknown here and read as 0)."""
        figures = self.pipeline_drift.tolist()
        figures[2 * self.context.stage] = self.stats.max_drift
        figures[2 * self.context.stage + 1] = self.stats.mean_drift
        return [(int(figures[2 * s]), figures[2 * s + 1]) for s in range(self.context.num_stages)]

    def _backward(self) -> None:
        ctx = self.context
        microbatch = self.inflight.popleft()
        grad, tokens = None, microbatch.tokens
        if not ctx.is_last:
            grad, received_tokens = self._receive_gradient()
            tokens = received_tokens if self.per_token_loss else tokens
        output = microbatch.output_tensor
        if ctx.is_last and self.loss_scaler is not None:
            output = output * self.loss_scaler.scale  # fp16: the stage's scale, now
        version = self.state.forward_versions[microbatch.microbatch]
        compute_start = time.perf_counter()
        with self._on_weights(version):
            torch.autograd.backward(output, grad_tensors=grad)
        self.compute_s += time.perf_counter() - compute_start
        self.tokens_since_step += int(tokens)
        if not ctx.is_first:
            self._send_gradient(microbatch.input_tensor.grad, tokens)
        forward_version = self.state.record_backward()
        steps_since_forward = self.state.steps - forward_version
        if self.stash is None:
            self.stats.record_drift(steps_since_forward, self.state.microbatches_per_step)
        else:  # the backward ran on its forward's weights; the gradient is that stale
            self.stats.record_drift(0)
            self.stats.record_delay(steps_since_forward)
            self.stash.release_unneeded(self._still_needed)
        self.stats.release_activation(microbatch.saved_bytes)

    def _loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def _gradient_trailer_elements(self) -> int:
        """What rides after a gradient's elements: the sender's loss scale, and with a
        per-token loss the microbatch's token count."""
        return scale_elements(self.dtype) + (COUNT_DIGITS if self.per_token_loss else 0)

    def _receive_gradient(self) -> tuple[torch.Tensor, int]:
        """The gradient, brought from its sender's loss scale to this stage's (in fp32), and
        the token count it carries (0 without a per-token loss)."""
        payload = self._take(self.gradients_in)
        numel = math.prod(self.tensor_shape)
        count_start = numel + scale_elements(self.dtype)
        grad = payload[:numel].view(self.tensor_shape)
        sender, mine = decode_scale(payload[numel:count_start]), self._loss_scale()
        if sender != mine:
            grad = (grad.float() * (mine / sender)).to(self.dtype)
        tokens = decode_count(payload[count_start:]) if self.per_token_loss else 0
        return grad, tokens

    def _send_gradient(self, grad: torch.Tensor, tokens: int) -> None:
        parts = [grad.reshape(-1), encode_scale(self._loss_scale(), grad.dtype, grad.device)]
        if self.per_token_loss:
            parts.append(encode_count(tokens, grad.dtype, grad.device))
        self._timed_send(self.gradients_out, torch.cat(parts))

    def _step(self, optimizer_step_func) -> None:
        stash = self.stash
        compute_start = time.perf_counter()
        if stash is not None and self._still_needed(stash.live_version):
            stash.keep_live_version()  # the step overwrites weights a microbatch still needs
        with preserve_versions(self.model.parameters()):
            optimizer_step_func()  # with a per-token loss it reads tokens_since_step
        self.compute_s += time.perf_counter() - compute_start
        self.tokens_since_step = 0
        self.state.record_step()
        if stash is not None:
            stash.stepped()
            stash.release_unneeded(self._still_needed)
            self.stats.extra_weight_versions = stash.peak_versions
            self.stats.extra_weight_bytes = stash.peak_bytes

    def _flush_sends(self) -> None:
        for outbox in (self.activations_out, self.gradients_out):
            if outbox is not None:
                outbox.flush()


def _split_loss(result) -> tuple[torch.Tensor, int, dict]:
    """(loss, number of tokens, reduced dict): Megatron loss functions return (loss,
    reduced-dict), or with a per-token loss (loss sum, number of tokens, reduced-dict)."""
    if isinstance(result, tuple) and len(result) == 3:
        loss, tokens, reduced = result
        return loss, int(tokens), reduced
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError("loss_func must return (loss, {'lm loss': ...})")
    return result[0], 0, result[1]


def _loss_dict(result) -> dict:
    return _split_loss(result)[2]
