"""Multi-latent attention's flags, in process: Megatron's defaults reach megatron-core's
MLATransformerConfig, the portable layer spec runs MLA with our core attention (latent norms
with --qk-layernorm), and what is refused says so in one line. Training runs, flush parity and
PACI's drift with MLA: tests/functional_tests/test_mla_cases.py."""

import pytest
import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig
from small_run_flags import configured, validated

from megatron.common.errors import UserError
from megatron.model.build import transformer_config
from megatron.model.gpt import PortableNorm, SDPACoreAttention, _latent_norm, layer_spec_for

CPU = torch.device("cpu")


def test_megatrons_defaults_reach_the_config():
    config = transformer_config(configured(["--multi-latent-attention"]), CPU)
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank) == (None, 32)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (128, 64, 128)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (1.0, 1.0, 0.0)
    assert config.rope_type == "yarn"  # megatron-core's default for MLA, as in Megatron
    assert not isinstance(transformer_config(configured([]), CPU), MLATransformerConfig)


def test_flags_set_the_fields():
    flags = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
             "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
             "--rope-type", "rope", "--rotary-scaling-factor", "4", "--mscale", "0.5",
             "--mscale-all-dim", "1", "--rotary-base", "5000"]  # fmt: skip
    config = transformer_config(configured(flags), CPU)
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (24, 16, 12)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim) == (16, 8)
    assert (config.rope_type, config.rotary_scaling_factor, config.rotary_base) == ("rope", 4, 5000)
    assert (config.mscale, config.mscale_all_dim) == (0.5, 1.0)


def test_the_portable_spec_runs_mla_with_latent_norms():
    flags = ["--multi-latent-attention", "--qk-layernorm", "--normalization", "RMSNorm"]
    config = transformer_config(configured(flags), CPU)
    layer = layer_spec_for(CPU, config)
    attention = layer.submodules.self_attention
    assert attention.module is MLASelfAttention
    assert attention.submodules.core_attention is SDPACoreAttention
    norm = attention.submodules.q_layernorm
    assert norm is attention.submodules.kv_layernorm and norm.__name__ != "IdentityOp"
    assert layer.submodules.pre_mlp_layernorm.__name__ != "IdentityOp"  # the MLP keeps its norm
    assert _latent_norm(config, own_norms=True) is PortableNorm  # zero-centered or SP norms
    plain = layer_spec_for(CPU, transformer_config(configured(["--multi-latent-attention"]), CPU))
    assert plain.submodules.self_attention.submodules.q_layernorm.__name__ == "IdentityOp"


@pytest.mark.parametrize("extra, world_size, message", [
    (["--group-query-attention", "--num-query-groups", "2"], 1,
     "--group-query-attention and --multi-latent-attention exclude each other"),
    (["--context-parallel-size", "2", "--attention-dropout", "0"], 2,
     "--multi-latent-attention with --context-parallel-size > 1 is not supported yet"),
    (["--qk-pos-emb-head-dim", "7"], 1, "--qk-pos-emb-head-dim must be even"),
    (["--kv-lora-rank", "0"], 1, "--kv-lora-rank must be >= 1"),
    (["--q-lora-rank", "0"], 1, "--q-lora-rank must be >= 1"),
])  # fmt: skip
def test_bad_input_is_one_line(extra, world_size, message):
    with pytest.raises(UserError, match=message):
        validated(["--multi-latent-attention"] + extra, world_size=world_size)


def test_yarn_needs_mla():
    with pytest.raises(UserError, match="--rope-type yarn needs --multi-latent-attention"):
        validated(["--rope-type", "yarn"])
    assert validated(["--rope-type", "rope"]).rope_type == "rope"


def test_yarn_reaches_the_gpt_models_config_with_megatrons_defaults():
    config = transformer_config(configured(["--position-embedding-type", "yarn"]), CPU)
    assert config.yarn_rotary_scaling_factor == 1.0 and config.yarn_mscale_all_dim == 0.0
    assert config.yarn_original_max_position_embeddings == 4096
    assert (config.yarn_beta_fast, config.yarn_beta_slow) == (32.0, 1.0)
    assert config.yarn_correction_range_round_to_int is True
    flags = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
             "--yarn-original-max-position-embeddings", "16", "--yarn-beta-fast", "8",
             "--no-yarn-correction-range-round-to-int", "--mscale", "0.5"]  # fmt: skip
    config = transformer_config(configured(flags), CPU)
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (
        4.0, 16)  # fmt: skip
    assert (config.yarn_beta_fast, config.yarn_mscale) == (8.0, 0.5)
    assert config.yarn_correction_range_round_to_int is False
    assert not hasattr(transformer_config(configured([]), CPU), "yarn_beta_fast")


@pytest.mark.parametrize("extra, world_size, message", [
    (["--multi-latent-attention"], 1, "MLA rotates its own position part"),
    (["--context-parallel-size", "2", "--attention-dropout", "0"], 2,
     "--position-embedding-type yarn with --context-parallel-size > 1 is not supported yet"),
])  # fmt: skip
def test_yarn_refuses_in_one_line(extra, world_size, message):
    with pytest.raises(UserError, match=message):
        validated(["--position-embedding-type", "yarn"] + extra, world_size=world_size)
