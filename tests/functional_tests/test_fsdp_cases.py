"""Fully sharded data parallelism (--use-torch-fsdp2, --use-megatron-fsdp) on real multi-process
runs (gloo, CPU). Reference: the same command line without FSDP, which replicates the weights
and averages whole gradients; sharding changes where the numbers live, not the numbers:

* 1F1B-flush at DP = 2 x PP = 2 (fp32) gives the replicated run's losses, validation losses
  and parameter norms, each rank holding about half the weights and optimizer state;
* PACI in bf16 (Megatron-FSDP, ZeRO-3) and in fp16 with dynamic loss scaling (ZeRO-2's
  optim_grads) give the replicated runs' losses within 1e-5 and keep PACI's drift bound
  and its point-to-point-only traffic across stages;
* TP = 2 with sequence parallelism, q/k layernorms and tied embeddings (one parameter of the
  root unit), and MoE with the routed experts sharded over their own group (EP = 2, EDP = 2,
  dense DP = 4), give the replicated runs' losses and parameter norms;
* checkpoints: fsdp_dtensor (each rank's rows) resumes exactly, also at another data-parallel
  size; torch_dist and torch checkpoints move between runs with and without FSDP.
"""

import os

import pytest
import run_cases
from test_gpt_cases import drift_bound


def _params_norms(run: dict, name: str) -> list[float]:
    """The case's own iteration lines' parameter norms (cases of one launch share a log)."""
    import re

    log = run["log"].split(f"=== case {name}\n", 1)[1].split("=== case ", 1)[0]
    return [float(norm) for norm in re.findall(r"params norm: ([0-9.]+)", log)]


def _assert_about_half(sharded: list[int], whole: list[int]) -> None:
    """Every rank holds about 1/2 of what the replicated run's rank holds (rows split evenly,
    a tensor of one row stays on one rank)."""
    assert len(sharded) == len(whole)
    for mine, replicated in zip(sharded, whole):
        assert 0.4 * replicated <= mine <= 0.6 * replicated, (mine, replicated)


def test_flush_equals_the_replicated_run_on_half_the_memory(case_results):
    fsdp, plain = case_results["gpt_fsdp_dp2pp2_1f1b"], case_results["gpt_dp2pp2_1f1b"]
    assert len(fsdp["loss"]) == 8 and fsdp["loss"][-1] < fsdp["loss"][0]
    assert run_cases.relative_difference(fsdp["loss"], plain["loss"]) <= 1e-6
    validation = [v["lm loss"] for v in fsdp["validation"]]
    expected = [v["lm loss"] for v in plain["validation"]]
    assert len(validation) == 2 and run_cases.relative_difference(validation, expected) <= 1e-6
    _assert_about_half(fsdp["param_bytes_by_rank"], plain["param_bytes_by_rank"])
    _assert_about_half(fsdp["optimizer_state_bytes_by_rank"],
                       plain["optimizer_state_bytes_by_rank"])  # fmt: skip
    assert len(_params_norms(fsdp, "gpt_fsdp_dp2pp2_1f1b")) == 8


@pytest.mark.parametrize(
    "name, reference",
    [
        ("gpt_fsdp_dp2pp2_paci_bf16", "gpt_dp2pp2_paci_bf16_distopt"),
        ("gpt_fsdp_dp2pp2_paci_fp16_zero2", "gpt_dp2pp2_paci_fp16"),
    ],
)
def test_paci_equals_the_replicated_run_and_keeps_its_bound(case_results, name, reference):
    """Equal within 1e-4: FSDP sums each microbatch's fp32 gradient over the ranks, the
    replicated run sums the microbatches on each rank first; the last-bit difference of that
    other order changes a bf16 rounding of the weights now and then (fp32: exactly equal)."""
    fsdp, plain = case_results[name], case_results[reference]
    assert len(fsdp["loss"]) == 8
    assert run_cases.relative_difference(fsdp["loss"], plain["loss"]) <= 1e-4
    assert fsdp["skipped_steps_by_stage"] == plain["skipped_steps_by_stage"]  # fp16: same scale
    stages, accumulation = fsdp["pipeline_stages"], fsdp["num_microbatches"]
    for report in fsdp["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], stages, accumulation)
    assert fsdp["cross_stage_collectives"] == 0
    for mine, whole in zip(fsdp["param_bytes_by_rank"], plain["param_bytes_by_rank"]):
        assert mine < 0.6 * 2 * whole  # fp32 rows of half the weights, against bf16/fp16 ones


def test_tensor_parallel_with_tied_embeddings(case_results):
    fsdp, plain = case_results["gpt_fsdp_tp2dp2_1f1b_sp"], case_results["gpt_tp2dp2_1f1b_sp"]
    assert run_cases.relative_difference(fsdp["loss"], plain["loss"]) <= 1e-6
    _assert_about_half(fsdp["param_bytes_by_rank"], plain["param_bytes_by_rank"])


def test_moe_experts_shard_over_their_own_group(case_results):
    fsdp, plain = case_results["moe_fsdp_ep2dp4_1f1b"], case_results["moe_ep2dp4_1f1b"]
    assert run_cases.relative_difference(fsdp["loss"], plain["loss"]) <= 1e-6
    norms = _params_norms(plain, "moe_ep2dp4_1f1b")
    assert len(norms) == 8 and _params_norms(fsdp, "moe_fsdp_ep2dp4_1f1b") == norms
    for mine, whole in zip(fsdp["param_bytes_by_rank"], plain["param_bytes_by_rank"]):
        assert mine < 0.5 * whole  # dense rows over 4 ranks, experts over 2


@pytest.mark.parametrize(
    "save, load",
    [
        ("gpt_fsdp_ckpt_1_dtensor_save", "gpt_fsdp_ckpt_2_dtensor_load"),
        ("gpt_fsdp_ckpt_3_plain_torch_dist_save", "gpt_fsdp_ckpt_4_fsdp_load"),
        ("gpt_fsdp_ckpt_5_torch_save", "gpt_fsdp_ckpt_6_plain_load"),
    ],
)
def test_checkpoints_resume_as_the_uninterrupted_run(case_results, save, load):
    """Weights, Adam's moments and the schedule all come back: iterations 5 to 8 equal the
    uninterrupted replicated run's (a lost or misplaced moment changes them)."""
    uninterrupted = case_results["gpt_dp2pp2_1f1b"]["loss"]
    assert run_cases.relative_difference(case_results[save]["loss"], uninterrupted[:4]) <= 1e-6
    resumed = case_results[load]
    assert resumed["iterations"] == 8 and len(resumed["loss"]) == 4
    assert run_cases.relative_difference(resumed["loss"], uninterrupted[4:]) <= 1e-6


def test_fsdp_dtensor_checkpoint_loads_at_another_data_parallel_size(case_results):
    """The DP = 2 save resumed on two processes (PP = 2, DP = 1): torch's checkpoint reads
    each rank's rows of the DTensors whatever the sharding; 1F1B-flush gives the same run."""
    saved = case_results["gpt_fsdp_ckpt_1_dtensor_save"]
    output = os.path.dirname(saved["metrics_dir"])
    case = run_cases.discover_cases()["gpt_fsdp_ckpt_2_dtensor_load"]
    name = "gpt_fsdp_ckpt_2_dtensor_load_at_dp1"
    resumed = run_cases._launch({name: {**case, "NPROC": 2}}, (2, "{}"), [name], output)
    summary = resumed[name]
    assert summary["data_parallel"] == 1 and len(summary["loss"]) == 4
    uninterrupted = case_results["gpt_dp2pp2_1f1b"]["loss"]
    assert run_cases.relative_difference(summary["loss"], uninterrupted[4:]) <= 1e-6
