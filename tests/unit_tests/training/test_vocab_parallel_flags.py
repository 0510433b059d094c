"""--enable-vocab-parallel's flag checks, in process: what the split runs with (1F1B, ZB-H1,
PACI, 2BW, PipeDream, and over virtual stages interleaved 1F1B, PACI, ZB-V, DualPipeV), one line for what it cannot take yet, and the plan it
gives (the schedule places the vocabulary passes, its synchronous phase too; the input
embedding's wherever the schedule does not stash weights)."""

import pytest

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.config import RunConfig

SPLIT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "20", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--pipeline-model-parallel-size", "4",
    "--untie-embeddings-and-output-weights", "--enable-vocab-parallel",
]  # fmt: skip


def validated(extra: list[str], world_size: int = 4):
    args = build_parser().parse_args(SPLIT + extra)
    validate_args(args, world_size=world_size)
    return args


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "paci", "2bw", "pipedream"])
def test_one_chunk_schedules_take_the_split(schedule):
    args = validated(["--pipeline-schedule", schedule])
    plan = RunConfig.from_args(args, vocab_size=1001).pipeline.plan
    assert plan.schedule.vocab_passes and plan.synchronous.schedule.vocab_passes
    assert plan.name == schedule
    stashes = schedule in ("2bw", "pipedream")
    assert plan.schedule.embedding_passes == (not stashes)
    assert plan.synchronous.schedule.embedding_passes == plan.schedule.embedding_passes


@pytest.mark.parametrize("extra", [
    ["--pipeline-schedule", "dualpipe-v", "--num-layers", "8", "--global-batch-size", "16"],
    ["--pipeline-schedule", "zb-v", "--num-layers", "8"],
    ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
     "--pipeline-schedule", "paci"],
])  # fmt: skip
def test_virtual_stage_schedules_take_the_split(extra):
    plan = RunConfig.from_args(validated(extra), vocab_size=1001).pipeline.plan
    assert plan.placement is not None
    assert plan.schedule.vocab_passes and plan.schedule.embedding_passes


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4,
         "with --context-parallel-size > 1 is not supported yet"),
        (["--pipeline-schedule", "paci", "--deterministic-mode"], 4,
         "with --deterministic-mode and an asynchronous schedule is not supported yet"),
    ],
)  # fmt: skip
def test_what_the_split_cannot_take_yet_is_one_line(extra, world_size, message):
    args = build_parser().parse_args(SPLIT + extra)
    with pytest.raises(UserError, match=message) as caught:
        validate_args(args, world_size=world_size)
    assert "\n" not in str(caught.value)


TIED = [a for a in SPLIT if a != "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "paci"])
def test_tied_embeddings_split_as_one_weight(schedule):
    args = build_parser().parse_args(TIED + ["--pipeline-schedule", schedule])
    validate_args(args, world_size=4)
    assert RunConfig.from_args(args, vocab_size=1001).pipeline.plan.schedule.embedding_passes


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_tied_embeddings_under_weight_stashing_need_untying(schedule):
    args = build_parser().parse_args(TIED + ["--pipeline-schedule", schedule])
    with pytest.raises(UserError, match="keeps the input embedding whole on the first stage: "
                                        "add --untie-embeddings-and-output-weights"):  # fmt: skip
        validate_args(args, world_size=4)


def test_flush_with_deterministic_mode_is_fine():
    validated(["--deterministic-mode"])  # a flush keeps every shard at the step's version


def test_a_tokenizer_vocabulary_that_does_not_split_is_refused_at_configuration():
    args = validated(["--make-vocab-size-divisible-by", "1", "--vocab-size", "1003"])
    with pytest.raises(UserError, match="the padded vocabulary of 50257 does not split evenly"):
        RunConfig.from_args(args, vocab_size=50257)  # GPT-2's, unpadded


def test_2bw_with_the_split_needs_one_more_microbatch_per_step():
    args = build_parser().parse_args(SPLIT + ["--pipeline-schedule", "2bw",
                                              "--global-batch-size", "6"])  # fmt: skip
    with pytest.raises(UserError, match="needs at least 4 microbatches per step .pipeline size "
                                        "- 1, one more with --enable-vocab-parallel"):  # fmt: skip
        validate_args(args, world_size=4)


def test_a_vocabulary_smaller_than_the_ranks_is_refused_before_any_process():
    args = build_parser().parse_args(
        SPLIT + ["--vocab-size", "1", "--make-vocab-size-divisible-by", "1"]
    )
    with pytest.raises(UserError, match="a vocabulary of 2 is smaller than the 4 pipeline x "):
        validate_args(args, world_size=4)


@pytest.mark.parametrize("flag, value", [("--paci-inflight-limit", "flush"),
                                         ("--paci-arrival-rule", "backward-first")])  # fmt: skip
def test_paci_options_with_another_schedule_and_the_split_are_one_line(flag, value):
    with pytest.raises(UserError, match=f"{flag} .*paci"):
        validated(["--pipeline-schedule", "1f1b", flag, value])


@pytest.mark.parametrize("value, arity", [(None, 2), ("2", 2), ("1", 1), ("3", 3), ("fan", 3)])
def test_the_tree_arity_reaches_the_run_config(value, arity):
    extra = [] if value is None else ["--vocab-parallel-tree-arity", value]
    config = RunConfig.from_args(validated(extra), vocab_size=1001)
    assert config.pipeline.vocab_parallel_tree_arity == arity  # fan: N - 1 on 4 stages


@pytest.mark.parametrize("value", ["0", "-1", "binary", "2.5"])
def test_a_bad_tree_arity_is_one_line(value):
    with pytest.raises(UserError, match="--vocab-parallel-tree-arity must be an integer >= 1 "
                                        "or fan, got") as caught:  # fmt: skip
        validated(["--vocab-parallel-tree-arity", value])
    assert "\n" not in str(caught.value)


def test_the_tree_arity_needs_the_split():
    whole = [a for a in SPLIT if a != "--enable-vocab-parallel"]
    args = build_parser().parse_args(whole + ["--vocab-parallel-tree-arity", "fan"])
    with pytest.raises(
        UserError, match="--vocab-parallel-tree-arity needs --enable-vocab-parallel"
    ):
        validate_args(args, world_size=4)


@pytest.mark.parametrize("arity, root_children", [(2, 2), (3, 3), (1, 1)])
def test_the_transports_wire_the_root_with_the_arity(arity, root_children):
    """The in-process transport (and `VocabLinks.tree_arity` through `wire_output_tree`): the
    last stage sends each hidden state to `arity` children, itself besides."""
    import threading

    from megatron.pipeline.transport import InProcessTransport

    transport = InProcessTransport(tree_arity=arity)
    root = transport.vocab_streams(3, 4, threading.Condition(), hidden_size=8)
    down, own_queue = root.hidden_out[0].outboxes
    assert len(down.outboxes) == root_children
