"""Pure schedule-policy properties: decisions from counters alone, no timing, no simulator."""

import dataclasses
import math

import pytest

from megatron.pipeline.schedules import (
    SCHEDULES,
    SIMULATED_SCHEDULES,
    get_schedule,
    paci,
    pipedream,
    pipedream_2bw,
    zb_h1,
)
from megatron.pipeline.schedules.base import Action, ActionKind, StageView

F, B, W, S = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD, ActionKind.STEP)


def view(stage=0, num_stages=4, m=4, forwards=0, backwards=0, steps=0, call=1, calls=1, **kw):
    fields = dict(
        stage=stage,
        num_stages=num_stages,
        microbatches_per_step=m,
        forwards=forwards,
        backwards=backwards,
        steps=steps,
        forward_limit=calls * m,
        backward_target=call * m,
        input_ready=True,
        grad_ready=forwards > backwards,
    )
    fields.update(kw)
    return StageView(**fields)


def walk(schedule, stage, num_stages, m, calls=1):
    """The actions of one stage when every input and gradient is always there already."""
    counters = dict(forwards=0, backwards=0, steps=0, weight_grads=0)
    names = []
    for call in range(1, calls + 1):
        for _ in range(10 * m * calls + 10):
            v = view(stage, num_stages, m, call=call, calls=calls, **counters)
            action = schedule.next_action(v)
            if action.kind is ActionKind.DONE:
                break
            assert action.kind is not ActionKind.WAIT, (schedule.name, names)
            key = {F: "forwards", B: "backwards", W: "weight_grads", S: "steps"}[action.kind]
            if action.microbatch is not None:
                assert action.microbatch == counters[key]
            counters[key] += 1
            names.append(str(action))
        else:
            raise AssertionError(f"{schedule.name} never finished call {call}: {names}")
    return names


def test_registries_keep_runtime_schedules_apart():
    assert set(SCHEDULES) == {"1f1b", "paci", "2bw", "pipedream", "zb-h1", "zb-v", "dualpipe-v",
                              "zb-interleaved"}  # fmt: skip
    assert set(SIMULATED_SCHEDULES) == {"1f1b", "paci", "2bw", "pipedream", "gpipe", "zb-h1",
                                        "interleaved-1f1b", "zb-v", "dualpipe-v",
                                        "paci-interleaved", "zb-interleaved"}  # fmt: skip
    assert all(SIMULATED_SCHEDULES[name] is s for name, s in SCHEDULES.items())
    assert get_schedule("zb-h1") is get_schedule("zb-h1", simulated=True) is zb_h1.SCHEDULE
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        get_schedule("gpipe")


def test_action_kinds_gained_weight_grad_and_the_vocabulary_passes():
    assert [k.value for k in ActionKind] == [
        "F",
        "B",
        "S",
        "wait",
        "done",
        "W",
        "VF",
        "VB",
        "EF",
        "EB",
    ]
    assert str(Action(W, 3)) == "W3"
    assert str(Action(ActionKind.VOCAB_FORWARD, 2)) == "VF2"


ONE_CHUNK_PER_STAGE = sorted(n for n, s in SIMULATED_SCHEDULES.items() if s.placement is None)


@pytest.mark.parametrize("name", ONE_CHUNK_PER_STAGE)  # virtual stages: test_virtual_stages.py
def test_every_schedule_finishes_each_call_with_its_steps(name):
    schedule = SIMULATED_SCHEDULES[name]
    n, m, calls = 4, 4, 3
    for stage in range(n):
        names = walk(schedule, stage, n, m, calls)
        assert names.count("S") == (calls * m if name == "pipedream" else calls)
        assert sum(a.startswith("F") for a in names) == calls * m
        assert sum(a.startswith("B") for a in names) == calls * m
        assert sum(a.startswith("W") for a in names) == (
            calls * m if schedule.splits_backward else 0
        )


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_static_orders_keep_1f1b_in_flight_count(name):
    n, m = 8, 8
    for stage in range(n):
        inflight = peak = 0
        for action in walk(SIMULATED_SCHEDULES[name], stage, n, m, calls=2):
            inflight += action.startswith("F") - action.startswith("B")
            peak = max(peak, inflight)
        assert peak == n - stage


@pytest.mark.parametrize("name", ["paci", "2bw", "pipedream"])
def test_async_admission_stops_at_n_minus_s_in_flight(name):
    schedule, n, m = SIMULATED_SCHEDULES[name], 8, 8
    for stage in range(n):
        forwards = 0
        while True:  # inputs keep arriving, no gradient ever does
            v = view(stage, n, m, forwards=forwards, grad_ready=False, calls=4)
            if schedule.next_action(v).kind is not F:
                break
            forwards += 1
        assert forwards == n - stage
        # a reactive rule waits for an arrival; a fixed order names the backward it blocks on
        blocked = ActionKind.WAIT if schedule.depends_on_arrivals else B
        assert schedule.next_action(v).kind is blocked


def test_flush_and_gpipe_orders():
    assert walk(SIMULATED_SCHEDULES["1f1b"], 1, 4, 4) == (
        "F0 F1 F2 B0 F3 B1 B2 B3 S".split()
    )  # warmup N - s - 1 = 2, then one forward, one backward
    assert walk(SIMULATED_SCHEDULES["gpipe"], 1, 4, 4) == "F0 F1 F2 F3 B0 B1 B2 B3 S".split()


def test_zb_h1_defers_stage_s_weight_gradients_by_s():
    order = {s: walk(zb_h1.SCHEDULE, s, 4, 4) for s in range(4)}
    assert order[0] == "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3 S".split()
    assert order[3] == "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3 S".split()
    assert order[1] == "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3 S".split()
    for stage, names in order.items():  # the order of F and B is 1F1B's
        assert [a for a in names if a[0] in "FBS"] == walk(SIMULATED_SCHEDULES["1f1b"], stage, 4, 4)


def test_paci_prefers_a_ready_backward_and_admits_up_to_n_minus_s():
    assert paci.next_action(view(stage=1, forwards=2, backwards=0, grad_ready=True)).kind is B
    assert paci.next_action(view(stage=1, forwards=2, grad_ready=False)).kind is F
    assert paci.next_action(view(stage=1, forwards=3, grad_ready=False)).kind is ActionKind.WAIT
    assert paci.next_action(
        view(stage=1, forwards=1, input_ready=False, grad_ready=False)
    ).kind is (ActionKind.WAIT)


@pytest.mark.parametrize("n,a", [(4, 1), (4, 2), (8, 3), (8, 8)])
def test_paci_drift_bound_is_ceil(n, a):
    assert [paci.drift_bound(s, n, a) for s in range(n)] == [
        math.ceil((n - 1 - s) / a) for s in range(n)
    ]


def test_pipedream_steps_after_every_backward_whatever_the_call_length():
    v = view(stage=0, m=4, forwards=3, backwards=1, steps=0)
    assert pipedream.next_action(v).kind is S
    assert paci.next_action(v).kind is not S  # PACI accumulates a = 4 first
    assert pipedream.next_action(dataclasses.replace(v, steps=1)).kind is not S


def test_stashing_fields():
    sched = SIMULATED_SCHEDULES
    assert not sched["paci"].stashes_weights and not sched["1f1b"].stashes_weights
    assert sched["2bw"].stashes_weights and sched["pipedream"].stashes_weights
    assert [sched["2bw"].extra_weight_versions(s, 8) for s in range(8)] == [1] * 8
    assert [sched["pipedream"].extra_weight_versions(s, 8) for s in range(8)] == list(
        range(7, -1, -1)
    )
    assert [sched["paci"].extra_weight_versions(s, 8) for s in range(8)] == [0] * 8
    assert sched["2bw"].min_microbatches_per_step(8) == 7
    assert sched["zb-h1"].splits_backward


def test_2bw_pins_batch_b_to_version_b_minus_1():
    version = pipedream_2bw.forward_weight_version
    m = 4
    assert [version(mb, m, 5) for mb in range(0, 16, 2)] == [0, 0, 0, 0, 1, 1, 2, 2]


def test_schedule_properties_say_what_the_training_loop_needs():
    flush, paci_schedule = get_schedule("1f1b"), get_schedule("paci")
    assert flush.global_grad_norm and not flush.steps_within_call
    assert not paci_schedule.global_grad_norm and paci_schedule.steps_within_call
    assert get_schedule("gpipe", simulated=True).global_grad_norm  # synchronous too


def test_every_registered_schedule_has_an_entry_point():
    from megatron.pipeline.forward_backward import get_forward_backward_func
    from megatron.pipeline.schedules import SCHEDULES

    for name, schedule in SCHEDULES.items():
        entry = get_forward_backward_func(name)
        assert entry.args == (schedule,)
    with pytest.raises(ValueError, match="pass optimizer_step_func"):
        get_forward_backward_func("paci")(forward_step_func=None, data_iterator=None, model=None,
                                          num_microbatches=1, seq_length=1, micro_batch_size=1)  # fmt: skip
