"""PACI with an accumulation factor that changes at drain points (--paci-accumulation-schedule),
in the simulator: every phase keeps its own drift bound, and a change costs one drain."""

import pytest

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import ARRIVAL_RULES, FIXED_ORDER, drift_bound
from megatron.pipeline.simulation.costs import CostNoise
from megatron.pipeline.simulation.phases import simulate_phases

PHASES = [(8, 3), (4, 4), (1, 10), (2, 6), (3, 4)]  # each long enough to fill 8 stages


@pytest.mark.parametrize("num_stages", [4, 8])
def test_each_phase_reaches_its_own_drift_bound(num_stages):
    """Fixed order: in every phase the most steps a microbatch crosses on stage s is exactly
    ceil((N - 1 - s) / a) for that phase's a, larger a's included (a > N - 1: drift 1)."""
    run = simulate_phases(FIXED_ORDER, num_stages=num_stages, phases=PHASES, forward_cost=1.0,
                          backward_cost=2.0, record_timeline=False)  # fmt: skip
    for (a, steps), result in zip(PHASES, run.results):
        expected = [drift_bound(s, num_stages, a) for s in range(num_stages)]
        assert result.max_drift_per_stage == expected, a
        assert result.optimizer_steps_per_stage == [steps] * num_stages


@pytest.mark.parametrize("rule", sorted(ARRIVAL_RULES))
def test_noisy_uneven_stages_never_exceed_each_phases_bound(rule):
    costs = dict(forward_cost=[1.0, 1.7, 0.6, 1.2], backward_cost=[2.0, 3.1, 1.5, 2.4],
                 noise=CostNoise(cv=0.4, seed=3), record_timeline=False)  # fmt: skip
    run = simulate_phases(ARRIVAL_RULES[rule], num_stages=4, phases=PHASES, **costs)
    for (a, _), result in zip(PHASES, run.results):
        assert all(d <= drift_bound(s, 4, a) for s, d in enumerate(result.max_drift_per_stage))


@pytest.mark.parametrize("num_stages", [4, 8])
def test_a_change_costs_one_drain(num_stages):
    """Same microbatches, uniform costs: a schedule with one change of a takes one pipeline
    drain, (N - 1)(F + B), longer than a constant a; flush pays that at every step."""
    costs = dict(forward_cost=1.0, backward_cost=2.0, record_timeline=False)
    changing = simulate_phases(FIXED_ORDER, num_stages=num_stages, phases=[(8, 10), (4, 60)],
                               **costs)  # fmt: skip
    constant = simulate_phases(FIXED_ORDER, num_stages=num_stages, phases=[(4, 80)], **costs)
    assert changing.microbatches == constant.microbatches == 320
    assert changing.makespan - constant.makespan == pytest.approx((num_stages - 1) * 3.0)
    flush = simulate_phases(get_schedule("1f1b"), num_stages=num_stages, phases=[(4, 80)],
                            **costs)  # fmt: skip
    assert flush.makespan - constant.makespan > 70 * (num_stages - 1) * 3.0
