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

import contextlib
import copy
import dataclasses
import importlib
import math
import re
import types
import zlib
from dataclasses import dataclass

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as tensor_parallel_random
from megatron.core.tensor_parallel.random import (
    _DATA_PARALLEL_RNG_TRACKER_NAME,
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.distributed.context_parallel.attention import (
    ContextParallelAttention,
    hierarchical_groups,
    layer_comm_type,
)
from megatron.model import gated_delta_net as gdn
from megatron.model import mup
from megatron.model.dsa import prepare_megatron_core as prepare_sparse_attention
from megatron.model.dsa import uses_sparse_attention, with_sparse_attention
from megatron.model.mla import with_mla
from megatron.model.mtp import mtp_block_spec
from megatron.model.recompute import use_host_rng_states
from megatron.pipeline.vocab_parallel import InputShard, OutputShard


class SDPACoreAttention(MegatronModule):
    """Causal core attention on `torch.nn.functional.scaled_dot_product_attention`; with an
    attention mask (megatron-core's convention, True = masked out), that mask.

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
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        # context parallelism over megatron-core's context-parallel group (--cp-comm-type:
        # ours per layer, read off the config by layer number; megatron-core's own field stays
        # unset, its per-layer lookup is off by one in 0.16)
        self.context_parallel = None
        if config.context_parallel_size > 1:
            comm_type = layer_comm_type(getattr(config, "cp_comm_types", None), layer_number)
            self.context_parallel = ContextParallelAttention(
                comm_type,
                getattr(pg_collection, "cp", None) or context_parallel_group(),
                hierarchical_groups(pg_collection) if comm_type == "a2a+p2p" else None,
            )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        head_dim = config.kv_channels if k_channels is None else k_channels  # MLA: its own
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **unused):
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.context_parallel is not None:  # this rank's 2 chunks, the whole sequence
            dropout_p = self.dropout_p if self.training else 0.0
            context = self.context_parallel(q, k, v, self.softmax_scale, dropout_p)
            sq, b = context.size(2), context.size(0)
            return context.permute(2, 0, 1, 3).reshape(sq, b, -1)
        if k.size(1) != q.size(1):  # grouped-query attention: repeat the key/value groups
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        # megatron-core's mask (--reset-attention-mask): True where attention is masked out;
        # causal already. Without one, causal attention.
        allowed = None if attention_mask is None else ~attention_mask
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=allowed is None,
            scale=self.softmax_scale,
        )
        sq, b = context.size(2), context.size(0)
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


def context_parallel_group():
    """megatron-core's context-parallel group, None without context parallelism (or before
    its groups exist)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


class PortableNorm(torch.nn.Module):
    """LayerNorm or RMSNorm for the portable spec where megatron-core's torch norm wrapper falls
    short:

    * zero-centered gamma (Megatron's --apply-layernorm-1p): the weight stores gamma - 1 (only
      Transformer Engine's norms have the variant);
    * sequence parallelism, which the wrapper refuses: each tensor-parallel rank normalizes its
      part of the sequence with the same (replicated) weights, so they are tagged
      `sequence_parallel` and their gradients summed over the tensor-parallel group, as Apex's
      and Transformer Engine's norms are in Megatron."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.shape, self.eps = (hidden_size,), eps
        self.weight = torch.nn.Parameter(
            torch.zeros(hidden_size) if self.zero_centered else torch.ones(hidden_size)
        )
        self.weight.zero_centered = self.zero_centered  # our initialization draws it as zeros
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight if self.zero_centered else self.weight
        if self.rms:
            return torch.nn.functional.rms_norm(x, self.shape, gamma, self.eps)
        return torch.nn.functional.layer_norm(x, self.shape, gamma, self.bias, self.eps)


def portable_layer_spec(
    normalization: str = "LayerNorm", qk_layernorm: bool = False, own_norms: bool = False
) -> ModuleSpec:
    """megatron-core's local GPT layer spec with our SDPA core attention swapped in; with
    `own_norms`, `PortableNorm` for every norm of the layer."""
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    if own_norms:
        spec.submodules.input_layernorm = PortableNorm
        spec.submodules.pre_mlp_layernorm = PortableNorm
        if qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = PortableNorm
    return spec


class _HostEvent:
    """A CUDA event's calls on the host, where every operation has finished when it returns."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream's calls on the host: one in-order stream, so waits are no-ops."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _HostCuda:
    """`torch.cuda` with the host as its current device, for megatron-core modules that
    allocate their tensor-parallel buffers on CUDA's current device (asking for it raises
    where there is no CUDA), and host stand-ins for the streams and events the MoE token
    dispatchers and shared experts use to overlap copies (one in-order host stream)."""

    Stream = _HostStream
    Event = _HostEvent

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def current_stream(device=None) -> _HostStream:
        return _HOST_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TorchOnHost(types.ModuleType):
    """`torch`, with `_HostCuda` as its `cuda`."""

    cuda = _HostCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


# The megatron-core 0.16.1 modules whose sequence-parallel paths allocate on the CUDA device:
# the gather / reduce-scatter mappings, the linear layers' input gather, the memory buffer;
# and its MoE modules (router buffers, dispatcher and shared-expert streams, expert
# placement), which do so whatever the parallelism.
_CUDA_BUFFER_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)
_MOE_MODULES = (
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
)


class HostRNGStatesTracker(CudaRNGStatesTracker):
    """megatron-core's tracker of named RNG states, on the host generator: its sequence-
    parallel embedding dropout forks the tensor-parallel state, which the CUDA tracker cannot
    create without CUDA. Same seeds as megatron-core's (`model_parallel_cuda_manual_seed`)."""

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"RNG state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


# megatron-core 0.16.1 builds MLA's rotary embeddings without its CPU-initialization switch, and
# its YaRN (MLA's or the GPT model's) moves the frequencies to the CUDA device at the first
# forward.
_ROTARY_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def _torch_on_host(module_names) -> None:
    """The named modules' `torch` names the host as CUDA's current device."""
    for name in module_names:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnHost):
            module.torch = _TorchOnHost("torch")


def run_rotary_on_host() -> None:
    """A CPU run without CUDA with multi-latent attention or YaRN: the rotary embeddings, and
    the tensor-parallel gather of MLA's latents (whose buffer megatron-core allocates on CUDA's
    current device), on the host."""
    if not torch.cuda.is_available():
        _torch_on_host(_ROTARY_MODULES + _CUDA_BUFFER_MODULES)


def run_sequence_parallel_on_host(seed: int, tensor_rank: int, *, moe: bool = False) -> None:
    """A CPU run without CUDA, with --sequence-parallel or MoE layers (megatron-core 0.16.1
    assumes CUDA there): its buffers become host tensors (only the `torch` of the modules that
    allocate them is swapped, for one naming the host as the current CUDA device and giving
    host streams and events; on a machine without CUDA the original calls could only raise),
    and its RNG tracker a host one (the experts fork the expert-parallel state)."""
    if torch.cuda.is_available():
        return
    _torch_on_host(_CUDA_BUFFER_MODULES + (_MOE_MODULES if moe else ()))
    tracker = HostRNGStatesTracker()
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tensor_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    tensor_parallel_random._CUDA_RNG_STATE_TRACKER = tracker
    tensor_parallel_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_for(device: torch.device, config: TransformerConfig, *, use_te: bool = True,
                   vp_stage: int | None = None, pp_rank: int | None = None):  # fmt: skip
    """Transformer Engine's spec on CUDA when TE is installed (and `use_te`), else the portable
    spec; the portable one as a block (the layers of this stage and the final norm) when the
    norms are zero-centered or sequence-parallel, which megatron-core's default final norm
    cannot be."""
    qk_layernorm = config.qk_layernorm
    use_te = use_te and not uses_sparse_attention(config)  # megatron-core's DSA is local only
    if gdn.uses_gated_delta_net(config):
        return hybrid_gdn_block_spec(device, config, use_te=use_te, vp_stage=vp_stage,
                                     pp_rank=pp_rank)  # fmt: skip
    if config.num_moe_experts:
        return moe_block_spec(device, config, use_te=use_te, vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te and device.type == "cuda" and transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    own_norms = config.layernorm_zero_centered_gamma or config.sequence_parallel
    spec = portable_layer_spec(config.normalization, qk_layernorm, own_norms)
    if config.multi_latent_attention:
        spec = _with_mla_attention(spec, config, own_norms)
    if not own_norms:
        return spec
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=PortableNorm)


def moe_block_spec(device: torch.device, config: TransformerConfig, *, use_te: bool = True,
                   vp_stage: int | None = None,
                   pp_rank: int | None = None) -> TransformerBlockSubmodules:  # fmt: skip
    """The layers of this stage (or chunk) with MoE layers where --moe-layer-freq puts them:
    megatron-core's decoder block spec (its per-layer dense/MoE choice and pipeline slicing),
    Transformer Engine's on CUDA with TE, else the local one with our SDPA core attention (and
    our norms when they are zero-centered or sequence-parallel, as `layer_spec_for`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = use_te and device.type == "cuda" and transformer_engine_available()
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage,
        pp_rank=pp_rank,
    )  # fmt: skip
    if te:
        return block
    own_norms = config.layernorm_zero_centered_gamma or config.sequence_parallel
    layers = []
    for layer in block.layer_specs:
        layer = copy.deepcopy(layer)
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = SDPACoreAttention
        if own_norms:
            layer.submodules.input_layernorm = PortableNorm
            layer.submodules.pre_mlp_layernorm = PortableNorm
            if config.qk_layernorm:
                attention.q_layernorm = attention.k_layernorm = PortableNorm
        if config.multi_latent_attention:
            layer = _with_mla_attention(layer, config, own_norms)
        layers.append(layer)
    norm = PortableNorm if own_norms else block.layer_norm
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def hybrid_gdn_block_spec(device: torch.device, config: TransformerConfig, *,
                          use_te: bool = True, vp_stage: int | None = None,
                          pp_rank: int | None = None) -> TransformerBlockSubmodules:  # fmt: skip
    """The layers of this stage (or chunk) with Gated DeltaNet where --linear-attention-freq
    puts it (gated_delta_net.py): megatron-core's experimental block spec on CUDA with TE, else
    the portable layers (MoE ones where --moe-layer-freq puts them) with GDN swapped in."""
    te = use_te and device.type == "cuda" and transformer_engine_available()
    if te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage, pp_rank=pp_rank
        )
    own_norms = config.layernorm_zero_centered_gamma or config.sequence_parallel
    if config.num_moe_experts:
        block = moe_block_spec(device, config, use_te=False, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        layer = portable_layer_spec(config.normalization, config.qk_layernorm, own_norms)
        if config.multi_latent_attention:
            layer = with_mla(layer, _latent_norm(config, own_norms))
        layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        norm = PortableNorm if own_norms else _local_norm(config)
        block = TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)
    norm = PortableNorm if own_norms else None
    return gdn.hybrid_block_spec(block, config, norm, vp_stage=vp_stage, pp_rank=pp_rank)


def _with_mla_attention(layer, config: TransformerConfig, own_norms: bool):
    """A portable layer spec with MLA, its core attention DeepSeek's sparse one with
    `--experimental-attention-variant dsa` (dsa.py)."""
    layer = with_mla(layer, _latent_norm(config, own_norms))
    return with_sparse_attention(layer) if uses_sparse_attention(config) else layer


def _local_norm(config: TransformerConfig) -> type:
    """megatron-core's local norm (what a block of one layer spec gets as its final norm)."""
    return LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")


def _latent_norm(config: TransformerConfig, own_norms: bool) -> type | None:
    """MLA's latent norms with --qk-layernorm: the layer's own kind of norm."""
    if not config.qk_layernorm:
        return None
    return (
        PortableNorm
        if own_norms
        else LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")
    )


class HostRotaryEmbedding(RotaryEmbedding):
    """megatron-core's rotary embedding, without its move of the frequencies to CUDA at the
    first forward (a CPU run keeps them on the host), and with context parallelism the
    positions of this rank's two chunks (i and 2CP - 1 - i) picked on the host (megatron-core's
    `get_pos_emb_on_this_cp_rank` stages its index in pinned, CUDA-only memory)."""

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None
    ) -> torch.Tensor:
        emb = self.get_emb(max_seq_len, offset)
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is None or cp_group.size() == 1 or packed_seq:
            return emb
        cp, rank = cp_group.size(), cp_group.rank()
        chunks = emb.view(2 * cp, -1, *emb.shape[1:])  # [2cp, s / 2cp, 1, 1, dim]
        return chunks[[rank, 2 * cp - 1 - rank]].reshape(-1, *emb.shape[1:])

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [seq, dim / 2]
        if self.rotary_interleaved:  # each frequency twice in a row: f0 f0 f1 f1 ...
            emb = freqs.repeat_interleave(2, dim=-1)
        else:  # the frequencies, then the same again: f0 f1 ... f0 f1 ...
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


class GPTStageModel(GPTModel):
    """megatron-core's GPTModel; only the set-up of tied embeddings differs.

    With tied input/output embeddings over several stages, megatron-core gives the last stage a
    zeroed copy of the embedding and fills it by an all-reduce on a CUDA tensor. Our
    layout-independent initialization draws both copies from the same generator instead, so
    here only the attributes are set: `shared_embedding` on both copies (their gradients are
    summed over the embedding group every step, see training.py) and `shared` on the last
    stage's copy (counted once in the gradient norm). With multi-token prediction the last
    stage holds that copy, tied or not (mtp.py); tied, its output layer has no weight of its
    own, as megatron-core's checkpoint keys expect."""

    def setup_embeddings_and_output_layer(self) -> None:
        tied = self.share_embeddings_and_output_weights
        if self.mtp_process and tied and not self.pre_process:
            self.output_layer.weight = None  # the tied output layer uses the embedding copy
        if self.pre_process or self.mtp_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        holds_copy = self.pre_process or self.mtp_process or (self.post_process and tied)
        if not holds_copy or not (tied or self.config.mtp_num_layers):
            return
        weight = self.shared_embedding_or_output_weight()
        if self.config.pipeline_model_parallel_size == 1:
            weight.zero_out_wgrad = True
            return
        weight.shared_embedding = True
        if self.post_process and not self.pre_process:
            weight.shared = True

    def set_input_embedding(self, embedded: torch.Tensor) -> None:
        """The first stage with the input embedding split over the ranks: the next forward's
        word embeddings ([b, s, h], every rank's part summed by the runtime)."""
        self.embedding.word_embeddings.received = embedded

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's, except that with the vocabulary split over the ranks the last stage
        has no output layer of its own (its rows are `output_shard`'s entry)."""
        if not isinstance(getattr(self, "output_layer", None), HiddenStateOutput):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        self.post_process = False
        try:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self.post_process = True


class HiddenStateOutput(torch.nn.Module):
    """The last stage's output layer with the vocabulary split over the pipeline ranks
    (--enable-vocab-parallel): the hidden state passes through, and every rank's
    `VocabularyShardModule` scores it in its own VF pass. With sequence parallelism it is gathered
    first; every tensor-parallel rank then gets the whole hidden state's gradient (the shards'
    combination is the same on each), so the backward keeps this rank's part of it."""

    passes_hidden_state = True  # gpt_step.run_model: the stage's output is its hidden state

    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return hidden_states, None


OUTPUT_WEIGHT, EMBEDDING_WEIGHT = "output_layer.weight", "embedding.word_embeddings.weight"


class VocabularyShardModule(torch.nn.Module):
    """This pipeline rank's rows [start, end) of the output layer or of the input embedding
    (--enable-vocab-parallel; with tied embeddings one module is both). Its checkpoint entry
    is those rows of `whole_name` (the unsplit model's weight), so a checkpoint loads split or
    whole, on any pipeline size."""

    def __init__(self, start: int, end: int, vocab_size: int, hidden_size: int, shard: tuple,
                 whole_name: str = OUTPUT_WEIGHT):  # fmt: skip
        super().__init__()
        self.start, self.end, self.vocab_size = start, end, vocab_size
        self.shard_index, self.num_shards = shard
        self.whole_name = whole_name
        self.weight = torch.nn.Parameter(torch.empty(end - start, hidden_size))
        self.weight.vocab_rows = (start, end, vocab_size)  # drawn as those rows of the whole
        self.weight.whole_name = whole_name
        self.weight.is_embedding_or_output_parameter = True  # --decoupled-lr, Muon's AdamW part
        # distinct on every tensor-parallel rank: counted by each in the gradient norm
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim, self.weight.partition_stride = 0, 1

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing import ShardedTensor

        replica = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
        parent = prefix.rstrip(".").rpartition(".")[0]  # the model's prefix, without our name
        key = f"{parent}.{self.whole_name}" if parent else self.whole_name
        tensor = ShardedTensor.from_rank_offsets(
            key, self.weight, (0, self.shard_index, self.num_shards), replica_id=replica
        )
        return {f"{prefix}weight": tensor}

    def runtime_shard(self, tokens: int) -> OutputShard:
        """What the rank runtime runs the VF and VB passes with, for microbatches of `tokens`."""
        return OutputShard(self.weight, self.start, _tensor_parallel_group(), tokens)

    def runtime_input_shard(self, batch_shape: tuple[int, int]) -> InputShard:
        """What the rank runtime runs the EF and EB passes with, for [b, s] tokens."""
        return InputShard(self.weight, self.start, tuple(batch_shape), _tensor_parallel_group())


def _tensor_parallel_group():
    """The stage's tensor-parallel group, whose ranks hold the columns of shards (None: no
    tensor parallelism)."""
    from megatron.core import parallel_state

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    return parallel_state.get_tensor_model_parallel_group() if tensor_parallel else None


class ReceivedWordEmbeddings(torch.nn.Module):
    """The first stage's word embeddings with the input embedding split over the ranks: every
    rank's part of the microbatch, summed by the runtime (`GPTStageModel.set_input_embedding`),
    stands in for the lookup, as megatron-core's VocabParallelEmbedding returns it (with
    sequence parallelism scattered over the tensor-parallel ranks, [s/tp, b, h])."""

    def __init__(self, reduce_scatter: bool):
        super().__init__()
        self.reduce_scatter = reduce_scatter
        self.received: torch.Tensor | None = None

    def forward(self, input_ids):
        embedded, self.received = self.received, None
        if embedded is None:
            raise RuntimeError("the first stage ran before the runtime set its input embedding")
        if not self.reduce_scatter:
            return embedded
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(embedded.transpose(0, 1).contiguous())


@dataclass
class StageLayout:
    """Where this rank's model chunk sits in the whole model.

    Layers are split evenly over the stages unless `stage_layers` gives each stage's count:
    megatron-core's assignment for Megatron's layout flags (--decoder-first/last-pipeline-num-
    layers, --account-for-embedding/loss-in-pipeline-split, --pipeline-model-parallel-layout),
    which training/layout_flags.py's `layers_by_stage` computes.
    """

    pipeline_rank: int
    pipeline_size: int
    tensor_rank: int
    tensor_size: int
    num_layers: int
    stage_layers: tuple[int, ...] | None = None  # None: an even split
    # Virtual stages: this chunk's id on the rank, of `chunks`; its layers and its first global
    # layer, as megatron-core assigns them (`chunk_layout`).
    chunk: int = 0
    chunks: int = 1
    chunk_layers: int | None = None
    chunk_offset: int | None = None
    # MoE: this rank's expert-parallel rank of `expert_size`, each holding `local_experts`
    # experts, each sharded over `expert_tensor_size` ranks (megatron-core's expert groups).
    expert_rank: int = 0
    expert_size: int = 1
    local_experts: int = 0
    expert_tensor_rank: int = 0
    expert_tensor_size: int = 1

    def layers_on(self, stage: int) -> int:
        if self.stage_layers is not None:
            return self.stage_layers[stage]
        return self.num_layers // self.pipeline_size

    @property
    def layers_per_stage(self) -> int:
        """The layers of this model chunk (of the rank's stage, with one chunk per rank)."""
        if self.chunk_layers is not None:
            return self.chunk_layers
        return self.layers_on(self.pipeline_rank)

    @property
    def layer_offset(self) -> int:
        if self.chunk_offset is not None:
            return self.chunk_offset
        return sum(self.layers_on(stage) for stage in range(self.pipeline_rank))

    @property
    def is_first(self) -> bool:
        """Whether this chunk holds the embedding: the first chunk of the first rank."""
        return self.pipeline_rank == 0 and self.chunk == 0

    @property
    def is_last(self) -> bool:
        """Whether this chunk holds the output layer: the last chunk of the last rank."""
        return self.pipeline_rank == self.pipeline_size - 1 and self.chunk == self.chunks - 1


def chunk_layout(layout: StageLayout, config: TransformerConfig, chunk: int) -> StageLayout:
    """The layout of model chunk `chunk` of the rank (config.virtual_pipeline_model_parallel_size
    chunks): its layers and first layer from megatron-core's `get_num_layers_to_build` and
    `get_transformer_layer_offset` with `vp_stage`, the functions its GPTModel builds from."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    rank = layout.pipeline_rank
    return dataclasses.replace(
        layout,
        chunk=chunk,
        chunks=config.virtual_pipeline_model_parallel_size,
        chunk_layers=get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank),
        chunk_offset=get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank),
    )


def v_chunk_layout(layout: StageLayout, config: TransformerConfig, virtual_stage: int,
                   num_ranks: int) -> StageLayout:  # fmt: skip
    """The layout of the chunk that runs `virtual_stage` in a V placement, as megatron-core
    knows it: the interleaved placement's chunk of that virtual stage (vp_stage k // N on
    pipeline rank k % N), so its layers, offset and checkpoint keys are the same."""
    chunk, rank = divmod(virtual_stage, num_ranks)
    return chunk_layout(dataclasses.replace(layout, pipeline_rank=rank), config, chunk)


class ModelChunks(torch.nn.Module):
    """A rank's model chunks with virtual pipeline stages: chunk c is virtual stage c * N + r
    (megatron-core's GPTModel built with `vp_stage=c`). One module, so that whatever works on a
    stage's parameters (the optimizer, its step, the data-parallel reduction, the accounting)
    covers every chunk; the pipeline runtime runs the chunks themselves (`chunks[c]`).

    Its sharded state dict merges the chunks' with the state-dict keys of this module
    (``chunks.<c>.``) and megatron-core's global sharded keys, so a torch_dist checkpoint
    reshards between interleaved and plain layouts."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> torch.nn.Module:
        return self.chunks[index]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a rank's model chunks run one by one: call model[chunk]")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        merged = {}
        for index, chunk in enumerate(self.chunks):
            own = chunk.sharded_state_dict(prefix, sharded_offsets, metadata)
            merged.update({f"{prefix}chunks.{index}.{key[len(prefix):]}": v
                           for key, v in own.items()})  # fmt: skip
        return merged


class _PipelineRankView:
    """A pipeline process group that reports another rank: megatron-core's GPTModel takes its
    layer offset and count from (vp_stage, pipeline rank) in the interleaved placement, so a
    chunk placed otherwise (the V: chunk 1 of rank r is virtual stage 2N - 1 - r) is built as
    the interleaved (vp_stage, rank) of the same virtual stage. Everything else is the group's."""

    def __init__(self, group, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name):
        return getattr(self._group, name)


def groups_as_pipeline_rank(pipeline_rank: int):
    """megatron-core's process groups with the pipeline group reporting `pipeline_rank`."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.pp = _PipelineRankView(groups.pp, pipeline_rank)
    return groups


def _prepare_megatron_core(config: TransformerConfig) -> None:
    """What megatron-core needs before it builds this config's model on any device."""
    if config.multi_latent_attention or hasattr(config, "yarn_rotary_scaling_factor"):
        run_rotary_on_host()
    if config.multi_latent_attention and not transformer_engine_available():
        # megatron-core 0.16.1 counts Transformer Engine as present once its extension module
        # imports, which it does without TE too (TELinear a mock): isinstance(x, mock) raises
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
    if config.recompute_granularity is not None:
        use_host_rng_states()  # megatron-core's checkpoint reads the CUDA generator otherwise
    if config.num_moe_experts:
        from megatron.model.moe import patch_megatron_core_moe

        patch_megatron_core_moe()
    if gdn.uses_gated_delta_net(config):
        _prepare_gated_delta_net()
    if uses_sparse_attention(config):
        prepare_sparse_attention()
    if config.mtp_num_layers and not torch.cuda.is_available():
        _torch_on_host(("megatron.core.transformer.multi_token_prediction",))  # its loss tracker


def _prepare_gated_delta_net() -> None:
    """Our portable kernels where `fla` is missing; without CUDA, the GDN layer's parameters on
    the host (megatron-core allocates them on CUDA's current device), its gate functions
    eager, and a host RNG tracker for its `reset_parameters` where a run has not set one up
    (its draws are overwritten by the layout-independent initialization)."""
    gdn.use_portable_kernels_without_fla()
    if torch.cuda.is_available():
        return
    _torch_on_host((gdn.GDN_MODULE,))
    gdn.run_gate_functions_eagerly()
    if (
        _MODEL_PARALLEL_RNG_TRACKER_NAME
        not in tensor_parallel_random.get_cuda_rng_tracker().get_states()
    ):
        from megatron.core import parallel_state

        tensor_rank = 0
        if parallel_state.model_parallel_is_initialized():
            tensor_rank = parallel_state.get_tensor_model_parallel_rank()
        run_sequence_parallel_on_host(1234, tensor_rank)  # megatron-core's default seed


def _finish_megatron_core_model(model: GPTModel, layout: StageLayout, device: torch.device) -> None:
    """megatron-core's assignment of layers to the stage and ours must agree; off CUDA the
    RoPE embedding is the host one (YaRN's stays on the host by `run_rotary_on_host`); the
    fused projections whose tensor-parallel shards hold a part of each block are marked."""
    if device.type != "cuda" and type(getattr(model, "rotary_pos_emb", None)) is RotaryEmbedding:
        model.rotary_pos_emb.__class__ = HostRotaryEmbedding
    built = len(model.decoder.layers)
    if built != layout.layers_per_stage:
        raise RuntimeError(
            f"stage {layout.pipeline_rank} chunk {layout.chunk}: megatron-core built {built} "
            f"layers, the layout says {layout.layers_per_stage}"
        )
    gdn.mark_gated_delta_net_parameters(model)  # their tensor-parallel blocks, before the init
    _mark_gated_linear_units(model)


def build_gpt_stage(
    config: TransformerConfig,
    layout: StageLayout,
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str,
    device: torch.device,
    seed: int,
    share_embeddings_and_output_weights: bool = False,
    rotary_percent: float = 1.0,
    rotary_base: int = 10000,
    use_transformer_engine: bool = True,
    rope_scaling: bool = False,
    rope_scaling_factor: float = 8.0,
    seq_len_interpolation_factor: float | None = None,
    xavier_uniform: bool = False,
    built_as_other_rank: bool = False,
    vocab_parallel: bool = False,
    split_input: bool = False,
) -> GPTModel:
    """This rank's GPT stage (with virtual stages one of its chunks, `chunk_layout`) on
    `device`, initialized independently of the layout. RoPE variants: megatron-core's;
    `built_as_other_rank`: built as the interleaved chunk of the same virtual stage
    (`v_chunk_layout`); `vocab_parallel`, `split_input`: `_split_vocabulary`."""
    vp_stage = layout.chunk if layout.chunks > 1 else None
    _prepare_megatron_core(config)
    # a V chunk is built as the interleaved (vp_stage, rank) of its virtual stage
    groups, pp_rank = None, None
    if built_as_other_rank:
        groups, pp_rank = groups_as_pipeline_rank(layout.pipeline_rank), layout.pipeline_rank
    spec = layer_spec_for(
        device, config, use_te=use_transformer_engine, vp_stage=vp_stage, pp_rank=pp_rank
    )
    tied = share_embeddings_and_output_weights
    model = GPTStageModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=_mtp_spec(config, spec, layout, device, use_transformer_engine),
        pg_collection=groups,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=layout.is_first,
        post_process=layout.is_last,
        share_embeddings_and_output_weights=tied and not vocab_parallel,  # split: shards tie
        position_embedding_type=position_embedding_type,
        rotary_percent=rotary_percent,
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        seq_len_interpolation_factor=seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )
    _finish_megatron_core_model(model, layout, device)
    if vocab_parallel:
        _split_vocabulary(model, layout, vocab_size, config, split_input=split_input, tied=tied)
    _initialize(model, layout, config, seed=seed, xavier_uniform=xavier_uniform)
    _mark_expert_parameters(model)
    return model.to(device)


def _initialize(model: GPTModel, layout: StageLayout, config: TransformerConfig, *, seed: int,
                xavier_uniform: bool) -> None:  # fmt: skip
    """The layout-independent initialization (with muP's stds), then muP's factors."""
    initialize_layout_independent(model, layout, seed=seed, init_method_std=config.init_method_std,
                                  xavier_uniform=xavier_uniform,
                                  mup_width_mult=getattr(config, "mup_width_mult", None))  # fmt: skip
    mup.apply_multipliers(model, getattr(config, "mup", None))


def _mtp_spec(config: TransformerConfig, decoder_spec, layout: StageLayout, device: torch.device,
              use_te: bool):  # fmt: skip
    """The MTP block spec of the last stage (--mtp-num-layers), None elsewhere: its layers
    around the decoder's last layer, with the decoder's kind of norms."""
    if not config.mtp_num_layers or not layout.is_last:
        return None
    te = use_te and device.type == "cuda" and transformer_engine_available()
    own_norms = config.layernorm_zero_centered_gamma or config.sequence_parallel
    norm = PortableNorm if own_norms and not te else None
    if getattr(decoder_spec, "layer_specs", None) == []:  # an MTP-only stage ("...|mL")
        last = max(s for s in range(layout.pipeline_size) if layout.layers_on(s))
        decoder_spec = layer_spec_for(device, config, use_te=use_te, pp_rank=last)
    return mtp_block_spec(decoder_spec, config.mtp_num_layers, norm=norm, use_te=te)


def _mark_gated_linear_units(model: torch.nn.Module) -> None:
    """--swiglu: each tensor-parallel rank's first MLP projection is its part of the gate
    rows followed by its part of the up rows (megatron-core halves it locally), so the
    layout-independent initialization splits each half of the whole matrix over the ranks."""
    from megatron.core.transformer.mlp import MLP

    for module in model.modules():
        if isinstance(module, MLP) and module.config.gated_linear_unit:
            for param in module.linear_fc1.parameters():
                param.tensor_parallel_blocks = 2  # two equal blocks: gate, up


def _mark_expert_parameters(model: torch.nn.Module) -> None:
    """Routed experts: gradients reduced over the expert-data-parallel group (optimizer/)."""
    for name, param in model.named_parameters():
        param.moe_expert = is_expert_parameter(name)


def _split_vocabulary(model: GPTModel, layout: StageLayout, vocab_size: int, config, *,
                      split_input: bool, tied: bool):  # fmt: skip
    """--enable-vocab-parallel: no output layer on the last stage, a shard on every rank of
    every stage: shard p * TP + t on pipeline rank p, tensor rank t. With `split_input` the
    same rows of the input embedding too (`input_shard`; with `tied` embeddings the output
    shard itself), and the first stage takes its input from the runtime. With virtual stages
    the rank's first chunk holds its rows (one shard per rank)."""
    if layout.is_last:
        model.output_layer = HiddenStateOutput(config.sequence_parallel)
    if layout.is_first and split_input:
        embedding = model.embedding
        embedding.word_embeddings = ReceivedWordEmbeddings(embedding.reduce_scatter_embeddings)
    if layout.chunk != 0:  # with virtual stages the rank's first chunk holds its rows
        return
    shards = layout.pipeline_size * layout.tensor_size
    index = layout.pipeline_rank * layout.tensor_size + layout.tensor_rank
    rows, hidden = vocab_size // shards, config.hidden_size
    start, end = index * rows, (index + 1) * rows
    model.output_shard = VocabularyShardModule(start, end, vocab_size, hidden, (index, shards),
                                               EMBEDDING_WEIGHT if tied else OUTPUT_WEIGHT)  # fmt: skip
    if split_input and not tied:
        model.input_shard = VocabularyShardModule(start, end, vocab_size, hidden,
                                                  (index, shards), EMBEDDING_WEIGHT)  # fmt: skip


_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight (megatron-core's SequentialMLP), not a shared expert's."""
    return _LOCAL_EXPERT.search(name) is not None


def global_parameter_name(name: str, layout: StageLayout, *, tied: bool = False) -> str:
    """`decoder.layers.<local>.x` -> `decoder.layers.<global>.x`, and a routed expert's
    `local_experts.<local>` -> `local_experts.<global expert index>`; a tied output layer is
    the input embedding (both copies are drawn alike); other names unchanged (the MTP layers'
    `mtp.layers.<k>` are on the last stage whatever the layout)."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    match = _LOCAL_LAYER.match(name)
    if match is not None:
        global_index = int(match.group(1)) + layout.layer_offset
        name = f"decoder.layers.{global_index}." + name[match.end() :]
    expert = _LOCAL_EXPERT.search(name)
    if expert is not None:
        index = layout.expert_rank * layout.local_experts + int(expert.group(1))
        name = f"{name[:expert.start()]}.mlp.experts.local_experts.{index}.{name[expert.end():]}"
    return name


def _init_kind(name: str, param: torch.nn.Parameter) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if getattr(param, "zero_centered", False):
        return "zeros"
    gdn_kind = gdn.gdn_init_kind(name)
    if gdn_kind is not None:
        return gdn_kind
    if "norm" in name and leaf in ("weight", "layer_norm_weight"):
        return "ones"
    if leaf.endswith("bias"):
        return "zeros"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "scaled_normal"  # residual-branch outputs, GPT-2 style
    return "normal"


@torch.no_grad()
def initialize_layout_independent(
    model: torch.nn.Module,
    layout: StageLayout,
    *,
    seed: int,
    init_method_std: float,
    xavier_uniform: bool = False,
    mup_width_mult: float | None = None,
) -> None:
    """Megatron's init scheme (normal(std), std/sqrt(2L) on residual outputs, ones/zeros for
    norms and biases), drawn per parameter from its global name so it is layout-independent.
    `xavier_uniform`: every weight matrix Xavier-uniform over its full (unsharded) shape, as
    Megatron's init and scaled-init methods are then. `mup_width_mult` (--use-mup): muP's
    width-scaled stds (mup.init_std)."""
    scaled_std = init_method_std / math.sqrt(2.0 * layout.num_layers)
    for name, param in model.named_parameters():
        kind = _init_kind(name, param)
        if kind == "ones":
            param.fill_(1.0)
            continue
        if kind == "zeros":
            param.zero_()
            continue
        full_shape = list(param.shape)
        partition_dim = getattr(param, "partition_dim", -1)
        rows = getattr(param, "vocab_rows", None)  # a shard of the output layer's rows
        sharded = getattr(param, "tensor_model_parallel", False) and partition_dim >= 0
        sharded = sharded and rows is None
        shards, shard = layout.tensor_size, layout.tensor_rank
        if is_expert_parameter(name):  # sharded over the expert tensor-parallel ranks
            shards, shard = layout.expert_tensor_size, layout.expert_tensor_rank
        if sharded:
            full_shape[partition_dim] *= shards
        if rows is not None:
            full_shape[0] = rows[2]
        global_name = getattr(param, "whole_name", None) or global_parameter_name(
            name, layout, tied=getattr(param, "shared", False)
        )
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{global_name}".encode()))
        std = scaled_std if kind == "scaled_normal" else init_method_std
        if mup_width_mult is not None:
            std = mup.init_std(kind, global_name, init_method_std, layout.num_layers,
                               mup_width_mult)  # fmt: skip
        full = torch.empty(full_shape, dtype=torch.float32)
        if kind.startswith("gdn_"):
            gdn.draw_gdn(kind, full, generator)
        elif xavier_uniform and full.dim() >= 2:
            torch.nn.init.xavier_uniform_(full, generator=generator)
        else:
            full.normal_(0.0, std, generator=generator)
        blocks = getattr(param, "tensor_parallel_blocks", None)  # GDN: each block split
        if sharded and blocks is not None:
            full = gdn.tensor_parallel_slice(full, blocks, shards, shard)
        elif sharded:
            full = full.chunk(shards, dim=partition_dim)[shard]
        if rows is not None:
            full = full[rows[0] : rows[1]]
        param.copy_(full)
