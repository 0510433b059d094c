"""The single-process engine (megatron/studies/single_process_engine.py) against real
4-process runs, and PACI's accumulation schedule in the runtime.

The engine runs every stage's rank executor in one process, each asking the run's schedule for
its next pass as a rank does; the 4-process run exchanges activations and gradients over gloo.
Both must give the same training and validation losses: tied embeddings (Megatron's default,
the exchange of optimizer/tied_embeddings.py over queues) with RoPE under PACI and with Xavier
initialization under 2BW (the engine builds its stages with the ranks' builder), PACI with error feedback, a per-stage LR (`--paci-stage-lr-scale`, which scales stage
0's LR by 0.4 there: a runtime that ignored it would differ) and drains at each evaluation, PACI
whose a changes (`--paci-accumulation-schedule`), PACI with Muon and a decoupled LR, MoE under
PACI, flush, 2BW and PipeDream, PipeDream-2BW (with Muon and error feedback) and PipeDream, whose weight
stashing the engine's executors do as the ranks' do, and flush (which the engine trains as one
stage), and PACI with a synchronous start and cool-down. The 4-process runs are
test_cases/gpt/engine_pp4_* and gpt_pp4_paci_sync_phases, run with the other cases.
"""

import json
import math
import os
import subprocess
import sys

import background
import pytest
import run_cases

CASES = [
    "engine_pp4_paci_ef",
    "engine_pp4_1f1b",
    "engine_pp4_paci_accumulation_schedule",
    "engine_pp4_2bw_muon_ef",
    "engine_pp4_pipedream",
    "engine_pp4_paci_stash",
    "engine_pp4_paci_moe",
    "engine_pp4_1f1b_moe",
    "engine_pp4_2bw_moe",
    "engine_pp4_paci_muon_decoupled",
    "engine_pp4_pipedream_moe",
    "engine_pp4_paci_tied_rope",
    "engine_pp4_2bw_tied",
    "engine_pp4_paci_deferred",
]
# The engine alone, without the flag under test, for the difference it makes.
UNSTASHED = "engine_pp4_paci_stash:without stashing"
COUPLED = "engine_pp4_paci_muon_decoupled:one LR"
EVALUATED_LESS = "engine_pp4_1f1b:evaluated every 8"
# Runs stopped at this iteration's evaluation and resumed from their last checkpoint: a phase
# of PACI's accumulation schedule crossed after the resume, error feedback's buffers with a
# per-stage LR, Muon with a decoupled LR, PACI with tied embeddings (their exchange's lag), MoE,
# and flush.
RESUMED = {
    "engine_pp4_paci_accumulation_schedule": 8,
    "engine_pp4_paci_ef": 12,
    "engine_pp4_paci_muon_decoupled": 8,
    "engine_pp4_paci_tied_rope": 12,
    "engine_pp4_paci_moe": 4,
    "engine_pp4_1f1b": 8,
}
# PACI with a synchronous start and cool-down (1F1B-flush for iterations 1-2 and 5-6), the
# 4-process run of test_optimizer_cases.py; the engine without the two flags; and evaluated every
# 2 iterations, stopped at 6 and resumed from its checkpoint of 4 (the cool-down's start).
SYNC_PHASES = "gpt_pp4_paci_sync_phases"
SYNC_PHASES_EF = "gpt_pp4_paci_sync_phases_ef"  # with error feedback, off in the phases
SYNC_FLAGS = ("--async-sync-warmup-iters", "--async-sync-cooldown-iters")
ASYNC_THROUGHOUT = f"{SYNC_PHASES}:without synchronous phases"
SYNC_EVALUATED = f"{SYNC_PHASES}:evaluated every 2"
STASHING = "engine_pp4_2bw_muon_ef"  # its checkpoints would need the executors' weight stash
EXITED = "engine_pp4_paci_ef:stopped by --exit-interval 8"
HERE = os.path.dirname(os.path.abspath(__file__))


@background.started_with_the_session
def engine_results(output: str) -> dict[str, dict]:
    """Every case trained by the engine, in one subprocess (a fresh process per module, as the
    engine sets up torch.distributed for itself)."""
    cases = run_cases.discover_cases()
    spec = {
        name: run_cases.with_index_cache(run_cases.flags(cases[name]["MODEL_ARGS"], output), output)
        for name in [*CASES, SYNC_PHASES, SYNC_PHASES_EF]
    }
    spec[ASYNC_THROUGHOUT] = without_flags(spec[SYNC_PHASES], SYNC_FLAGS)
    spec[SYNC_EVALUATED] = without_flags(spec[SYNC_PHASES], ("--eval-interval", "--eval-iters"))
    spec[SYNC_EVALUATED] += ["--eval-interval", "2", "--eval-iters", "1"]
    spec[UNSTASHED] = [f for f in spec["engine_pp4_paci_stash"] if f != "--paci-weight-stashing"]
    decoupled = spec["engine_pp4_paci_muon_decoupled"]
    at = decoupled.index("--decoupled-lr")
    assert decoupled[at + 2] == "--decoupled-min-lr"
    spec[COUPLED] = decoupled[:at] + decoupled[at + 4 :]
    flush = spec["engine_pp4_1f1b"]
    at = flush.index("--eval-interval")
    spec[EVALUATED_LESS] = flush[: at + 1] + ["8"] + flush[at + 2 :]
    runs = {name: {"flags": flags} for name, flags in spec.items()}
    for name, stop_at in {**RESUMED, STASHING: 8, SYNC_EVALUATED: 6}.items():
        runs[f"{name}:resumed"] = {"flags": spec[name], "stop_at": stop_at}
    runs[EXITED] = {"flags": spec["engine_pp4_paci_ef"], "exit_interval": 8}
    spec_file = os.path.join(output, "engine_runs.json")
    json.dump(runs, open(spec_file, "w"))
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run([sys.executable, os.path.join(HERE, "engine_runs.py"), spec_file],
                               capture_output=True, text=True, env=environment)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def without_flags(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """`flags` less the named ones and their values."""
    kept, index = [], 0
    while index < len(flags):
        if flags[index] in names:
            index += 2
            continue
        kept.append(flags[index])
        index += 1
    assert len(kept) == len(flags) - 2 * len(names), "a flag to remove is missing"
    return kept


def validation_losses(entries: list[dict]) -> list[float]:
    return [entry["lm loss"] for entry in entries]


ASYNC_CASES = [
    "engine_pp4_paci_ef",
    "engine_pp4_paci_accumulation_schedule",
    "engine_pp4_2bw_muon_ef",
    "engine_pp4_pipedream",
    "engine_pp4_paci_stash",
    "engine_pp4_2bw_moe",
    "engine_pp4_paci_muon_decoupled",
    "engine_pp4_pipedream_moe",
    "engine_pp4_paci_tied_rope",
    "engine_pp4_2bw_tied",
    "engine_pp4_paci_deferred",
]


@pytest.mark.parametrize("name", ASYNC_CASES)
def test_engine_equals_the_asynchronous_runtime(case_results, engine_results, name):
    runtime, engine = case_results[name], engine_results[name]
    assert len(engine["loss"]) == runtime["iterations"]
    assert run_cases.relative_difference(engine["loss"], runtime["loss"]) <= 1e-6
    evaluated = list(range(4, runtime["iterations"] + 1, 4))
    assert len(runtime["validation"]) == len(evaluated)
    assert [e["iteration"] for e in engine["validation"]] == evaluated
    assert (
        run_cases.relative_difference(
            validation_losses(engine["validation"]), validation_losses(runtime["validation"])
        )
        <= 1e-6
    )


def test_engine_runs_the_synchronous_phases_as_the_runtime(case_results, engine_results):
    """--async-sync-warmup-iters 2 --async-sync-cooldown-iters 2 over 6 iterations: the engine's
    stages run 1F1B-flush for iterations 1-2 and 5-6 and PACI between, as the 4 processes do
    (equal losses within 1e-6); PACI throughout gives other numbers, so the phases are really
    run; a run resumed from its checkpoint at the cool-down's start gives the uninterrupted
    run's numbers; with error feedback (the plain update in the phases) too the engine's
    numbers are the runtime's."""
    runtime, engine = case_results[SYNC_PHASES], engine_results[SYNC_PHASES]
    assert len(engine["loss"]) == runtime["iterations"] == 6
    assert run_cases.relative_difference(engine["loss"], runtime["loss"]) <= 1e-6
    assert [phase["max_drift"] for phase in engine["phases"]] == [[1, 1, 1, 0]]
    throughout = engine_results[ASYNC_THROUGHOUT]["loss"]
    assert run_cases.relative_difference(throughout, runtime["loss"]) > 1e-5
    whole, resumed = engine_results[SYNC_EVALUATED], engine_results[f"{SYNC_EVALUATED}:resumed"]
    assert resumed["first_evaluation"] == 6, "the resumed run started over"
    assert resumed["loss"] == whole["loss"]
    assert run_cases.relative_difference(whole["loss"], runtime["loss"]) <= 1e-6
    assert resumed["validation"] == whole["validation"]
    assert resumed["final_validation"] == whole["final_validation"] is not None
    # with error feedback, which the stages' optimizers step as the plain update in the phases
    feedback = engine_results[SYNC_PHASES_EF]["loss"]
    assert run_cases.relative_difference(feedback, case_results[SYNC_PHASES_EF]["loss"]) <= 1e-6
    assert run_cases.relative_difference(feedback, engine["loss"]) > 1e-5


@pytest.mark.parametrize("name", RESUMED)
def test_a_stopped_run_goes_on_from_its_checkpoint(engine_results, name):
    """A run stopped at an evaluation and trained again from its checkpoint (the last drain
    point's: weights, optimizers with their corrections' buffers, LR schedules, data position,
    what was measured) gives the uninterrupted run's numbers exactly, and did not start over."""
    whole, resumed = engine_results[name], engine_results[f"{name}:resumed"]
    assert resumed["first_evaluation"] == RESUMED[name], "the resumed run started over"
    assert resumed["loss"] == whole["loss"]
    assert resumed["validation"] == whole["validation"]
    assert resumed["tokens"] == whole["tokens"]
    assert resumed["phases"] == whole["phases"]
    assert resumed["final_validation"] == whole["final_validation"] is not None


def test_a_run_stopped_by_exit_interval_goes_on_from_there(engine_results):
    """--exit-interval 8 (a study's screen) stops the run at iteration 8 with its checkpoint and
    no final evaluation; trained again without the flag, it goes on from iteration 8 to the
    uninterrupted run's numbers (the flag is not one that decides them)."""
    whole, resumed = engine_results["engine_pp4_paci_ef"], engine_results[EXITED]
    assert resumed["stopped_at"] == 8 and resumed["stopped_final"] is None
    assert resumed["first_evaluation"] == 12, "the resumed run did not go on from iteration 8"
    assert resumed["loss"] == whole["loss"]
    assert resumed["validation"] == whole["validation"]
    assert resumed["final_validation"] == whole["final_validation"] is not None


def test_the_final_evaluation_reads_the_same_batches_however_often_a_run_evaluated(
    engine_results,
):
    """Flush evaluated every 4 and every 8 iterations trains the same weights. Each periodic
    evaluation reads on through the validation split, so the two runs' evaluations of iteration
    8 read different batches; the final evaluation reads the split's first batches in both
    (what makes two runs' final losses comparable when they evaluated a different number of
    times, as PACI with an accumulation schedule does against flush)."""
    often, less = engine_results["engine_pp4_1f1b"], engine_results[EVALUATED_LESS]
    assert often["loss"] == less["loss"]
    assert often["validation"][-1]["iteration"] == less["validation"][-1]["iteration"] == 8
    assert often["validation"][-1]["lm loss"] != less["validation"][-1]["lm loss"]
    assert often["final_validation"] is not None
    assert often["final_validation"] == less["final_validation"]


def test_a_weight_stashing_run_is_refused_a_checkpoint(engine_results):
    refused = engine_results[f"{STASHING}:resumed"].get("refused", "")
    assert "2bw keeps weight versions across drain points" in refused


@pytest.mark.parametrize("name", ["engine_pp4_1f1b", "engine_pp4_1f1b_moe"])
def test_engine_flush_equals_the_four_stage_flush(case_results, engine_results, name):
    """The engine trains flush as one stage; 4 stages sum the same gradients in another order.
    With MoE the one stage scales the aux loss and updates the expert bias as the 4 do."""
    runtime, engine = case_results[name], engine_results[name]
    assert run_cases.relative_difference(engine["loss"], runtime["loss"]) <= 1e-5
    assert (
        run_cases.relative_difference(
            validation_losses(engine["validation"]), validation_losses(runtime["validation"])
        )
        <= 1e-5
    )


def drift_bound(stage: int, num_stages: int, a: int) -> int:
    return math.ceil((num_stages - 1 - stage) / a)


def test_the_deferred_step_reaches_its_drift_bound_in_both(case_results, engine_results):
    """--paci-deferred-step at a = 2 on 4 stages: the updates land before each next step's last
    backward, so stage s crosses up to ceil((N - s) / a) = 2 2 1 1 steps, one more than plain
    PACI on stages 1 and 3, in the runtime and in the engine; and it changes the numbers
    (engine_pp4_paci_ef is the same run without it)."""
    from megatron.pipeline.schedules.paci import deferred_step_drift_bound

    runtime = case_results["engine_pp4_paci_deferred"]
    n, a = runtime["pipeline_stages"], runtime["num_microbatches"]
    expected = [deferred_step_drift_bound(s, n, a) for s in range(n)]
    assert expected == [2, 2, 1, 1]
    assert [report["max_drift"] for report in runtime["stages"]] == expected
    assert [
        phase["max_drift"] for phase in engine_results["engine_pp4_paci_deferred"]["phases"]
    ] == [expected]
    plain = case_results["engine_pp4_paci_ef"]["loss"]
    assert run_cases.relative_difference(runtime["loss"], plain) > 1e-5


def test_accumulation_schedule_drift_equals_each_phases_bound(case_results, engine_results):
    """a = 4, 1, 2 in turn: each phase's measured max drift per stage is its own bound
    ceil((N - 1 - s) / a), in the runtime's summary and in the engine."""
    runtime = case_results["engine_pp4_paci_accumulation_schedule"]
    stages = runtime["pipeline_stages"]
    for report in runtime["stages"]:
        measured = {int(a): d for a, d in report["max_drift_by_accumulation"].items()}
        expected = {a: drift_bound(report["stage"], stages, a) for a in (4, 1, 2)}
        assert measured == expected, report["stage"]
        assert report["optimizer_steps"] == runtime["iterations"] == 14
    phases = engine_results["engine_pp4_paci_accumulation_schedule"]["phases"]
    assert [(p["a"], p["iterations"]) for p in phases] == [(4, 3), (1, 6), (2, 5)]
    for phase in phases:
        assert phase["max_drift"] == [drift_bound(s, stages, phase["a"]) for s in range(stages)]


def test_accumulation_schedule_sets_each_iterations_batch(case_results):
    """Global batch = a x micro batch (2): 8 samples per iteration for 3 iterations, 2 for the
    next 6, then 4 (Megatron's consumed-samples log field)."""
    log = case_results["engine_pp4_paci_accumulation_schedule"]["log"]
    for iteration, consumed in ((1, 8), (3, 24), (4, 26), (9, 36), (10, 40), (14, 56)):
        assert f" iteration {iteration:8d}/      14 | consumed samples: {consumed:12d} |" in log


def test_the_stashing_schedules_keep_their_weight_versions(case_results):
    """The runs compared above really stash: 2BW keeps one extra version on every stage (the
    next batch forwards on the version before the newest, also on the last stage), PipeDream
    N - 1 - s on stage s (the runtime's own count), so the engine's equality covers forwards
    and backwards on old weights."""
    for name, extra in (("engine_pp4_2bw_muon_ef", lambda s, n: 1),
                        ("engine_pp4_2bw_moe", lambda s, n: 1),
                        ("engine_pp4_pipedream", lambda s, n: n - 1 - s),
                        ("engine_pp4_pipedream_moe", lambda s, n: n - 1 - s)):  # fmt: skip
        summary = case_results[name]
        n = summary["pipeline_stages"]
        measured = [report["extra_weight_versions"] for report in summary["stages"]]
        assert measured == [extra(s, n) for s in range(n)], (name, measured)


def test_paci_weight_stashing_keeps_the_drift_bound_in_stashed_copies(case_results,
                                                                      engine_results):  # fmt: skip
    """--paci-weight-stashing (a = 2): stage s holds ceil((N - 1 - s) / a) stashed versions,
    PACI's drift bound (the versions its microbatches in flight were forwarded on), while the
    drift between a microbatch's forward and backward weights is gone (0 on every stage), and
    running backwards on the forwards' weights changes the numbers (the engine's run without
    the flag)."""
    summary = case_results["engine_pp4_paci_stash"]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    assert a == 2
    for report in summary["stages"]:
        assert report["extra_weight_versions"] == drift_bound(report["stage"], n, a), report
        assert report["max_drift"] == 0, report
    stashed, plain = engine_results["engine_pp4_paci_stash"], engine_results[UNSTASHED]
    assert run_cases.relative_difference(stashed["loss"], plain["loss"]) > 1e-5


def test_engine_moe_paci_equals_the_four_process_run(case_results, engine_results):
    """MoE (4 experts, top-2, aux loss, sigmoid scores with the expert bias, alltoall) at
    EP=1 x PP=4 under PACI's fixed order: the engine's stages set the aux-loss gradient scale
    at each backward and update their expert bias at their own steps, as the 4 processes do:
    equal training and validation losses within 1e-6 (measured 5.2e-8)."""
    runtime, engine = case_results["engine_pp4_paci_moe"], engine_results["engine_pp4_paci_moe"]
    assert runtime["pipeline_stages"] == 4 and len(engine["loss"]) == runtime["iterations"] == 4
    assert run_cases.relative_difference(engine["loss"], runtime["loss"]) <= 1e-6
    assert [e["iteration"] for e in engine["validation"]] == [2, 4]
    assert (
        run_cases.relative_difference(
            validation_losses(engine["validation"]), validation_losses(runtime["validation"])
        )
        <= 1e-6
    )
    assert engine["loss"][-1] < engine["loss"][0]


def test_the_decoupled_lr_reaches_the_engines_stages(engine_results):
    """PACI + Muon with the embedding and output layer on --decoupled-lr (the configuration
    docs/convergence.md recommends), equal to the 4-process run above; without the flag the
    engine's losses differ, so both paths really apply it."""
    decoupled, coupled = engine_results["engine_pp4_paci_muon_decoupled"], engine_results[COUPLED]
    assert run_cases.relative_difference(decoupled["loss"], coupled["loss"]) > 1e-4
