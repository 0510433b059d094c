"""PACI's arrival rules on uneven and noisy stages (simulator only, no timing).

The default rule must run every uneven pipeline of the study's grid at its slowest stage's
pace (within 1%) with PACI's drift bound and admission; the paper's backward-first rule is
the reference that misses it (which is why it is not the default).
"""

import pytest

from megatron.benchmarks.arrival_study import Case, grid, run_case, summarize
from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import (
    ARRIVAL_RULES,
    DEFAULT_ARRIVAL_RULE,
    FIXED_ORDER,
    with_paci_options,
)
from megatron.pipeline.simulation import simulate
from megatron.pipeline.simulation.costs import CostNoise, stage_values

UNEVEN_CASES = grid()  # N in {4, 8}, a in {1, 4, 8}, slow first/middle/last at 1.2x .. 3x


@pytest.mark.parametrize("case", UNEVEN_CASES, ids=str)
def test_default_rule_runs_at_the_slowest_stage_pace(case):
    run = run_case(case, DEFAULT_ARRIVAL_RULE, microbatches=64)
    assert run["pace"] >= 0.99, run
    assert run["drift_within_bound"], run
    assert run["peak_inflight"] == [case.num_stages - s for s in range(case.num_stages)], run


def test_backward_first_misses_the_pace_with_a_slow_first_stage():
    # The issue this rule set answers: 4 stages, F/B = 1/2, stage 0 at twice that.
    run = run_case(Case(4, 4, "first", 2.0), "backward-first", microbatches=64)
    assert run["pace"] < 0.95
    assert run["drift_within_bound"]


def test_every_rule_keeps_admission_and_drift_under_noise():
    cases = [Case(n, a, "middle", 1.5, cv=0.3, seed=7) for n in (4, 8) for a in (1, 4)]
    rows = [run_case(case, rule, microbatches=48) for case in cases for rule in ARRIVAL_RULES]
    summary = summarize(rows, DEFAULT_ARRIVAL_RULE)
    assert all(summary["drift_within_bound"].values())
    assert all(summary["inflight_within_admission"].values())
    assert 0 < summary["noise_levels"][0.3]["worst_pace"]["fixed"] <= 1.0


def test_noise_draws_are_seeded_and_shared_by_rules():
    a, b = CostNoise(0.2, seed=3), CostNoise(0.2, seed=3)
    draws = [a.factor(1, "F", k) for k in range(1000)]
    assert draws == [b.factor(1, "F", k) for k in range(1000)]
    assert draws != [CostNoise(0.2, seed=4).factor(1, "F", k) for k in range(1000)]
    mean = sum(draws) / len(draws)
    std = (sum((d - mean) ** 2 for d in draws) / len(draws)) ** 0.5
    assert abs(mean - 1.0) < 0.02 and abs(std / mean - 0.2) < 0.02
    assert CostNoise([0.0, 0.3], seed=1).factor(0, "B", 5) == 1.0


def test_noise_changes_a_simulation_reproducibly():
    kwargs = dict(num_stages=4, microbatches_per_step=4, steps=8, forward_cost=1.0,
                  backward_cost=2.0, record_timeline=False)  # fmt: skip
    plain = simulate(FIXED_ORDER, **kwargs)
    noisy = [simulate(FIXED_ORDER, noise=CostNoise(0.3, seed=5), **kwargs) for _ in range(2)]
    assert noisy[0].makespan == noisy[1].makespan != plain.makespan
    assert plain.makespan == pytest.approx((4 + 32 - 1) * 3.0)


def test_rule_selection():
    assert with_paci_options(get_schedule("paci"), None) is get_schedule("paci")
    assert get_schedule("paci") is ARRIVAL_RULES[DEFAULT_ARRIVAL_RULE]
    for rule, schedule in ARRIVAL_RULES.items():
        assert with_paci_options(get_schedule("paci"), rule) is schedule
        assert schedule.fixed_order is FIXED_ORDER  # --deterministic-mode: the fixed order
    assert with_paci_options(get_schedule("1f1b"), DEFAULT_ARRIVAL_RULE) is get_schedule("1f1b")
    with pytest.raises(ValueError, match="paci schedule only"):
        with_paci_options(get_schedule("1f1b"), "backward-first")
    with pytest.raises(ValueError, match="unknown PACI arrival rule"):
        with_paci_options(get_schedule("paci"), "sideways")


def test_inflight_limit_selection():
    paci = get_schedule("paci")
    capped = with_paci_options(paci, None, "flush")
    assert capped is with_paci_options(paci, DEFAULT_ARRIVAL_RULE, "flush")  # one per pair
    assert capped is not paci and capped.fixed_order is not FIXED_ORDER
    assert with_paci_options(paci, "backward-first", "flush").fixed_order is capped.fixed_order
    assert with_paci_options(paci, None, "depth") is paci
    assert with_paci_options(get_schedule("2bw"), None, "depth") is get_schedule("2bw")
    with pytest.raises(ValueError, match="--paci-inflight-limit flush applies to the paci"):
        with_paci_options(get_schedule("1f1b"), None, "flush")
    with pytest.raises(ValueError, match="unknown PACI in-flight limit"):
        with_paci_options(paci, None, "sideways")


def test_stage_values_flag_type():
    assert stage_values("20") == 20.0
    assert stage_values("20,40,20") == [20.0, 40.0, 20.0]
    for bad in ("x", "1,-2", "nan"):
        with pytest.raises(Exception, match="expected|finite"):
            stage_values(bad)
