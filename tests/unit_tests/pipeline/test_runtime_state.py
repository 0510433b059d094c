"""The rank runtime's bookkeeping in one process: real `RankRuntime`s, one thread per stage,
joined by an in-process transport instead of torch.distributed.

The runtime and the event engine share `StageState`; here the runtime's executed order, drift,
in-flight counts and steps are compared with the engine's for the same schedule, and an illegal
action must fail with the stage's state and recent actions before anything runs.
"""

import collections
import itertools
import threading

import pytest
import torch

from megatron.pipeline.runtime import PipelineContext, RankRuntime
from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.base import Action, ActionKind, Schedule
from megatron.pipeline.schedules.paci import drift_bound, with_paci_options
from megatron.pipeline.simulation import simulate
from megatron.pipeline.stage_state import IllegalActionError, StageState
from megatron.pipeline.trace import action_order
from megatron.pipeline.transport import InProcessTransport

SHAPE = (2, 1, 4)  # (sequence, micro batch, hidden)


class TinyStage(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(SHAPE[-1], SHAPE[-1])
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, batch):
        return self.linear(batch if self.input_tensor is None else self.input_tensor)


def forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(out):
        loss = out.pow(2).mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=generator) for _ in itertools.count())


def in_process_context(stage: int, num_stages: int) -> PipelineContext:
    return PipelineContext(stage=stage, num_stages=num_stages, device=torch.device("cpu"),
                           backend="gloo")  # fmt: skip


def build_pipeline(num_stages: int, deterministic: bool = True) -> list[RankRuntime]:
    """One runtime per stage, joined by an in-process transport."""
    transport = InProcessTransport()
    return [
        RankRuntime(in_process_context(s, num_stages), TinyStage(s), tensor_shape=SHAPE,
                    dtype=torch.float32, transport=transport.for_rank([s]), record_trace=True,
                    deterministic=deterministic)  # fmt: skip
        for s in range(num_stages)
    ]


def train(runtime: RankRuntime, schedule: Schedule, m: int, steps: int, lr: float = 0.01,
          momentum: float = 0.0) -> None:  # fmt: skip
    """What the training loop does: one call per iteration, the last one drains; SGD on each
    stage (test_weight_stashing.py passes its own lr and momentum)."""
    optimizer = torch.optim.SGD(runtime.model.parameters(), lr=lr, momentum=momentum)
    data = batches(runtime.context.stage)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    for k in range(steps):
        runtime.run_training(schedule, forward_step_func=forward_step, data_iterator=data,
                             num_microbatches=m, optimizer_step_func=step,
                             microbatches_before_drain=(steps - k) * m)  # fmt: skip


def run_threads(runtimes, target) -> None:
    errors = []

    def guarded(runtime):
        try:
            target(runtime)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in runtimes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stage hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize(
    "name, m, limit",
    [("1f1b", 4, None), ("1f1b", 2, None), ("paci", 4, None), ("paci", 2, None),
     ("paci", 2, "flush")],
)  # fmt: skip
def test_runtime_bookkeeping_equals_the_simulators(name, m, limit):
    num_stages, steps = 4, 3
    schedule = with_paci_options(get_schedule(name), None, limit)
    runtimes = build_pipeline(num_stages)
    run_threads(runtimes, lambda r: train(r, schedule, m, steps))
    simulated = simulate(schedule.fixed_order or schedule, num_stages=num_stages,
                         microbatches_per_step=m, steps=steps, forward_cost=1.0,
                         backward_cost=2.0)  # fmt: skip
    events = [event for r in runtimes for event in r.trace]
    assert action_order(events) == action_order(simulated.timeline)
    for s, runtime in enumerate(runtimes):
        state = runtime.state.chunks[0]
        assert state.forwards == state.backwards == steps * m
        assert state.steps == runtime.stats.optimizer_steps == steps
        assert state.forward_versions == {} and not runtime.inflight_microbatches
        assert runtime.stats.peak_inflight_microbatches == simulated.peak_inflight_per_stage[s]
        assert state.peak_inflight == simulated.peak_inflight_per_stage[s]
        assert runtime.stats.max_drift == simulated.max_drift_per_stage[s]
        if name == "paci" and limit is None:
            assert runtime.stats.max_drift == drift_bound(s, num_stages, m)
        elif name == "paci":  # only the first stage overlaps steps in the capped fixed order
            assert runtime.stats.max_drift == (
                drift_bound(s, num_stages, m, limit) if s == 0 else 0
            )
        else:
            assert runtime.stats.max_drift == 0


def _wrong_after(actions: int, wrong: Action):
    """PACI's fixed order for `actions` actions, then `wrong`."""
    decided = itertools.count()
    fixed = get_schedule("paci").fixed_order

    def next_action(view):
        action = fixed.next_action(view)
        if action.kind in (ActionKind.DONE, ActionKind.WAIT):
            return action
        return action if next(decided) < actions else wrong

    return Schedule("broken", next_action, depends_on_arrivals=False, flushes_every_call=False)


def test_an_illegal_action_fails_with_the_stage_state_before_it_runs():
    runtime = build_pipeline(1)[0]
    schedule = _wrong_after(4, Action(ActionKind.BACKWARD, 7))
    with pytest.raises(IllegalActionError) as failure:
        train(runtime, schedule, m=4, steps=1)
    message = str(failure.value)
    assert "broken: stage 0: B7 names microbatch 7, the stage's next backward is 2" in message
    assert "state: stage 0 of 1, call 1: F=2 B=2 W=0 S=0, in flight 0" in message
    assert "backward target 4, forward limit 4" in message
    assert "recent actions (oldest first): F0 B0 F1 B1" in message
    assert runtime.state.backwards == 2 and runtime.stats.optimizer_steps == 0


@pytest.mark.parametrize(
    "wrong, problem",
    [
        (Action(ActionKind.FORWARD, 3), "names microbatch 3, the stage's next forward is 1"),
        (Action(ActionKind.WEIGHT_GRAD, 0), "does not split its backward"),
        (Action(ActionKind.FORWARD, 1), None),
    ],
)
def test_the_runtime_checks_every_kind_of_action(wrong, problem):
    runtime = build_pipeline(2)[0]  # stage 0 of 2: its forwards need no input
    if problem is None:  # forwarding past the forward limit
        state = runtime.state.chunks[0]
        state.begin_call(1, forward_limit=1)
        state.record_forward()
        with pytest.raises(IllegalActionError, match="past the forward limit 1"):
            state.check(Action(ActionKind.FORWARD, 1))
        return
    with pytest.raises(IllegalActionError, match=problem):
        run_threads([runtime], lambda r: train(r, _wrong_after(1, wrong), m=2, steps=1))


def test_a_step_is_illegal_when_the_caller_steps():
    state = StageState(0, 2, "x")
    state.begin_call(2)
    with pytest.raises(IllegalActionError, match="the caller steps it itself"):
        state.check(Action(ActionKind.STEP), step_enabled=False)
    state.check(Action(ActionKind.STEP))  # allowed when the schedule steps


def test_views_and_versions():
    state = StageState(1, 4, "x")
    state.begin_call(2, forward_limit=6)
    state.begin_call(2, forward_limit=6)
    assert (state.calls, state.backward_target, state.forward_limit) == (2, 4, 6)
    state.record_forward()
    state.record_step()
    state.record_forward()
    view = state.view(input_ready=True, grad_ready=False, step_enabled=False)
    assert (view.forwards, view.backwards, view.steps, view.inflight) == (2, 0, 1, 2)
    assert not view.step_enabled and view.backward_target == 4
    assert state.record_backward() == 0  # microbatch 0's forward used version 0
    assert state.record_backward() == 1
    assert state.forward_versions == {} and state.peak_inflight == 2
