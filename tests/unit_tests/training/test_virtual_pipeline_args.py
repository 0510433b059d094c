"""Megatron's virtual-pipeline flags: how they set the chunks per rank, and the command lines
Megatron refuses (or we do not support yet), each one line through the validation path."""

import pytest
from small_run_flags import BASE, validated

from megatron.common.errors import UserError

PP4 = ["--pipeline-model-parallel-size", "4", "--num-layers", "8"]


def error_of(extra: list[str], world_size: int = 4) -> str:
    with pytest.raises(UserError) as caught:
        validated(extra, world_size)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "extra, chunks",
    [
        (["--num-layers-per-virtual-pipeline-stage", "1"], 2),
        (["--num-virtual-stages-per-pipeline-rank", "2"], 2),
        (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "paci"], 2),
        (["--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "1"], 4),
        (["--num-virtual-stages-per-pipeline-rank", "1"], None),  # one chunk: plain 1F1B
        (["--num-layers-per-virtual-pipeline-stage", "2"], None),
        ([], None),
    ],
)  # fmt: skip
def test_flags_give_megatrons_virtual_pipeline_size(extra, chunks):
    args = validated(PP4 + extra, 4)
    assert args.virtual_pipeline_model_parallel_size == chunks


MICROBATCH_RULES = [  # global batch (micro batch 1: the microbatches), extra flags, message
    ("6", [], "--global-batch-size 6 gives 6 microbatches per step: interleaved-1f1b on 4 "
     "ranks needs a multiple of 4 microbatches per step, got 6 (microbatch groups of g = 4 per "
     "model chunk: N <= g <= m, m % g 0 or >= N)"),
    ("8", ["--microbatch-group-size-per-virtual-pipeline-stage", "5"],
     "--global-batch-size 8 gives 8 microbatches per step: interleaved-1f1b on 4 ranks with "
     "microbatch groups of g = 5 per model chunk: N <= g <= m, m % g 0 or >= N; got m = 8"),
    ("8", ["--microbatch-group-size-per-virtual-pipeline-stage", "3"],
     "--global-batch-size 8 gives 8 microbatches per step: interleaved-1f1b on 4 ranks with "
     "microbatch groups of g = 3 per model chunk: N <= g <= m, m % g 0 or >= N; got m = 8"),
    ("4", ["--microbatch-group-size-per-virtual-pipeline-stage", "6"],
     "--global-batch-size 4 gives 4 microbatches per step: interleaved-1f1b on 4 ranks with "
     "microbatch groups of g = 6 per model chunk: N <= g <= m, m % g 0 or >= N; got m = 4"),
]  # fmt: skip


@pytest.mark.parametrize("batch, extra, message", MICROBATCH_RULES)
def test_megatrons_invalid_microbatch_counts_fail_with_one_line(batch, extra, message):
    flags = PP4 + ["--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1",
                   "--global-batch-size", batch, *extra]  # fmt: skip
    assert error_of(flags) == message


@pytest.mark.parametrize("batch, group", [("8", None), ("9", "5"), ("12", "4"), ("4", "4")])
def test_megatrons_valid_microbatch_counts_pass(batch, group):
    flags = PP4 + ["--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1",
                   "--global-batch-size", batch]  # fmt: skip
    if group is not None:
        flags += ["--microbatch-group-size-per-virtual-pipeline-stage", group]
    assert validated(flags, 4).virtual_pipeline_model_parallel_size == 2


REFUSED = [
    (["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank",
      "2"], "no more than one of --num-layers-per-virtual-pipeline-stage, "
     "--num-virtual-stages-per-pipeline-rank can be set at the same time"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "number of layers per pipeline stage (2) "
     "must be divisible by --num-layers-per-virtual-pipeline-stage 3"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], "--num-layers 8 is not divisible by "
     "--pipeline-model-parallel-size 4 x 3 virtual stages per pipeline rank"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "pipedream"],
     "--num-virtual-stages-per-pipeline-rank with --pipeline-schedule pipedream is not "
     "supported yet"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "2bw"],
     "--num-layers-per-virtual-pipeline-stage with --pipeline-schedule 2bw is not supported "
     "yet"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "paci",
      "--paci-arrival-rule", "backward-first"],
     "--paci-arrival-rule backward-first with virtual pipeline stages is not supported yet"),
    (["--num-layers", "10", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     "the layer split: number of layers on each middle pipeline rank:3 must be divisible by "
     "virtualpipeline parallel degree 2"),  # megatron-core's own words
    (["--num-layers-per-virtual-pipeline-stage", "1", "--decoder-last-pipeline-num-layers",
      "2"], "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline "
     "parallel degree when enable uneven pipeline parallelism"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--rampup-batch-size", "4", "4", "8"],
     "--rampup-batch-size with virtual pipeline stages is not supported yet"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "paci",
      "--paci-accumulation-schedule", "8:4"],
     "--paci-accumulation-schedule with virtual pipeline stages is not supported yet"),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra, chunk_layers",
    [
        (["--num-layers", "6", "--account-for-embedding-in-pipeline-split",
          "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "1"],
         [[0, 1], [1, 1], [1, 1], [1, 0]]),
        (["--num-layers", "12", "--decoder-first-pipeline-num-layers", "2",
          "--decoder-last-pipeline-num-layers", "2", "--num-virtual-stages-per-pipeline-rank",
          "2"], [[1, 1], [2, 2], [2, 2], [1, 1]]),
    ],
)  # fmt: skip
def test_uneven_splits_are_megatron_cores_per_chunk(extra, chunk_layers):
    args = validated(PP4 + extra, 4)
    assert args.chunk_layers == chunk_layers
    assert args.stage_layers == [sum(layers) for layers in chunk_layers]


@pytest.mark.parametrize("extra, message", REFUSED)
def test_refused_combinations_name_the_flag(extra, message):
    assert error_of(PP4 + extra) == message


def test_one_pipeline_rank_cannot_interleave():
    message = error_of(["--num-virtual-stages-per-pipeline-rank", "2"], world_size=1)
    assert message == ("When interleaved schedule is used, pipeline-model-parallel size should "
                       "be greater than 1")  # fmt: skip


def test_pretrain_gpt_prints_one_error_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    import pretrain_gpt

    argv = BASE + PP4 + ["--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size",
                         "1", "--global-batch-size", "6"]  # fmt: skip
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --global-batch-size 6 gives 6 microbatches per step: ")
    assert err.count("\n") == 1


def test_emulated_costs_are_given_per_virtual_stage():
    chunks = PP4 + ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"]
    costs = ["--emulated-forward-ms", ",".join(["5"] * 8), "--emulated-backward-ms", "10"]
    assert validated(chunks + costs, 4).emulated_forward_ms == [5.0] * 8
    per_rank = ["--emulated-forward-ms", "5,5,5,5", "--emulated-backward-ms", "10"]
    assert error_of(chunks + per_rank) == (
        "--emulated-forward-ms: one value, or one per virtual stage (8)"
    )
