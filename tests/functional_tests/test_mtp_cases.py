"""Multi-token prediction (--mtp-num-layers, DeepSeek-V3's MTP) on real multi-process runs
(gloo, torchrun): megatron-core's MTP block on the last stage, which holds a copy of the first
stage's word embeddings for it.

Reference: the same model on one process, where the MTP layers use the one embedding. Under
1F1B-flush four stages (tied embeddings, two MTP layers) and two stages (untied, the copy
tied to the first stage's embedding all the same) change no number beyond float tolerance,
MTP losses included. Under PACI and PipeDream-2BW the MTP layers step with the last stage:
PACI's drift within its bound, 2BW's none (its stash), the embedding copy within its lag, and
both copies equal at the end. A DeepSeek-V3-style proxy (MLA, a dense first layer, 8 routed
experts with sigmoid routing and an expert bias, a shared expert, one MTP layer) at EP 2 x PP 2:
flush equals one process, PACI and 2BW train."""

import pytest
import run_cases
from test_gpt_cases import drift_bound

from megatron.pipeline.schedules import paci_interleaved

FLUSH = {  # case -> its one-process reference
    "gpt_mtp_pp4_1f1b": "gpt_mtp_pp1_1f1b",
    "gpt_mtp_untied_pp2_1f1b": "gpt_mtp_untied_pp1_1f1b",
    "moe_deepseek_proxy_ep2pp2_1f1b": "moe_deepseek_proxy_pp1_1f1b",
    # the MTP layer on a stage of its own ("Etttt|mL"): built around the last decoder layer's kind
    "moe_deepseek_proxy_ep2pp2_mtpstage_1f1b": "moe_deepseek_proxy_pp1_1f1b",
    # virtual stages: interleaved, and a layout with more stages than ranks
    "gpt_mtp_vpp_pp2_1f1b": "gpt_mtp_pp1_1f1b",
    "gpt_mtp_layout_vpp_pp2_1f1b": "gpt_mtp_pp1_1f1b",
}
ASYNCHRONOUS = ["gpt_mtp_pp4_paci", "gpt_mtp_untied_pp4_2bw", "moe_deepseek_proxy_ep2pp2_paci",
                "moe_deepseek_proxy_ep2pp2_2bw", "gpt_mtp_vpp_pp2_paci"]  # fmt: skip


def mtp_losses(summary: dict) -> list[dict]:
    """The last stage's MTP losses by logging interval (summary.json)."""
    return summary["stages"][-1]["mtp_losses"]


@pytest.mark.parametrize("name", sorted(FLUSH))
def test_flush_equals_one_process(case_results, name):
    summary, reference = case_results[name], case_results[FLUSH[name]]
    assert summary["pipeline_stages"] > 1 and reference["pipeline_stages"] == 1
    assert len(summary["loss"]) == len(reference["loss"]) >= 4
    assert run_cases.relative_difference(summary["loss"], reference["loss"]) <= 1e-5
    validation = [v["lm loss"] for v in summary["validation"]]
    expected = [v["lm loss"] for v in reference["validation"]]
    assert validation and run_cases.relative_difference(validation, expected) <= 1e-5
    ours, theirs = mtp_losses(summary), mtp_losses(reference)
    assert len(ours) == len(theirs) == len(summary["loss"])
    for name_ in theirs[0]:
        values, expected = [i[name_] for i in ours], [i[name_] for i in theirs]
        assert run_cases.relative_difference(values, expected) <= 1e-5


def test_each_mtp_layer_logs_its_loss(case_results):
    """One figure per MTP layer, at every logging interval, on the last stage only; near the
    uniform guess's ln(vocabulary) at the start (the MTP layers predict tokens 2 and 3 ahead
    of a random model), and the layers' losses are not one number twice."""
    summary = case_results["gpt_mtp_pp4_1f1b"]
    assert all("mtp_losses" not in stage for stage in summary["stages"][:-1])
    first = mtp_losses(summary)[0]
    assert set(first) == {"mtp_1 loss", "mtp_2 loss"}
    assert all(abs(value - 6.9) < 0.3 for value in first.values())
    assert first["mtp_1 loss"] != first["mtp_2 loss"]


def test_the_mtp_loss_counts(case_results):
    """The MTP layers change the main model's training: the same model without them (the
    one-process runs of the same seed differ only in --mtp-num-layers and its weight) trains
    another way, and a larger weight is not the same run either."""
    tied, untied = case_results["gpt_mtp_pp1_1f1b"], case_results["gpt_mtp_untied_pp1_1f1b"]
    assert run_cases.relative_difference(tied["loss"], untied["loss"]) > 1e-4


def _paci_bound(report: dict, n: int, a: int) -> int:
    """PACI's drift bound of a rank: of its stage, or the largest of its virtual stages'."""
    chunks = len(report.get("chunk_max_drift", [])) or 1
    if chunks == 1:
        return drift_bound(report["stage"], n, a)
    return max(
        paci_interleaved.drift_bound(report["stage"], c, n, a, chunks) for c in range(chunks)
    )


@pytest.mark.parametrize("name", ASYNCHRONOUS)
def test_asynchronous_schedules_keep_their_bounds(case_results, name):
    summary = case_results[name]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    stashes = summary["schedule"] == "2bw"
    for report in summary["stages"]:
        assert report["max_drift"] <= (0 if stashes else _paci_bound(report, n, a))
    if not stashes:
        assert max(report["max_drift"] for report in summary["stages"]) >= 1  # asynchronous
    first, last = summary["stages"][0], summary["stages"][-1]
    assert first["tied_weight_sha256"] == last["tied_weight_sha256"]  # equal at the end
    exchange = last["tied_embedding"]
    assert exchange["steps"] > 0 and exchange["max_lag"] <= exchange["lag_bound"]
    assert summary["loss"][-1] < summary["loss"][0]
    history = mtp_losses(summary)
    assert len(history) == len(summary["loss"])
    assert history[-1]["mtp_1 loss"] < history[0]["mtp_1 loss"]


def test_a_two_stage_checkpoint_resumes_on_one_stage(case_results):
    """torch_dist, saved after 2 of 4 iterations on 2 stages (the MTP stage's embedding copy a
    replica of the first stage's embedding) and resumed on one stage with 2 data-parallel
    ranks: the remaining iterations equal the one-process run's."""
    reference = case_results["gpt_mtp_untied_pp1_1f1b"]["loss"]
    saved, resumed = (
        case_results["gpt_mtp_ckpt_1_pp2_save"],
        case_results["gpt_mtp_ckpt_2_dp2_load"],
    )
    assert saved["pipeline_stages"] == 2 and len(saved["loss"]) == 2
    assert resumed["pipeline_stages"] == 1 and resumed["data_parallel"] == 2
    assert run_cases.relative_difference(saved["loss"], reference[:2]) <= 1e-5
    assert len(resumed["loss"]) == 2
    assert run_cases.relative_difference(resumed["loss"], reference[2:]) <= 1e-5


def test_the_mtp_loss_takes_the_main_losss_scale(case_results):
    """Four microbatches of 2 and one of 8 make the same gradients only if the MTP loss is
    scaled as the main loss, by 1 / microbatches per backward pass (megatron-core's default
    scale, 1, makes its gradient 4x too large with four)."""
    four, one = case_results["gpt_mtp_pp1_1f1b"], case_results["gpt_mtp_pp1_mbs8_1f1b"]
    assert four["num_microbatches"] == 4 and one["num_microbatches"] == 1
    assert run_cases.relative_difference(four["loss"], one["loss"]) <= 1e-5
