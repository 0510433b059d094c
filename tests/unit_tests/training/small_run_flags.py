"""The flags of a small valid one-process GPT run, for tests that parse and validate flags in
process (no launch): `validated(extra)` is that run with `extra` added, `error_of(extra)` the
one line its validation refuses it with."""

import pytest

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "4", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


def validated(extra: list[str], world_size: int = 1):
    """BASE + extra, parsed and checked as `world_size` processes would."""
    args = build_parser().parse_args(BASE + extra)
    validate_args(args, world_size=world_size)
    return args


def error_of(extra: list[str], world_size: int = 1) -> str:
    """The one-line refusal of `validated(extra, world_size)` (which must refuse)."""
    with pytest.raises(UserError) as caught:
        validated(extra, world_size)
    return str(caught.value)


def configured(extra: list[str], world_size: int = 1, vocab_size: int | None = None):
    """The typed configuration (`RunConfig`) of `validated(extra, world_size)`; `vocab_size`,
    the tokenizer's, pads the model's vocabulary as a run does."""
    from megatron.training.config import RunConfig

    return RunConfig.from_args(validated(extra, world_size), vocab_size=vocab_size)
