"""One description per action kind (schedules.base.KIND_INFO), and a handler for it wherever
actions are handled: the stage checks, the runtime and the simulator. A kind missing from one
of them is refused there, never run as another kind."""

import pytest

from megatron.pipeline.runtime import RankRuntime
from megatron.pipeline.schedules.base import KIND_INFO, Action, ActionKind, Transfer, kind_info
from megatron.pipeline.simulation.engine import SimulationError, _Simulator
from megatron.pipeline.stage_state import StageState

RUNNING = {kind for kind, info in KIND_INFO.items() if info.runs}


def test_every_kind_is_described_once():
    assert set(KIND_INFO) == set(ActionKind)
    assert RUNNING == {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD,
                       ActionKind.STEP, ActionKind.VOCAB_FORWARD,
                       ActionKind.VOCAB_BACKWARD, ActionKind.EMBED_FORWARD,
                       ActionKind.EMBED_BACKWARD}  # fmt: skip
    for kind in RUNNING:  # a kind that runs advances a counter the stage state keeps
        assert hasattr(StageState, "record_" + kind.name.lower())
        assert kind_info(kind).counter is not None


def test_what_travels_between_stages():
    assert kind_info(ActionKind.FORWARD).needs is Transfer.ACTIVATION
    assert kind_info(ActionKind.FORWARD).sends is Transfer.ACTIVATION
    assert kind_info(ActionKind.BACKWARD).needs is Transfer.GRADIENT
    assert kind_info(ActionKind.BACKWARD).sends is Transfer.GRADIENT
    assert kind_info(ActionKind.WEIGHT_GRAD).needs is kind_info(ActionKind.STEP).sends is None
    assert not kind_info(ActionKind.STEP).per_chunk
    # the vocabulary split over the ranks: to every rank and back to the last stage
    assert kind_info(ActionKind.FORWARD).output_sends is Transfer.HIDDEN
    assert kind_info(ActionKind.VOCAB_FORWARD).needs is Transfer.HIDDEN
    assert kind_info(ActionKind.VOCAB_FORWARD).sends is Transfer.SHARD_OUTPUT
    assert kind_info(ActionKind.BACKWARD).output_needs is Transfer.SHARD_OUTPUT
    assert kind_info(ActionKind.BACKWARD).output_sends is Transfer.LOGIT_STATS
    assert kind_info(ActionKind.VOCAB_BACKWARD).needs is Transfer.LOGIT_STATS
    assert not kind_info(ActionKind.VOCAB_FORWARD).per_chunk


@pytest.mark.parametrize(
    "handlers",
    [StageState._CHECKS, RankRuntime._PASS_HANDLERS, _Simulator._FINISHED],
    ids=["stage checks", "runtime", "simulator"],
)
def test_each_handler_table_covers_exactly_the_kinds_that_run(handlers):
    assert set(handlers) == RUNNING


def test_a_kind_without_a_handler_is_refused():
    state = StageState(stage=0, num_stages=2, schedule_name="test")
    unknown = Action("X", 0)  # not an ActionKind
    assert state.problem_with(unknown) == "is not an action a stage can run"
    assert state.problem_with(Action(ActionKind.WAIT)) == "is not an action a stage can run"
    with pytest.raises(ValueError, match="has no entry in KIND_INFO"):
        kind_info("X")


def test_the_simulator_refuses_a_kind_it_cannot_finish():
    simulator = _Simulator.__new__(_Simulator)
    simulator.schedule = type("S", (), {"name": "test"})()
    stage = type("St", (), {"current": (Action(ActionKind.WAIT), 0.0), "busy_intervals": [],
                            "busy_time": 0.0})()  # fmt: skip
    simulator.now, simulator.timeline = 1.0, None
    with pytest.raises(SimulationError, match="the simulator cannot run wait"):
        simulator.finish(stage)
