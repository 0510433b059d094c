"""The data-parallel reduction in buckets, overlapped with the backward (--overlap-grad-reduce,
--ddp-bucket-size; megatron/distributed/data_parallel.py), on real multi-process runs (gloo).

Reference: the same command line without overlap. Both reduce the same gradients in the same
buckets with the same collective, so the losses are equal bit for bit:

* at DP = 2 against the existing cases without any bucket flag (one blocking reduction, the
  behaviour without the flags): a sum of two replicas rounds the same in any bucketing; for
  1F1B-flush, PACI (and on 2 ranks x 2 chunks), 2BW, PipeDream, ZB-H1, ZB-V, DualPipeV, interleaved
  1F1B, fp32 and bf16, replicated and with the distributed optimizer, tied embeddings;
* at DP = 4 x PP = 2 against the same buckets reduced at the step: a sum over four replicas,
  whose rounding depends on the buckets, for PACI (fp32) and 1F1B (bf16, distributed
  optimizer).

Every overlapped run launched its buckets from the backward's hooks (none waited for the
step but the tied embedding's, which changes before the reduction), and replicas kept equal
weights (the replica hash check of the PACI cases).

--overlap-param-gather (training/optimizer/param_gather.py): the distributed optimizer's
updated parameters gathered in the same buckets, each waited for by the forward that reads it,
give the same losses and logged gradient norms bit for bit as the run without any overlap, for
1F1B (fp32 at DP 2, bf16 at DP 4), interleaved 1F1B (with
--overlap-param-gather-with-optimizer-step) and PACI (fp32; bf16 with tied embeddings); the
DP 2 runs poison every parameter with NaN until its bucket lands
(MEGATRON_POISON_UNGATHERED_PARAMS), so a read of a parameter before its gather landed would
turn the losses into NaN. A checkpoint saved with the gathers resumes with them.
"""

import re

import pytest
import run_cases

AT_DP2 = [
    ("gpt_dp2pp2_1f1b_overlap", "gpt_dp2pp2_1f1b"),
    ("gpt_dp2pp2_paci_overlap", "gpt_dp2pp2_paci"),
    ("gpt_dp2pp2vp2_paci_overlap", "gpt_dp2pp2vp2_paci"),
    ("gpt_dp2pp2_2bw_overlap", "gpt_dp2pp2_2bw"),
    ("gpt_dp2pp2_pipedream_overlap", "gpt_dp2pp2_pipedream"),
    ("gpt_dp2pp2_zbh1_overlap", "gpt_dp2pp2_zbh1"),
    ("gpt_dp2pp2_zbv_overlap", "gpt_dp2pp2_zbv"),
    ("gpt_dp2pp2_dualpipev_overlap", "gpt_dp2pp2_dualpipev"),
    ("gpt_dp2pp2vp2_1f1b_overlap", "gpt_dp2pp2vp2_1f1b"),
    ("gpt_dp2pp2_1f1b_bf16_overlap", "gpt_dp2pp2_1f1b_bf16"),
    ("gpt_dp2pp2_1f1b_distopt_overlap", "gpt_dp2pp2_1f1b_distopt"),
    ("gpt_dp2pp2_paci_bf16_distopt_overlap", "gpt_dp2pp2_paci_bf16_distopt"),
    ("gpt_dp2pp2_paci_tied_bf16_distopt_overlap", "gpt_dp2pp2_paci_tied_bf16_distopt"),
    ("gpt_dp2pp2_1f1b_distopt_gather", "gpt_dp2pp2_1f1b_distopt"),
    ("gpt_dp2pp2_paci_distopt_gather", "gpt_dp2pp2_paci_distopt"),
    ("gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt_gather", "gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt"),
]
AT_DP4 = [
    ("gpt_dp4pp2_paci_overlap", "gpt_dp4pp2_paci_buckets"),
    ("gpt_dp4pp2_1f1b_bf16_distopt_overlap", "gpt_dp4pp2_1f1b_bf16_distopt_buckets"),
]
# --overlap-param-gather too (with --overlap-grad-reduce), against the run without either
GATHERED = [
    ("gpt_dp2pp2_1f1b_distopt_gather", "gpt_dp2pp2_1f1b_distopt"),
    ("gpt_dp2pp2_paci_distopt_gather", "gpt_dp2pp2_paci_distopt"),
    ("gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt_gather", "gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt"),
    ("gpt_dp2pp2_paci_tied_bf16_distopt_overlap", "gpt_dp2pp2_paci_tied_bf16_distopt"),
    ("gpt_dp4pp2_1f1b_bf16_distopt_overlap", "gpt_dp4pp2_1f1b_bf16_distopt_buckets"),
]


@pytest.mark.parametrize("overlapped, reference", AT_DP2 + AT_DP4)
def test_overlap_gives_the_same_numbers_bit_for_bit(case_results, overlapped, reference):
    run, plain = case_results[overlapped], case_results[reference]
    assert len(run["loss"]) == 8 and run["loss"] == plain["loss"]
    validation = [v["lm loss"] for v in run["validation"]]
    assert validation == [v["lm loss"] for v in plain["validation"]]
    assert [s["optimizer_steps"] for s in run["stages"]] == [
        s["optimizer_steps"] for s in plain["stages"]
    ]


@pytest.mark.parametrize("overlapped, reference", AT_DP2 + AT_DP4)
def test_buckets_launch_from_the_backward(case_results, overlapped, reference):
    """Each step of each stage launched several buckets from its hooks; the runs without
    overlap launched every reduction at the step. The tied embedding's bucket waits for the
    step (its gradient is summed or exchanged between the stages first)."""
    run, plain = case_results[overlapped], case_results[reference]
    tied = "tied" in overlapped
    for stage, plain_stage in zip(run["stages"], plain["stages"]):
        steps = stage["optimizer_steps"]
        assert stage["dp_buckets_in_backward"] >= 2 * steps, (overlapped, stage["stage"])
        assert stage["dp_buckets_at_step"] == (steps if tied else 0), (overlapped, stage)
        assert plain_stage["dp_buckets_in_backward"] == 0
        assert plain_stage["dp_buckets_at_step"] >= steps
        assert 0 < stage["dp_exposed_s"] <= stage["dp_reduce_s"] + 1e-3
        assert stage["dp_reduced_bytes"] > 0


def _grad_norms(result: dict, case: str) -> list[str]:
    """The gradient norms of the case's iteration lines (its part of the launch's log)."""
    log = result["log"].split(f"=== case {case}\n")[1].split("=== case ")[0]
    return re.findall(r"grad norm: (\S+)", log)


@pytest.mark.parametrize("gathered, reference", GATHERED)
def test_parameters_gather_under_the_forward(case_results, gathered, reference):
    """Every step of every stage gathered its parameters in overlapped buckets (the waits are
    timed), with the same gradient norms as the run without the flag (the losses:
    `test_overlap_gives_the_same_numbers_bit_for_bit`)."""
    run, plain = case_results[gathered], case_results[reference]
    norms = _grad_norms(run, gathered)
    assert len(norms) == 8 and norms == _grad_norms(plain, reference)
    assert run["nan_iterations"] == 0
    for stage in run["stages"]:
        assert stage["dp_param_gathers"] == stage["optimizer_steps"] > 0, (gathered, stage)
        assert stage["dp_param_gather_bytes"] > 0 and stage["dp_param_gather_s"] > 0
        assert 0 <= stage["dp_param_gather_exposed_s"]
    assert all("dp_param_gathers" not in stage for stage in plain["stages"])
    assert "parameters gathered in the same buckets under the forward" in run["log"]


def test_the_log_line_shows_the_reduction(case_results):
    log = case_results["gpt_dp2pp2_paci_overlap"]["log"]
    assert "dp reduce/exposed per iteration (ms): " in log
    assert "data-parallel reduction in " in log and "overlapped with the backward" in log


@pytest.mark.parametrize(
    "saved, loaded, uninterrupted",
    [
        ("gpt_dp2pp2_paci_overlap_resume_1_save", "gpt_dp2pp2_paci_overlap_resume_2_load",
         "gpt_dp2pp2_paci_overlap"),
        ("gpt_dp2pp2_paci_plain_resume_1_save", "gpt_dp2pp2_paci_plain_resume_2_load",
         "gpt_dp2pp2_paci"),
        ("gpt_dp2pp2_paci_distopt_gather_resume_1_save",
         "gpt_dp2pp2_paci_distopt_gather_resume_2_load", "gpt_dp2pp2_paci_distopt_gather"),
    ],
)  # fmt: skip
def test_a_checkpoint_resumes_with_the_overlap_switched(case_results, saved, loaded,
                                                        uninterrupted):  # fmt: skip
    """Saved with the bucketed overlap and resumed without it, and the reverse: the halves
    continue the uninterrupted run (the save comes at a drain, with no reduction in flight).
    With --overlap-param-gather on both sides the save waits for the gathers in flight."""
    whole = case_results[uninterrupted]["loss"]
    assert case_results[saved]["loss"] == whole[:4]
    assert run_cases.relative_difference(case_results[loaded]["loss"], whole[4:]) <= 1e-6
