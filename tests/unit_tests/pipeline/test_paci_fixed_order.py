"""PACI's fixed (deterministic) order against its reactive rules, in the simulator."""

import pytest

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import FIXED_ORDER, drift_bound
from megatron.pipeline.simulation import simulate
from megatron.pipeline.trace import action_order


def run(schedule, num_stages, a, forward_cost=1.0, backward_cost=2.0, steps=30):
    return simulate(
        schedule,
        num_stages=num_stages,
        microbatches_per_step=a,
        steps=steps,
        forward_cost=forward_cost,
        backward_cost=backward_cost,
    )


@pytest.mark.parametrize("num_stages, a", [(4, 1), (4, 2), (4, 4), (8, 3)])
def test_fixed_order_equals_reactive_order_for_uniform_costs(num_stages, a):
    reactive = run(get_schedule("paci"), num_stages, a)
    fixed = run(FIXED_ORDER, num_stages, a)
    assert action_order(fixed.timeline) == action_order(reactive.timeline)


@pytest.mark.parametrize("slow_stage", [0, 1, 2, 3])
def test_fixed_order_keeps_bound_and_memory_with_a_slow_stage(slow_stage):
    forward = [1.0] * 4
    backward = [2.0] * 4
    forward[slow_stage], backward[slow_stage] = 3.0, 6.0
    result = run(FIXED_ORDER, 4, 2, forward_cost=forward, backward_cost=backward)
    assert result.max_drift_per_stage == [drift_bound(s, 4, 2) for s in range(4)]
    assert result.peak_inflight_per_stage == [4, 3, 2, 1]
    reactive = run(get_schedule("paci"), 4, 2, forward_cost=forward, backward_cost=backward)
    # Reacting to arrivals is never slower than the fixed order.
    assert reactive.makespan <= result.makespan + 1e-9
