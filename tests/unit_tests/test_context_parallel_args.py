"""--context-parallel-size: what the flags derive, and each bad combination as one line."""

import pytest
from test_validation import validation_error, with_flags

from megatron.training.arguments import build_parser, validate_args
from megatron.training.errors import UserError


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
          "--attention-dropout", "0.1"),
         "--attention-dropout with --context-parallel-size > 1 is not supported yet"),
        (("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--cp-comm-type", "a2a"), "--cp-comm-type is not supported yet"),
        (("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--hierarchical-context-parallel-sizes", "2", "1"),
         "--hierarchical-context-parallel-sizes is not supported yet"),
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
