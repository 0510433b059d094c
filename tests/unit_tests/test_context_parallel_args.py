"""--context-parallel-size: what the flags derive, and each bad combination as one line."""

import pytest
from test_validation import validation_error, with_flags

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args


def validated(argv: list[str], world_size: int = 4):
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=world_size)
    return args


def test_context_parallel_ranks_are_not_data_parallel_ranks():
    args = validated(with_flags("--pipeline-model-parallel-size", "2", "--attention-dropout",
                                "0", "--context-parallel-size", "2"), world_size=8)  # fmt: skip
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 2)
    assert args.num_microbatches == 8 // (2 * 2)


@pytest.mark.parametrize(
    "pairs, message",
    [
        (("--context-parallel-size", "3", "--pipeline-model-parallel-size", "1"),
         "world size 4 is not divisible by tensor x pipeline x context parallel size 1 x 1 x 3"),
        (("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--seq-length", "30"),
         "--seq-length 30 must be divisible by 2 x --context-parallel-size 2"),
        (("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--cp-comm-type", "allgather"),
         "--cp-comm-type allgather: one of p2p, all_gather, a2a, a2a+p2p"),
        (("--context-parallel-size", "4", "--pipeline-model-parallel-size", "1",
          "--cp-comm-type", "a2a+p2p"),
         "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm"),
        (("--context-parallel-size", "4", "--pipeline-model-parallel-size", "1",
          "--num-attention-heads", "6", "--hidden-size", "96", "--cp-comm-type", "a2a"),
         "--cp-comm-type a2a: the 6 attention heads of a tensor-parallel rank must divide over "
         "its all-to-all of 4 ranks"),
    ],
)  # fmt: skip
def test_bad_context_parallel_settings_are_one_line(pairs, message):
    assert message in validation_error(with_flags(*pairs))


def test_sequence_parallel_needs_each_ranks_chunks_to_split_over_tensor_parallel_ranks():
    argv = with_flags("--context-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                      "--tensor-model-parallel-size", "4", "--sequence-parallel", None,
                      "--seq-length", "36", "--attention-dropout", "0")  # fmt: skip
    with pytest.raises(UserError, match="--seq-length 36 / --context-parallel-size 2 must be"):
        validated(argv, world_size=8)


def test_megatrons_default_comm_type_is_accepted():
    args = validated(with_flags("--context-parallel-size", "2", "--pipeline-model-parallel-size",
                                "2", "--cp-comm-type", "p2p", "--attention-dropout", "0"))  # fmt: skip
    assert args.context_parallel_size == 2


def hierarchical(sizes: list[str], *pairs: str) -> list[str]:
    """CP 4 on 4 ranks (one stage) with these hierarchical sizes."""
    argv = with_flags("--context-parallel-size", "4", "--pipeline-model-parallel-size", "1",
                      *pairs)  # fmt: skip
    return argv + ["--hierarchical-context-parallel-sizes", *sizes]


def test_hierarchical_context_parallelism_is_accepted_with_megatrons_rules():
    """a2a+p2p with sizes 2 2 (the all-to-all's, the ring's), Megatron's default attention
    dropout; sizes whose product is not CP, a2a+p2p over 3 levels, heads that do not divide
    over the inner all-to-all, and a per-layer list of the wrong length are one line each."""
    args = validated(hierarchical(["2", "2"], "--cp-comm-type", "a2a+p2p"))
    assert (args.hierarchical_context_parallel_sizes, args.cp_comm_type) == ([2, 2], ["a2a+p2p"])
    assert args.attention_dropout == 0.1
    assert "their product must be --context-parallel-size 4" in validation_error(
        hierarchical(["2", "1"], "--cp-comm-type", "a2a+p2p"))  # fmt: skip
    assert "a2a+p2p takes 2 --hierarchical-context-parallel-sizes" in validation_error(
        hierarchical(["2", "2", "1"], "--cp-comm-type", "a2a+p2p"))  # fmt: skip
    assert "the 3 attention heads of a tensor-parallel rank must divide over its all-to-all of " \
        "2 ranks" in validation_error(hierarchical(["2", "2"], "--cp-comm-type", "a2a+p2p",
                                                   "--num-attention-heads", "3", "--hidden-size",
                                                   "48"))  # fmt: skip
    argv = with_flags("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    per_layer = validated(argv + ["--cp-comm-type", "p2p", "all_gather", "a2a", "a2a+p2p",
                                  "--hierarchical-context-parallel-sizes", "2", "1"])  # fmt: skip
    assert per_layer.cp_comm_type == ["p2p", "all_gather", "a2a", "a2a+p2p"]
    assert "3 types for 4 layers" in validation_error(argv + ["--cp-comm-type", "p2p", "a2a",
                                                              "p2p"])  # fmt: skip
