"""torch_dist checkpoints across layouts and schedules, on real multi-process runs.

References: the uninterrupted runs of the same command line (`gpt_pp1_tied_1f1b`, one process,
which 1F1B-flush on any layout equals within float tolerance; `gpt_pp4_tied_1f1b`,
`gpt_pp4_1f1b`, `gpt_pp4_paci_a4`).
After a resume from a checkpoint taken at a drained step boundary, the first iteration's
microbatches are forwarded on the checkpoint's weights under either schedule (PACI's first
stage steps only after `a` backwards), so the first resumed loss is an evaluation of the saved
model on the next batch: the same number whichever schedule saved and whichever resumes.
"""

import run_cases
from test_gpt_cases import drift_bound

SAVED = "gpt_reshard_1_pp4_1f1b_save"  # 4 stages, 1F1B-flush, tied embeddings, 4 of 8 iterations
RESUMED_ON_OTHER_LAYOUTS = ["gpt_reshard_2_dp2pp2_1f1b_load", "gpt_reshard_3_tp2pp2_1f1b_load"]


def test_saving_run_is_the_uninterrupted_run(case_results):
    assert case_results[SAVED]["loss"] == case_results["gpt_pp4_tied_1f1b"]["loss"][:4]
    assert "> saved checkpoint at iteration 4" in case_results[SAVED]["log"]


def test_four_stage_checkpoint_resumes_on_other_layouts(case_results):
    """PP=4 -> PP=2 x DP=2 and TP=2 x PP=2: the rest of the run equals the uninterrupted
    one-process run within 1e-5, which needs the weights and Adam's moments resharded (a
    lost or misplaced moment changes iteration 6 onwards), the tied embedding included (saved
    once under the embedding's key, loaded into both stages' copies)."""
    reference = case_results["gpt_pp1_tied_1f1b"]["loss"]
    for name in RESUMED_ON_OTHER_LAYOUTS:
        resumed = case_results[name]
        assert resumed["iterations"] == 8 and len(resumed["loss"]) == 4, name
        assert run_cases.relative_difference(resumed["loss"], reference[4:]) <= 1e-5, name
        assert "another layout: --pipeline-model-parallel-size 2 (checkpoint 4)" in resumed["log"]


def test_paci_checkpoint_resumes_under_flush(case_results):
    """The PACI checkpoint (gpt_pp4_paci_resume_1_save) resumed by 1F1B-flush: its first loss
    is the one PACI itself continues with (the saved model on batch 5)."""
    flush = case_results["gpt_reshard_4_paci_to_1f1b"]["loss"]
    paci_continued = case_results["gpt_pp4_paci_a4"]["loss"][4]
    assert len(flush) == 4 and run_cases.relative_difference(flush[:1], [paci_continued]) <= 1e-6
    assert flush[-1] < flush[0]
    log = case_results["gpt_reshard_4_paci_to_1f1b"]["log"]
    assert "another schedule: --pipeline-schedule 1f1b (checkpoint paci)" in log


def test_flush_checkpoint_resumes_under_paci(case_results):
    """The flush checkpoint of gpt_runcontrol_1_exit (iteration 6, torch format) resumed by
    PACI: its first loss is the uninterrupted flush run's iteration 7; PACI keeps its bound."""
    summary = case_results["gpt_runcontrol_4_paci_resume"]
    flush_continued = case_results["gpt_pp4_1f1b"]["loss"][6]
    assert len(summary["loss"]) == 2
    assert run_cases.relative_difference(summary["loss"][:1], [flush_continued]) <= 1e-6
    stages, accumulation = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], stages, accumulation)
    assert summary["cross_stage_collectives"] == 0
    assert "another schedule: --pipeline-schedule paci (checkpoint 1f1b)" in summary["log"]
