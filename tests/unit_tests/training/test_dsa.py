"""DeepSeek sparse attention (dsa.py): the Hadamard rotation against the matrix itself, the
flags' refusals, one line each."""

import pytest
import torch

from megatron.training.arguments import build_parser, validate_args
from megatron.training.dsa import hadamard_rotation
from megatron.training.errors import UserError

GOOD = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --multi-latent-attention "
    "--qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --kv-lora-rank 16 "
    "--experimental-attention-variant dsa --dsa-indexer-n-heads 4 --dsa-indexer-head-dim 32 "
    "--dsa-indexer-topk 8 --dsa-indexer-loss-coeff 0.01"
).split()


def sylvester(n: int) -> torch.Tensor:
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix


@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_hadamard_rotation_is_the_orthonormal_sylvester_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    expected = x @ sylvester(n).double().T / n**0.5
    assert torch.allclose(hadamard_rotation(x), expected, atol=1e-5)  # computed in fp32
    assert torch.allclose(hadamard_rotation(hadamard_rotation(x)), x, atol=1e-5)  # orthogonal
    assert hadamard_rotation(x.bfloat16()).dtype == torch.bfloat16


def validated(extra: list[str], world_size: int = 1):
    args = build_parser().parse_args(GOOD + extra)
    validate_args(args, world_size=world_size)
    return args


def test_the_flags_reach_the_model_config():
    from megatron.training.config import RunConfig
    from megatron.training.dsa import dsa_config_fields

    config = RunConfig.from_args(validated(["--dsa-indexer-use-sparse-loss"]), vocab_size=1000)
    assert dsa_config_fields(config.model) == {
        "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 4,
        "dsa_indexer_head_dim": 32, "dsa_indexer_topk": 8, "dsa_indexer_loss_coeff": 0.01,
        "dsa_indexer_use_sparse_loss": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dsa-indexer-head-dim", "24"],
         "--dsa-indexer-head-dim must be a power of two (the Hadamard rotation), got 24"),
        (["--dsa-indexer-head-dim", "8"],
         "--dsa-indexer-head-dim 8 must exceed --qk-pos-emb-head-dim 8 (the rotary part of the "
         "indexer's heads)"),
        (["--dsa-indexer-topk", "0"],
         "--experimental-attention-variant dsa needs --dsa-indexer-topk >= 1"),
        (["--dsa-indexer-loss-coeff", "-1"], "--dsa-indexer-loss-coeff must be >= 0"),
        (["--dsa-kernel-backend", "tilelang"], "--dsa-kernel-backend is not supported yet"),
    ],
)  # fmt: skip
def test_refusals_are_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value) == message


def test_sparse_attention_needs_mla():
    args = [a for a in GOOD if a != "--multi-latent-attention"]
    with pytest.raises(UserError, match="dsa needs --multi-latent-attention"):
        validate_args(build_parser().parse_args(args), world_size=1)
