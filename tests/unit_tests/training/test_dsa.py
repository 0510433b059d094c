"""DeepSeek sparse attention (dsa.py): the Hadamard rotation against the matrix itself, the
flags' refusals, one line each."""

import pytest
import torch
from small_run_flags import configured, error_of

from megatron.model.dsa import hadamard_rotation

MLA = "--multi-latent-attention --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16".split()
DSA = (
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


def test_the_flags_reach_the_model_config():
    from megatron.model.dsa import dsa_config_fields

    config = configured(MLA + DSA + ["--dsa-indexer-use-sparse-loss"], vocab_size=100)
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
    assert error_of(MLA + DSA + extra) == message


def test_sparse_attention_needs_mla():
    assert "dsa needs --multi-latent-attention" in error_of(DSA)
