"""Multi-latent attention (DeepSeek-V2/V3's MLA): megatron-core's `MLASelfAttention` under
Megatron's flags, with the portable layer spec on any device; and YaRN for the GPT model's own
rotary embedding (--position-embedding-type yarn).

MLA compresses the keys and values of every head into one latent of `--kv-lora-rank` per
token (and the queries into `--q-lora-rank`, or not at all by default), expands them per head
to `--qk-head-dim` (queries, keys) and `--v-head-dim` (values), and carries the position in
a separate `--qk-pos-emb-head-dim` part of each query and key, rotated by RoPE or YaRN
(`--rope-type`, YaRN by default as in Megatron, scaled by `--rotary-scaling-factor`,
`--mscale`, `--mscale-all-dim`). The rotary embedding lives inside the attention, not in the
GPT model (off CUDA its frequencies stay on the host: `model.run_rotary_on_host`).

The flags and their defaults are Megatron-LM's (`--kv-lora-rank 32`, head dims 128 / 64 /
128). megatron-core's local spec for MLA asks its local backend for a plain `linear`, which
that backend does not have; here the layer is the portable spec (its norms, MLP and our SDPA
core attention) with its self-attention swapped for MLA built from tensor-parallel linears:
the two down projections are column-parallel and megatron-core gathers their output, so
every tensor rank sees the whole latent (the arithmetic of one process). With
--qk-layernorm the latents are normalized (DeepSeek's q_a and kv_a norms), as the fused
layer-norm linears of Transformer Engine's spec do.
"""

import argparse
import copy

from megatron.common.errors import UserError

# Megatron-LM's names and defaults (megatron/training/arguments.py, `_add_mla_args`).
MLA_FIELDS = {
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("multi-latent attention").add_argument
    add("--multi-latent-attention", action="store_true",
        help="DeepSeek's multi-latent attention (megatron-core's MLASelfAttention)")  # fmt: skip
    add("--q-lora-rank", type=int, default=None,
        help="rank of the queries' latent; default: queries not compressed")  # fmt: skip
    add("--kv-lora-rank", type=int, default=32, help="rank of the keys' and values' latent")
    add("--qk-head-dim", type=int, default=128, help="query/key head dim without the position part")
    add("--qk-pos-emb-head-dim", type=int, default=64, help="the rotated part of each head")
    add("--v-head-dim", type=int, default=128)
    add("--rope-type", default=None, choices=["rope", "yarn"],
        help="the rotary embedding inside MLA (default yarn); other attention takes rope only")  # fmt: skip
    add("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's scaling factor (MLA)")
    add("--mscale", type=float, default=1.0, help="YaRN's mscale (MLA)")
    add("--mscale-all-dim", type=float, default=0.0, help="YaRN's mscale over all dims (MLA)")


def add_yarn_args(parser: argparse.ArgumentParser) -> None:
    """YaRN for the GPT model's own rotary embedding (--position-embedding-type yarn); its
    scaling factor and mscales are the MLA group's flags, as in Megatron."""
    add = parser.add_argument_group("YaRN").add_argument
    add("--yarn-original-max-position-embeddings", type=int, default=None,
        help="the context length the model was trained at (default 4096)")  # fmt: skip
    add("--yarn-beta-fast", type=float, default=None, help="default 32")
    add("--yarn-beta-slow", type=float, default=None, help="default 1")
    add("--yarn-correction-range-round-to-int", action="store_true", default=None,
        help="round the correction range to integers (the default)")  # fmt: skip
    add("--no-yarn-correction-range-round-to-int", action="store_false",
        dest="yarn_correction_range_round_to_int")  # fmt: skip


def yarn_config_attributes(model) -> dict:
    """The `yarn_*` attributes megatron-core's GPT model reads off its config for
    --position-embedding-type yarn (Megatron sets them the same way, defaults included); none
    with MLA, whose attention takes its own."""
    if model.position_embedding_type != "yarn" or model.multi_latent_attention:
        return {}
    given = {
        "yarn_rotary_scaling_factor": (model.rotary_scaling_factor, 1.0),
        "yarn_original_max_position_embeddings": (
            model.yarn_original_max_position_embeddings,
            4096,
        ),
        "yarn_beta_fast": (model.yarn_beta_fast, 32.0),
        "yarn_beta_slow": (model.yarn_beta_slow, 1.0),
        "yarn_mscale": (model.mscale, 1.0),
        "yarn_mscale_all_dim": (model.mscale_all_dim, 0.0),
        "yarn_correction_range_round_to_int": (model.yarn_correction_range_round_to_int, True),
    }
    return {name: default if value is None else value for name, (value, default) in given.items()}


def validate_mla_and_yarn_args(args: argparse.Namespace) -> None:
    """Megatron's checks, and what is not built yet, one line each."""
    if args.position_embedding_type == "yarn":
        if args.multi_latent_attention:  # the GPT model would pass MLA a rotary embedding
            raise UserError("--position-embedding-type yarn with --multi-latent-attention: MLA "
                            "rotates its own position part, choose it with --rope-type yarn")  # fmt: skip
        if args.context_parallel_size > 1:
            raise UserError(
                "--position-embedding-type yarn with --context-parallel-size > 1 is not "
                "supported yet"
            )
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":  # Megatron: common attention only supports rope
            raise UserError("--rope-type yarn needs --multi-latent-attention")
        return
    if args.group_query_attention:
        raise UserError("--group-query-attention and --multi-latent-attention exclude each other")
    if args.context_parallel_size > 1:
        raise UserError(
            "--multi-latent-attention with --context-parallel-size > 1 is not supported yet"
        )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        raise UserError(f"--q-lora-rank must be >= 1, got {args.q_lora_rank}")
    if args.qk_pos_emb_head_dim % 2:
        raise UserError(
            f"--qk-pos-emb-head-dim must be even (RoPE), got {args.qk_pos_emb_head_dim}"
        )
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise UserError(f"--num-attention-heads must divide by the tensor-parallel size {tp}")


def mla_config_fields(model) -> dict:
    """The MLATransformerConfig fields of the run's `ModelConfig` (empty without MLA)."""
    if not model.multi_latent_attention:
        return {}
    fields = {name: getattr(model, name) for name in MLA_FIELDS}
    if model.rope_type is not None:  # else megatron-core's default for MLA: YaRN
        fields["rope_type"] = model.rope_type
    fields["rotary_base"] = model.rotary_base
    fields["rotary_percent"] = model.rotary_percent
    return fields


def mla_attention_spec(core_attention: type, latent_norm: type | None):
    """MLA from tensor-parallel linears, `core_attention` inside; `latent_norm` normalizes the
    query and key/value latents (--qk-layernorm), None: no norm. (megatron-core imported here:
    parsing the flags does not load it.)"""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import (
        MLASelfAttention,
        MLASelfAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = latent_norm or IdentityOp
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=core_attention,
            linear_proj=RowParallelLinear,
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )


def with_mla(layer, latent_norm: type | None):
    """A copy of a portable transformer-layer spec whose self-attention is MLA (the core
    attention kept)."""
    layer = copy.deepcopy(layer)
    core = layer.submodules.self_attention.submodules.core_attention
    layer.submodules.self_attention = mla_attention_spec(core, latent_norm)
    return layer
