"""PipeDream-2BW and PipeDream on real 4-process runs (gloo, megatron-core GPT, mock data).

Independent references: the single-process one-step-delayed run (`delayed_reference.py`,
`run_delayed(args, delay=1)`) for 2BW, and for both schedules their definitions (stashed
versions, gradient delay) and the simulator's figures for the same run. The 2BW reference cases
(one per optimizer) run with --clip-grad 0: the runtime clips each stage on its own (no
collective across stages, as PACI), the single-process reference over the whole model.
"""

import math

import background
import delayed_reference_runs
import pytest
import run_cases
from run_cases import relative_difference

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.simulation import simulate

OPTIMIZERS = ["adam", "sgd", "muon", "lion", "adan", "soap", "mars"]
TWO_BW_REFERENCE = [f"gpt_pp4_2bw_opt_{name}" for name in OPTIMIZERS] + [
    "gpt_pp4_2bw_opt_adam_ef",
    "gpt_pp4_2bw_opt_muon_ef",
]
STASHING = ["2bw", "pipedream"]


@background.started_with_the_session
def single_process_losses(directory: str) -> dict[str, list[float]]:
    """The 2BW cases' flags in one process, delayed by one step; PipeDream's at one stage."""
    cases = run_cases.discover_cases()

    def args_of(name: str, changes: dict | None = None) -> list[str]:
        return run_cases.flags({**cases[name]["MODEL_ARGS"], **(changes or {})}, "unused")

    spec = [{"name": n, "args": args_of(n), "delay": 1} for n in TWO_BW_REFERENCE + ["gpt_pp1_2bw"]]
    # The initial weights W(0) throughout: no learning rate, so no optimizer moves them
    frozen = args_of("gpt_pp4_2bw_opt_adam", {"--lr": 0.0, "--min-lr": 0.0, "--train-iters": 3})
    spec.append({"name": "frozen", "args": frozen, "delay": 0})
    # PipeDream on one stage: synchronous steps of one microbatch each (m = 4 per iteration)
    per_microbatch = args_of("gpt_pp1_pipedream", {"--global-batch-size": 2, "--train-iters": 12})
    spec.append({"name": "gpt_pp1_pipedream", "args": per_microbatch, "delay": 0})
    return delayed_reference_runs.run_in_subprocess(spec, directory)


@pytest.mark.parametrize("name", TWO_BW_REFERENCE)
def test_2bw_on_four_stages_equals_the_one_step_delayed_run(case_results, single_process_losses,
                                                           name):  # fmt: skip
    losses = case_results[name]["loss"]
    assert len(losses) == int(run_cases.discover_cases()[name]["MODEL_ARGS"]["--train-iters"]) >= 3
    assert relative_difference(losses, single_process_losses[name]) <= 1e-5


def test_at_one_stage_each_schedule_is_its_optimizer_semantics(case_results,
                                                             single_process_losses):  # fmt: skip
    """2BW: the one-step-delayed run, here with clipping (one stage: the stage's norm is the
    whole model's) and an evaluation drain in the middle that the stash survives. PipeDream:
    a synchronous step per microbatch, the LR schedule's value per iteration (constant)."""
    two_bw = case_results["gpt_pp1_2bw"]["loss"]
    assert len(two_bw) == 6
    assert relative_difference(two_bw, single_process_losses["gpt_pp1_2bw"]) <= 1e-6
    steps = single_process_losses["gpt_pp1_pipedream"]
    per_iteration = [sum(steps[i : i + 4]) / 4 for i in range(0, len(steps), 4)]
    assert relative_difference(case_results["gpt_pp1_pipedream"]["loss"], per_iteration) <= 1e-6
    assert case_results["gpt_pp1_pipedream"]["stages"][0]["optimizer_steps"] == 12


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_2bw_delay_is_really_there(case_results, single_process_losses, name):
    """What the one-step delay means, per optimizer: batches 0 and 1 both run on the initial
    weights W(0) (the frozen run's losses), batch 2 on W(1) = W(0) - u(g(W(0), batch 0)) (the
    one-step-delayed reference's)."""
    losses = case_results[f"gpt_pp4_2bw_opt_{name}"]["loss"]
    assert relative_difference(losses[:2], single_process_losses["frozen"][:2]) <= 1e-6
    assert losses[2] != single_process_losses["frozen"][2]  # batch 2 does see the first update
    reference = single_process_losses[f"gpt_pp4_2bw_opt_{name}"]
    assert relative_difference(losses[2:3], reference[2:3]) <= 1e-5


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_2bw_keeps_one_stash_and_delays_every_update_by_one_step(case_results, name):
    summary = case_results[f"gpt_pp4_2bw_opt_{name}"]
    for report in summary["stages"]:
        assert report["extra_weight_versions"] == 1
        assert report["extra_weight_bytes"] == report["grad_bytes"]  # the trainable weights
        assert report["max_gradient_delay"] == 1 and report["max_drift"] == 0
        # at most PACI's admission bound (2BW runs its order)
        assert 1 <= report["peak_inflight_microbatches"] <= 4 - report["stage"]
        assert report["peak_activation_bytes"] > 0
        assert report["optimizer_steps"] == summary["iterations"]
    assert summary["cross_stage_collectives"] == 0


def test_pipedream_versions_and_delays_equal_the_simulators(case_results):
    summary = case_results["gpt_pp4_pipedream_opt_adam"]
    n, m, iterations = 4, summary["num_microbatches"], summary["iterations"]
    schedule = get_schedule("pipedream")
    simulated = simulate(schedule, num_stages=n, microbatches_per_step=m,
                         steps=iterations, forward_cost=1.0, backward_cost=2.0)  # fmt: skip
    for s, report in enumerate(summary["stages"]):
        versions = report["extra_weight_versions"]
        assert versions == simulated.measured_extra_weight_versions[s]
        assert versions == schedule.extra_weight_versions(s, n) == n - 1 - s
        assert report["extra_weight_bytes"] == versions * report["grad_bytes"]
        delay = report["max_gradient_delay"]
        assert delay == simulated.max_gradient_delay_per_stage[s] == n - 1 - s
        assert report["max_drift"] == 0
        assert report["optimizer_steps"] == iterations * m  # a step after every microbatch
    assert summary["cross_stage_collectives"] == 0


@pytest.mark.parametrize("schedule", STASHING)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_completes_a_run(case_results, name, schedule):
    summary = case_results[f"gpt_pp4_{schedule}_opt_{name}"]
    assert len(summary["loss"]) == summary["iterations"] >= 3
    assert all(math.isfinite(x) for x in summary["loss"])


def test_each_optimizer_makes_its_own_pipedream_updates(case_results):
    """Steps start inside the first iteration (the last stage steps after its first
    microbatch), so even the first losses differ; the last ones differ more."""
    runs = [case_results[f"gpt_pp4_pipedream_opt_{name}"]["loss"][:3] for name in OPTIMIZERS]
    assert len({round(losses[-1], 6) for losses in runs}) == len(OPTIMIZERS)


@pytest.mark.parametrize("schedule", STASHING)
def test_stashing_keeps_pacis_activation_memory(case_results, schedule):
    """Same admission as PACI, so the same in-flight microbatches and activation bytes; the
    stashed weights are reported apart (extra_weight_bytes), not as activations."""
    paci = case_results["gpt_pp4_paci_opt_adam"]["stages"]
    for ours, theirs in zip(case_results[f"gpt_pp4_{schedule}_opt_adam"]["stages"], paci):
        assert ours["peak_inflight_microbatches"] == theirs["peak_inflight_microbatches"]
        assert ours["peak_activation_bytes"] == theirs["peak_activation_bytes"]
        assert ours["param_bytes"] == theirs["param_bytes"]
        assert theirs["extra_weight_versions"] == theirs["extra_weight_bytes"] == 0
