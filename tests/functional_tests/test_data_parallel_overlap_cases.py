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
"""

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
]
AT_DP4 = [
    ("gpt_dp4pp2_paci_overlap", "gpt_dp4pp2_paci_buckets"),
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
    ],
)  # fmt: skip
def test_a_checkpoint_resumes_with_the_overlap_switched(case_results, saved, loaded,
                                                        uninterrupted):  # fmt: skip
    """Saved with the bucketed overlap and resumed without it, and the reverse: the halves
    continue the uninterrupted run (the save comes at a drain, with no reduction in flight)."""
    whole = case_results[uninterrupted]["loss"]
    assert case_results[saved]["loss"] == whole[:4]
    assert run_cases.relative_difference(case_results[loaded]["loss"], whole[4:]) <= 1e-6
