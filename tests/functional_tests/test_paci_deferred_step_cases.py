"""PACI's deferred step (--paci-deferred-step) on real multi-process runs (gloo): a stage goes
on with its next passes while the data-parallel reduction of its step is in flight and applies
the update just before its next step's last backward.

* The drift the runtime measures on 4 stages x DP 2 (a = 2) is exactly the derived bound
  ceil((N - s) / a) = 2 2 1 1 (`paci.deferred_step_drift_bound`; plain PACI: 2 1 1 0, run
  beside it), as the simulator predicts it.
* fp32 with the bucketed overlap and bf16 (fp32 main weights, one bucket launched at the
  step): the runs train, the replicas keep equal weights (the weight-hash check), no
  collective crosses stages, the first loss equals plain PACI's and later ones differ (the
  update lands later: a change of semantics, by the bound above).
"""

import math

import pytest
import run_cases

from megatron.pipeline.schedules.paci import deferred_step_drift_bound, drift_bound


def test_the_measured_drift_is_the_derived_bound(case_results):
    deferred, plain = case_results["gpt_dp2pp4_paci_deferred"], case_results["gpt_dp2pp4_paci"]
    n, a = deferred["pipeline_stages"], deferred["num_microbatches"]
    assert (n, a) == (4, 2)
    assert [s["max_drift"] for s in deferred["stages"]] == [
        deferred_step_drift_bound(s, n, a) for s in range(n)
    ]
    assert [s["max_drift"] for s in plain["stages"]] == [drift_bound(s, n, a) for s in range(n)]
    assert (
        "--paci-deferred-step 2: each update lands before the stage's backward 2 of 2 "
        "after its step; drift bound by stage 2 2 1 1 (plain PACI 2 1 1 0)"
    ) in deferred["log"]
    early = case_results["gpt_dp2pp4_paci_deferred_1"]  # D = 1: the same bound, other numbers
    assert [s["max_drift"] for s in early["stages"]] == [2, 2, 1, 1]
    assert early["loss"][0] == deferred["loss"][0] and early["loss"] != deferred["loss"]


@pytest.mark.parametrize(
    "name, plain",
    [
        ("gpt_dp2pp2_paci_deferred", "gpt_dp2pp2_paci"),
        ("gpt_dp2pp2_paci_bf16_deferred", None),
        ("gpt_dp2pp4_paci_deferred", "gpt_dp2pp4_paci"),
        ("gpt_dp2pp4_paci_deferred_1", "gpt_dp2pp4_paci"),
    ],
)
def test_deferred_runs_train_and_keep_replicas_equal(case_results, name, plain):
    run = case_results[name]
    losses = run["loss"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0]
    assert all(4 in checks and 8 in checks for checks in run["weight_hash_checks_by_stage"])
    assert run["cross_stage_collectives"] == 0
    n, a = run["pipeline_stages"], run["num_microbatches"]
    for stage in run["stages"]:
        assert stage["max_drift"] <= deferred_step_drift_bound(stage["stage"], n, a)
        assert stage["optimizer_steps"] == 8
        assert stage["dp_reduced_bytes"] > 0
    if plain is not None:
        reference = case_results[plain]["loss"]
        assert losses[0] == reference[0] and losses != reference
        assert run_cases.relative_difference(losses, reference) < 0.05


def test_the_timeline_shows_the_reductions_beside_the_passes(case_results):
    """--timeline-file: each stage's actions on its track, its data-parallel reductions (one
    event per bucket and step) and the waits for them on a second track."""
    import json
    import os

    run = case_results["gpt_dp2pp2_paci_deferred"]
    trace = json.load(open(os.path.join(run["metrics_dir"], "timeline.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    reductions = [e for e in events if e["name"].startswith("data-parallel reduce bucket")]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"stage 0: data-parallel reduction", "stage 1: data-parallel reduction"} <= names
    for stage in run["stages"]:
        mine = [e for e in reductions if e["tid"] == 1000 + stage["stage"]]
        assert len(mine) == stage["dp_buckets_in_backward"] + stage["dp_buckets_at_step"]
        assert all(e["dur"] >= 0 for e in mine)
    assert any(e["name"].startswith("F") for e in events)  # the passes are there too


def test_a_deferred_run_resumes_exactly(case_results):
    """The save comes at a drain, where the deferred update lands first: nothing half-reduced
    is written, and the resumed run continues the uninterrupted one."""
    whole = case_results["gpt_dp2pp2_paci_deferred"]["loss"]
    assert case_results["gpt_dp2pp2_paci_deferred_resume_1_save"]["loss"] == whole[:4]
    second_half = case_results["gpt_dp2pp2_paci_deferred_resume_2_load"]["loss"]
    assert run_cases.relative_difference(second_half, whole[4:]) <= 1e-6
