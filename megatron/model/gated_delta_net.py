"""Gated DeltaNet hybrid attention (Qwen3-Next's linear attention): megatron-core's
`GatedDeltaNet` layer under Megatron's flags (--experimental-attention-variant gated_delta_net,
--linear-attention-freq, --linear-conv-kernel-dim, --linear-key-head-dim,
--linear-value-head-dim, --linear-num-key-heads, --linear-num-value-heads), with the portable
layer spec on any device.

--linear-attention-freq N makes every layer GDN except each N-th (layers N-1, 2N-1, ... keep
softmax attention); a list of 0/1 per layer says it layer by layer (1: GDN), as Megatron.
megatron-core builds the GDN layer from Transformer Engine's fused norm + column-parallel linear
and calls flash-linear-attention's Triton kernels: here the layer keeps its own input norm (the
portable spec's) ahead of a plain column-parallel input projection (same arithmetic), and where
`fla` is not installed its kernels are our portable torch ones (gated_delta_rule.py).

Tensor parallelism splits the GDN heads: each rank's slice of the input projection holds its
own part of each of q, k, v, the gate, beta and alpha, and of the convolution's channels; the
layout-independent initialization draws the whole matrices in one-process order and hands each
rank its part of every block (`tensor_parallel_blocks`), so a TP run starts from the weights of
a one-process run. The output norm sees only the rank's heads: its gradient is summed over the
tensor-parallel ranks (`partial_over_tensor_ranks`).
"""

import argparse
import copy
import importlib

import torch

from megatron.common.errors import UserError
from megatron.model.moe.flags import layer_pattern_parser

GDN_VARIANT = "gated_delta_net"

# Megatron-LM's defaults (megatron-core's TransformerConfig fields of the same names).
GDN_FIELDS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


parse_linear_attention_freq = layer_pattern_parser("--linear-attention-freq", "[1,1,0]")


def add_gated_delta_net_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("experimental attention variants").add_argument
    add("--experimental-attention-variant", default=None, choices=[GDN_VARIANT, "dsa"],
        help="gated_delta_net: Gated DeltaNet; dsa: DeepSeek sparse attention (dsa.py)")  # fmt: skip
    add("--linear-attention-freq", type=parse_linear_attention_freq, default=None,
        help="N: each N-th layer softmax, the rest GDN; or 0/1 per layer (1: GDN)")  # fmt: skip
    add("--linear-conv-kernel-dim", type=int, default=4, help="GDN's causal convolution width")
    add("--linear-key-head-dim", type=int, default=128, help="GDN's query/key head dim")
    add("--linear-value-head-dim", type=int, default=128, help="GDN's value/gate head dim")
    add("--linear-num-key-heads", type=int, default=16, help="GDN's query/key heads")
    add("--linear-num-value-heads", type=int, default=32, help="GDN's value/gate heads")
    add("--attention-output-gate", action="store_true",
        help="softmax attention's output times the sigmoid of a gate from the input")  # fmt: skip


def validate_gated_delta_net_args(args: argparse.Namespace) -> None:
    """megatron-core's checks (its asserts), and what is not built yet, one line each."""
    if args.attention_output_gate and args.multi_latent_attention:
        raise UserError("--attention-output-gate with --multi-latent-attention: megatron-core "
                        "has no output gate for MLA")  # fmt: skip
    if args.experimental_attention_variant != GDN_VARIANT:
        return
    freq, layers = args.linear_attention_freq, args.num_layers
    if freq is None:
        raise UserError(f"--experimental-attention-variant {GDN_VARIANT} needs "
                        "--linear-attention-freq")  # fmt: skip
    if isinstance(freq, int) and freq < 1:
        raise UserError(f"--linear-attention-freq must be >= 1, got {freq}")
    if isinstance(freq, list) and len(freq) != layers:
        raise UserError(f"--linear-attention-freq lists {len(freq)} layers, --num-layers {layers}")
    for name in GDN_FIELDS:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    keys, values = args.linear_num_key_heads, args.linear_num_value_heads
    if values % keys:
        raise UserError(f"--linear-num-value-heads {values} must be a multiple of "
                        f"--linear-num-key-heads {keys}")  # fmt: skip
    tp = args.tensor_model_parallel_size
    if keys % tp or values % tp:
        raise UserError("--linear-num-key-heads and --linear-num-value-heads must divide by the "
                        f"tensor-parallel size {tp}")  # fmt: skip
    _reject_not_yet_with_gdn(args)


def _reject_not_yet_with_gdn(args: argparse.Namespace) -> None:
    given = {
        # megatron-core 0.16.1 has no GDN context parallelism
        "--context-parallel-size > 1": args.context_parallel_size > 1,
        "--mtp-num-layers": bool(getattr(args, "mtp_num_layers", None)),
        # the recurrence runs over the whole sequence: no document mask
        "--reset-attention-mask": bool(getattr(args, "reset_attention_mask", False)),
    }
    for flag, used in given.items():
        if used:
            raise UserError(f"--experimental-attention-variant {GDN_VARIANT} with {flag} is not "
                            "supported yet")  # fmt: skip


def gated_delta_net_config_fields(model) -> dict:
    """The TransformerConfig fields of the run's `ModelConfig` (--attention-output-gate alone
    applies to softmax attention too)."""
    fields = {"attention_output_gate": model.attention_output_gate}
    if model.experimental_attention_variant != GDN_VARIANT:
        return fields
    freq = model.linear_attention_freq
    fields["experimental_attention_variant"] = GDN_VARIANT
    fields["linear_attention_freq"] = freq if isinstance(freq, int) else list(freq)
    fields.update({name: getattr(model, name) for name in GDN_FIELDS})
    return fields


def uses_gated_delta_net(config) -> bool:
    return getattr(config, "experimental_attention_variant", None) == GDN_VARIANT


# ---------------------------------------------------------------------------- megatron-core
GDN_MODULE = "megatron.core.ssm.gated_delta_net"


def use_portable_kernels_without_fla() -> None:
    """Our portable kernels where `fla` is not installed (megatron-core refuses to build the
    layer without it); fla's Triton kernels where it is."""
    from megatron.model import gated_delta_rule

    module = importlib.import_module(GDN_MODULE)
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        module.chunk_gated_delta_rule = gated_delta_rule.chunk_gated_delta_rule
        module.l2norm = gated_delta_rule.l2norm
        module.HAVE_FLA = True


def run_gate_functions_eagerly() -> None:
    """megatron-core's `torch.compile`d gate functions (the GDN output gate and norm, softmax
    attention's output gate) as plain functions: a host run is eager throughout (no compiler
    start-up in every process)."""
    from megatron.core.transformer.attention import Attention

    module = importlib.import_module(GDN_MODULE)
    for owner, name in ((module.GatedDeltaNet, "_apply_gated_norm"),
                        (Attention, "_apply_output_gate")):  # fmt: skip
        compiled = owner.__dict__[name]
        setattr(owner, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))


def _gdn_backend(norm: type | None):
    """megatron-core's local backend for its GDN spec function, with the input projection a
    plain column-parallel linear (the layer keeps its input norm: megatron-core's spec fuses
    it into Transformer Engine's norm + linear) and `norm` for the output norm (None: the
    local backend's)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class PortableGDNBackend(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return ColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return norm or super().layer_norm(rms_norm=rms_norm, for_qk=for_qk)

    return PortableGDNBackend()


def with_gated_delta_net(layer, config, norm: type | None):
    """A copy of a portable transformer-layer spec whose self-attention is megatron-core's GDN
    spec (`get_gated_delta_net_module_spec`) on `_gdn_backend(norm)`."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )

    attention = get_gated_delta_net_module_spec(config, backend=_gdn_backend(norm))
    attention.metainfo = {**attention.metainfo, "fuse_input_layernorm": False}
    layer = copy.deepcopy(layer)
    layer.submodules.self_attention = attention
    return layer


def stage_layer_ids(config, vp_stage: int | None, pp_rank: int | None) -> list[int]:
    """The global layer numbers (from 0) of this stage or chunk, as megatron-core slices its
    block specs (the pipeline layout's, else offset and count)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage,
                                             pp_rank=pp_rank))  # fmt: skip
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage,
                                                                pp_rank=pp_rank)))  # fmt: skip


def hybrid_block_spec(block, config, norm: type | None, *, vp_stage=None, pp_rank=None):
    """`block` (this stage's portable layer specs) with GDN where --linear-attention-freq puts
    it (megatron-core's `get_linear_attention_pattern`)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    pattern = get_linear_attention_pattern(config)
    ids = stage_layer_ids(config, vp_stage, pp_rank)
    if len(ids) != len(block.layer_specs):
        raise RuntimeError(f"stage layers {ids} against {len(block.layer_specs)} layer specs")
    layers = [
        with_gated_delta_net(spec, config, norm) if pattern[i] else spec
        for spec, i in zip(block.layer_specs, ids)
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=block.layer_norm)


def mark_gated_delta_net_parameters(model: torch.nn.Module) -> None:
    """What the layout-independent initialization and the gradient reduction need to know of
    each GDN layer: the one-process blocks of its input projection's rows (q, k, v, gate,
    beta, alpha) and its convolution's channels (q, k, v), each split over the tensor-parallel
    ranks; its per-head decay parameters split by heads; its output norm's partial gradients."""
    module = importlib.import_module(GDN_MODULE)
    for layer in model.modules():
        if not isinstance(layer, module.GatedDeltaNet):
            continue
        qk, v, heads = layer.qk_dim, layer.v_dim, layer.num_value_heads
        layer.in_proj.weight.tensor_parallel_blocks = (qk, qk, v, v, heads, heads)
        for param in layer.conv1d.parameters():
            param.partition_dim, param.tensor_parallel_blocks = 0, (qk, qk, v)
        layer.A_log.partition_dim = layer.dt_bias.partition_dim = 0
        for param in layer.out_norm.parameters():
            param.partial_over_tensor_ranks = True


def gdn_init_kind(name: str) -> str | None:
    """The initialization of a GDN parameter (megatron-core's `reset_parameters` and
    torch's Conv1d default), None for others."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return "gdn_log_decay"  # A ~ U(1, 16), stored as log A
    if leaf == "dt_bias":
        return "ones"
    if name.endswith("conv1d.weight"):
        return "gdn_conv"  # U(-1/sqrt(width), 1/sqrt(width)): one input channel per group
    if name.endswith("self_attention.out_proj.weight"):
        return "scaled_normal"  # megatron-core's output_layer_init_method
    return None


def draw_gdn(kind: str, full: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if kind == "gdn_log_decay":
        return full.uniform_(1.0, 16.0, generator=generator).log_()
    bound = 1.0 / full.size(-1) ** 0.5  # conv1d weight [channels, 1, width]
    return full.uniform_(-bound, bound, generator=generator)


def tensor_parallel_slice(full: torch.Tensor, blocks, shards: int, shard: int) -> torch.Tensor:
    """This rank's rows of a whole tensor made of `blocks` (their row counts, or a number of
    equal blocks) each split over the ranks."""
    if isinstance(blocks, int):
        blocks = [full.size(0) // blocks] * blocks
    pieces = full.split(list(blocks), dim=0)
    return torch.cat([piece.chunk(shards, dim=0)[shard] for piece in pieces], dim=0)
