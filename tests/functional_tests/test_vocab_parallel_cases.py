"""--enable-vocab-parallel on real multi-process runs (gloo, torchrun): the output layer and
the input embedding split by vocabulary over the pipeline ranks, their passes placed in the
schedule (2BW and PipeDream keep the input embedding whole).

References: the same command line with both layers whole. Under the flush schedules the split
changes no number beyond float tolerance (PP4 1F1B tied and untied, PP4 ZB-H1, DP2 x PP2,
TP2 x PP2 with and without sequence parallelism, MoE EP2 x PP2); under PACI every shard's
drift stays within the schedule's bound (one stage deeper), and every embedding row's within
ceil(2 (N + 1) / a).
"""

import math

import pytest
import run_cases
from test_gpt_cases import drift_bound

from megatron.pipeline.schedules import paci_interleaved

# (split, whole): each split case runs the first iterations of its reference, on its schedule
FLUSH_EQUALS_WHOLE = [
    ("gpt_vocab_1_pp4_split_save", "gpt_pp4_1f1b"),
    ("gpt_vocab_5_pp4_tied_split_save", "gpt_pp4_tied_1f1b"),  # tied: one weight per rank
    ("gpt_pp4vp2_vocab_1f1b", "gpt_pp4vp2_1f1b"),  # virtual stages: rows on each first chunk
    # the V: the last virtual stage on rank 0; TP 2 shares slots of passes run together
    ("gpt_tp2pp2_vocab_dualpipev", "gpt_tp2pp2_dualpipev"),
    ("gpt_pp4_vocab_zbh1", "gpt_pp4_zbh1"),
    ("gpt_dp2pp2_vocab_1f1b", "gpt_dp2pp2_1f1b"),
    ("gpt_tp2pp2_vocab_1f1b", "gpt_tp2pp2_1f1b"),  # a shard per pipeline x tensor rank
    ("gpt_tp2pp2_vocab_1f1b_sp", "gpt_tp2pp2_1f1b_sp"),  # sequence parallel: gathered first
    ("moe_ep2pp2_vocab_1f1b", "moe_ep2pp2_1f1b"),  # MoE, experts over 2 ranks: aux loss too
    # 2BW pins batch b to W(b - 1) on every rank: the shards score it on that version too
    ("gpt_pp4_vocab_2bw", "gpt_pp4_2bw_opt_adam"),
    # --calculate-per-token-loss with a mask that differs per microbatch (its own forward step)
    ("gpt_pp4_vocab_pertoken_1f1b", "gpt_pp4_pertoken_1f1b"),
]


@pytest.mark.parametrize("split, whole", FLUSH_EQUALS_WHOLE)
def test_flush_with_the_split_vocabulary_equals_the_whole_output_layer(case_results, split, whole):
    losses = case_results[split]["loss"]
    assert len(losses) >= 3
    expected = case_results[whole]["loss"][: len(losses)]
    assert run_cases.relative_difference(losses, expected) <= 1e-5
    validation = [v["lm loss"] for v in case_results[split]["validation"]]
    expected = [v["lm loss"] for v in case_results[whole]["validation"]][: len(validation)]
    if expected:  # the runs that evaluate
        assert len(validation) == len(expected)
        assert run_cases.relative_difference(validation, expected) <= 1e-5


def test_bf16_messages_keep_the_bf16_run(case_results):
    """bf16: the hidden state and the gradient parts travel in bf16 (the labels and statistics
    carried bit for bit), so the split is within bf16's rounding of the whole bf16 run, not
    bit-equal: the shards' gradient parts are rounded each, the whole layer's once."""
    split, whole = case_results["gpt_pp4_vocab_bf16_1f1b"], case_results["gpt_pp4_1f1b_bf16"]
    assert len(split["loss"]) == 4
    assert run_cases.relative_difference(split["loss"], whole["loss"][:4]) <= 1e-4
    validation = [v["lm loss"] for v in split["validation"]]
    expected = [v["lm loss"] for v in whole["validation"]][: len(validation)]
    assert run_cases.relative_difference(validation, expected) <= 1e-4


def test_paci_over_virtual_stages_with_the_split_vocabulary(case_results):
    """PACI over virtual stages (tied): every rank holds one more microbatch-chunk (the shards
    as one more stage), scores and looks up every microbatch once, each chunk drifts within
    the bound of that window and a rank's shard no more than its first chunk; the loss falls."""
    summary = case_results["gpt_pp4vp2_vocab_paci"]
    n, v, a = summary["pipeline_stages"], 2, summary["num_microbatches"]
    for report in summary["stages"]:
        r = report["stage"]
        assert report["peak_inflight_microbatches"] == paci_interleaved.window(r, n, a, v, extra=1)
        bounds = [paci_interleaved.drift_bound(r, c, n, a, v, extra=1) for c in range(v)]
        assert all(d <= b for d, b in zip(report["chunk_max_drift"], bounds)), (r, bounds)
        assert report["max_shard_drift"] <= bounds[0]
        assert sum(report["shard_drift_histogram"].values()) == len(summary["loss"]) * a
        assert sum(report["embed_drift_histogram"].values()) == len(summary["loss"]) * a
    assert summary["loss"][-1] < summary["loss"][0]


@pytest.mark.parametrize(
    "name", ["gpt_pp4_vocab_paci_a2", "gpt_tp2pp2_vocab_paci", "gpt_pp4_vocab_tied_paci"]
)
def test_paci_with_the_split_vocabulary_keeps_its_bounds(case_results, name):
    summary = case_results[name]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        bound = drift_bound(report["stage"], n + 1, a)  # the shards are one stage more
        assert report["max_drift"] <= bound
        assert report["max_shard_drift"] <= bound
        assert report["max_embed_drift"] <= -(-2 * (n + 1) // a)  # the input embedding's rows
        assert sum(report["embed_drift_histogram"].values()) == len(summary["loss"]) * a
    assert max(report["max_shard_drift"] for report in summary["stages"]) >= 1
    shard_counts = {sum(r["shard_drift_histogram"].values()) for r in summary["stages"]}
    assert shard_counts == {len(summary["loss"]) * a}  # every rank scored every microbatch
    assert summary["loss"][-1] < summary["loss"][0]


def test_pipedream_stashes_the_shards_with_the_stage(case_results):
    """PipeDream scores each microbatch on the version its rank forwarded it on, so a shard's
    gradient is as stale as its stage's: at most N - s steps (N - 1 - s, one stage deeper)."""
    summary = case_results["gpt_pp4_vocab_pipedream"]
    n = summary["pipeline_stages"]
    for report in summary["stages"]:
        s = report["stage"]
        assert report["max_drift"] == 0  # backwards on their forwards' weights
        assert report["max_gradient_delay"] <= n - s and report["max_shard_drift"] <= n - s
    assert max(r["max_shard_drift"] for r in summary["stages"]) >= 1
    assert len(summary["loss"]) == 4 and all(math.isfinite(x) for x in summary["loss"])


# (saving run, run resuming it on another layout): split -> whole and whole -> split, 4 stages -> 2 stages x DP 2
CHECKPOINTS = [
    ("gpt_vocab_1_pp4_split_save", "gpt_vocab_2_dp2pp2_whole_load", "gpt_pp4_1f1b"),
    ("gpt_vocab_3_pp4_whole_save", "gpt_vocab_4_dp2pp2_split_load", "gpt_pp4_1f1b"),
    # tied: each rank's one weight is its rows of the embedding, as a tied model saves it
    ("gpt_vocab_5_pp4_tied_split_save", "gpt_vocab_6_dp2pp2_tied_whole_load", "gpt_pp4_tied_1f1b"),
]


@pytest.mark.parametrize("saved, resumed, uninterrupted", CHECKPOINTS)
def test_checkpoints_load_split_or_whole_on_another_layout(
    case_results, saved, resumed, uninterrupted
):
    """The rest of the run equals the uninterrupted whole-layer run within 1e-5: the layers'
    rows and their Adam moments land on the right ranks either way."""
    reference = case_results[uninterrupted]["loss"]
    assert run_cases.relative_difference(case_results[saved]["loss"], reference[:4]) <= 1e-5
    summary = case_results[resumed]
    assert summary["iterations"] == 8 and len(summary["loss"]) == 4
    assert run_cases.relative_difference(summary["loss"], reference[4:]) <= 1e-5
