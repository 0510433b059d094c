"""The GPT model: megatron-core's `GPTModel`, one pipeline stage of it per rank.

Two things here are ours rather than megatron-core's:

* a portable layer spec whose core attention calls `torch.nn.functional.scaled_dot_product_attention`
  (megatron-core's local `DotProductAttention` needs CUDA for its RNG tracker); Transformer
  Engine's spec is used instead when TE is installed and the device is CUDA;
* a layout-independent initialization: every parameter is drawn from a generator seeded by its
  *global* name (global layer number, full unsharded shape), then sliced to this rank's
  tensor-parallel shard. A 4-stage run therefore starts from exactly the weights of a 1-stage
  run, which is what lets tests compare pipelined and non-pipelined losses.
"""

import copy
import math
import re
import zlib
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Causal core attention on `torch.nn.functional.scaled_dot_product_attention`.

    Same call contract as megatron-core's `DotProductAttention`: query [sq, b, np, hn],
    key/value [sk, b, ng, hn] (already split over tensor-parallel ranks), returns [sq, b, np*hn].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **unused):
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.size(1) != q.size(1):  # grouped-query attention: repeat the key/value groups
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
        )
        sq, b = context.size(2), context.size(0)
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


def portable_layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer spec with our SDPA core attention swapped in."""
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_for(device: torch.device) -> ModuleSpec:
    """Transformer Engine's spec on CUDA when TE is installed, else the portable spec."""
    if device.type == "cuda" and transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    return portable_layer_spec()


@dataclass
class StageLayout:
    """Where this rank's model chunk sits in the whole model.

    Layers are split evenly over the stages unless the first or last stage is given its own
    count (Megatron's --decoder-first/last-pipeline-num-layers), e.g. to balance the embedding
    or the output layer and loss; the remaining layers are then split evenly over the others.
    """

    pipeline_rank: int
    pipeline_size: int
    tensor_rank: int
    tensor_size: int
    num_layers: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def layers_on(self, stage: int) -> int:
        if stage == 0 and self.first_stage_layers is not None:
            return self.first_stage_layers
        if stage == self.pipeline_size - 1 and self.last_stage_layers is not None:
            return self.last_stage_layers
        uneven = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
        middle_stages = self.pipeline_size - len(uneven)
        return (self.num_layers - sum(uneven)) // middle_stages

    @property
    def layers_per_stage(self) -> int:
        return self.layers_on(self.pipeline_rank)

    @property
    def layer_offset(self) -> int:
        return sum(self.layers_on(stage) for stage in range(self.pipeline_rank))

    @property
    def is_first(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1


def build_gpt_stage(
    config: TransformerConfig,
    layout: StageLayout,
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str,
    device: torch.device,
    seed: int,
) -> GPTModel:
    """Build this rank's GPT stage on `device`, initialized independently of the layout."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec_for(device),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=layout.is_first,
        post_process=layout.is_last,
        # Tied embeddings would need a first<->last stage all-reduce every step: a global
        # synchronization PACI must not have. Input and output embeddings are separate.
        share_embeddings_and_output_weights=False,
        position_embedding_type=position_embedding_type,
    )
    initialize_layout_independent(model, layout, seed=seed, init_method_std=config.init_method_std)
    return model.to(device)


_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_parameter_name(name: str, layout: StageLayout) -> str:
    """`decoder.layers.<local>.x` -> `decoder.layers.<global>.x`; other names unchanged."""
    match = _LOCAL_LAYER.match(name)
    if match is None:
        return name
    global_index = int(match.group(1)) + layout.layer_offset
    return f"decoder.layers.{global_index}." + name[match.end() :]


def _init_kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf in ("weight", "layer_norm_weight"):
        return "ones"
    if leaf.endswith("bias"):
        return "zeros"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "scaled_normal"  # residual-branch outputs, GPT-2 style
    return "normal"


@torch.no_grad()
def initialize_layout_independent(
    model: torch.nn.Module, layout: StageLayout, *, seed: int, init_method_std: float
) -> None:
    """Megatron's init scheme (normal(std), std/sqrt(2L) on residual outputs, ones/zeros for
    norms and biases), drawn per parameter from its global name so it is layout-independent."""
    scaled_std = init_method_std / math.sqrt(2.0 * layout.num_layers)
    for name, param in model.named_parameters():
        kind = _init_kind(name)
        if kind == "ones":
            param.fill_(1.0)
            continue
        if kind == "zeros":
            param.zero_()
            continue
        full_shape = list(param.shape)
        partition_dim = getattr(param, "partition_dim", -1)
        sharded = getattr(param, "tensor_model_parallel", False) and partition_dim >= 0
        if sharded:
            full_shape[partition_dim] *= layout.tensor_size
        global_name = global_parameter_name(name, layout)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{global_name}".encode()))
        std = scaled_std if kind == "scaled_normal" else init_method_std
        full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        if sharded:
            full = full.chunk(layout.tensor_size, dim=partition_dim)[layout.tensor_rank]
        param.copy_(full)
