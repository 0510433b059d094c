"""PACI's deferred step (--paci-deferred-step): the drift bound derived in
`paci.deferred_step_drift_bound` against the simulator, which runs the schedule with each
update applied just before the stage's next last backward, and the flags' refusals."""

import pytest
from small_run_flags import error_of, validated

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import (
    deferred_step_drift_bound,
    drift_bound,
    with_paci_options,
)
from megatron.pipeline.simulation.engine import simulate


@pytest.mark.parametrize("limit", ["depth", "flush"])
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("accumulation", [1, 2, 3, 4, 8, 9])
def test_the_simulator_reaches_the_derived_bound(stages, accumulation, limit):
    schedule = with_paci_options(get_schedule("paci"), None, limit)
    run = dict(num_stages=stages, microbatches_per_step=accumulation, steps=3 * stages,
               forward_cost=1.0, backward_cost=2.0)  # fmt: skip
    plain = simulate(schedule, **run)
    expected = [deferred_step_drift_bound(s, stages, accumulation, limit) for s in range(stages)]
    for passes in sorted({1, accumulation // 2 or 1, accumulation}):  # D: where the update lands
        deferred = simulate(schedule, deferred_step=passes, **run)
        assert deferred.max_drift_per_stage == expected, passes
    assert simulate(schedule, deferred_step=True, **run).max_drift_per_stage == expected
    plain_bound = [drift_bound(s, stages, accumulation, limit) for s in range(stages)]
    # (plain PACI under the flush limit with a < N stays below its bound: a bound, not a rule)
    assert all(d <= b for d, b in zip(plain.max_drift_per_stage, plain_bound))
    # at most one step more than plain PACI's bound, the last stage exactly one
    assert all(0 <= d - p <= 1 for d, p in zip(expected, plain_bound))
    assert expected[-1] == 1


def test_the_bound_in_closed_form():
    n = 8
    assert [deferred_step_drift_bound(s, n, 8) for s in range(n)] == [1] * 8
    assert [deferred_step_drift_bound(s, n, 4) for s in range(n)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert [deferred_step_drift_bound(s, n, 1) for s in range(n)] == list(range(8, 0, -1))


PP2_DP2 = ["--pipeline-schedule", "paci", "--pipeline-model-parallel-size", "2",
           "--untie-embeddings-and-output-weights", "--paci-deferred-step"]  # fmt: skip


def test_deferred_step_flags():
    assert validated(PP2_DP2, world_size=4).paci_deferred_step
    assert validated(PP2_DP2, world_size=2).paci_deferred_step  # DP 1: the semantics only
    flush = [f if f != "paci" else "1f1b" for f in PP2_DP2]
    assert error_of(flush, world_size=4) == "--paci-deferred-step needs --pipeline-schedule paci"
    tied = [f for f in PP2_DP2 if f != "--untie-embeddings-and-output-weights"]
    assert "tied embeddings over several stages" in error_of(tied, world_size=4)
    assert validated(PP2_DP2, world_size=4).paci_deferred_step == 2  # the bare flag: a = 2
    assert validated(PP2_DP2 + ["1"], world_size=4).paci_deferred_step == 1
    assert error_of(PP2_DP2 + ["3"], world_size=4) == (
        "--paci-deferred-step D needs 1 <= D <= 2 (microbatches per step), got 3"
    )
    for extra, named in [
        (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
        (["--calculate-per-token-loss"], "--calculate-per-token-loss"),
        (["--paci-weight-stashing"], "--paci-weight-stashing"),
    ]:
        message = error_of(PP2_DP2 + extra, world_size=4)
        assert message == f"--paci-deferred-step with {named} is not supported yet", message
