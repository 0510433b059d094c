"""Build this rank's GPT stage from the run's configuration, and shard it.

The two functions the training loop calls are `build_stage_model` (the rank's stage, or its
chunks with virtual stages or the V placement) and `shard_stage_model` (FSDP, when asked for).
`transformer_config` gives megatron-core's `TransformerConfig` of a run; `build_chunk` is the
one builder of a chunk, shared by the ranks and the single-process engine. They take the run's
`RunConfig` duck-typed (`config.model`, `.moe`, `.parallel`, `.pipeline`, `.training`), so
the model package imports nothing of the training loop.
"""

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.distributed import fsdp
from megatron.model import mup
from megatron.model.dsa import dsa_config_fields
from megatron.model.emulated_stage import EmulatedStage
from megatron.model.gated_delta_net import gated_delta_net_config_fields
from megatron.model.gpt import (
    ModelChunks,
    StageLayout,
    build_gpt_stage,
    chunk_layout,
    v_chunk_layout,
)
from megatron.model.mla import mla_config_fields, yarn_config_attributes
from megatron.model.moe import moe_config_fields
from megatron.model.mtp import mtp_config_fields
from megatron.model.recompute import recompute_config_fields
from megatron.pipeline.deferred_wgrad import defer_output_layer_weight_gradient


def model_switches(model) -> dict:
    """The TransformerConfig fields that Megatron's model switches set (`model`: the run's
    `ModelConfig`)."""
    get = vars(model)
    activation = torch.nn.functional.gelu
    if get["swiglu"]:
        activation = torch.nn.functional.silu
    elif get["squared_relu"]:
        from megatron.core.activations import squared_relu

        activation = squared_relu
    elif get["openai_gelu"]:
        from megatron.core.transformer.utils import openai_gelu

        activation = openai_gelu
    return dict(
        normalization=get["normalization"],
        layernorm_epsilon=get["norm_epsilon"],
        layernorm_zero_centered_gamma=get["apply_layernorm_1p"],
        add_bias_linear=not get["disable_bias_linear"],
        add_qkv_bias=get["add_qkv_bias"],
        gated_linear_unit=get["swiglu"],
        activation_func=activation,
        num_query_groups=get["num_query_groups"],
        kv_channels=get["kv_channels"],
        qk_layernorm=get["qk_layernorm"],
        attention_softmax_in_fp32=get["attention_softmax_in_fp32"],
        apply_query_key_layer_scaling=get["apply_query_key_layer_scaling"],
        apply_residual_connection_post_layernorm=get["apply_residual_connection_post_layernorm"],
        rotary_interleaved=get["rotary_interleaved"],
        cross_entropy_loss_fusion=get["cross_entropy_loss_fusion"],
        cross_entropy_fusion_impl=get["cross_entropy_fusion_impl"],
        test_mode=get["test_mode"],
    )


def transformer_config(config, device: torch.device) -> TransformerConfig:
    """megatron-core's TransformerConfig of the run (`RunConfig`)."""
    model, layout = config.model, config.parallel
    dtype, chunks = model.dtype, layout.chunks_per_rank
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    built = config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        init_method_std=model.init_method_std,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        **model_switches(config.model),
        **recompute_config_fields(config.model),
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=layout.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=layout.pipeline_model_parallel_layout,
        virtual_pipeline_model_parallel_size=None if chunks == 1 else chunks,
        microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_virtual_pipeline_stage,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        use_cpu_initialization=True,  # draws on CPU; our layout-independent init overwrites it
        perform_initialization=True,  # (it also tags tensor-parallel attributes on weights)
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=model.calculate_per_token_loss,
        sequence_parallel=layout.sequence_parallel,
        softmax_scale=mup.softmax_scale(model),
        **mla_config_fields(model),
        **mtp_config_fields(model),
        **gated_delta_net_config_fields(model),
        **dsa_config_fields(model),
        **moe_config_fields(config.moe, config.parallel,
                            grouped_gemm_available=_grouped_gemm_available(device)),  # fmt: skip
    )
    attributes = {**yarn_config_attributes(model), **mup.config_attributes(model)}
    for name, value in attributes.items():  # read off the config, as Megatron
        setattr(built, name, value)
    built.cp_comm_types = layout.cp_comm_type  # SDPACoreAttention's, one per layer or one
    return built


def _grouped_gemm_available(device: torch.device) -> bool:
    """Whether --moe-grouped-gemm (and the fused permutation and router) may take effect:
    not yet anywhere. The experts are a SequentialMLP (same math, same checkpoint keys;
    docs/moe.md): the grouped experts' parameters (TEGroupedMLP: `weight<i>`) are not yet
    keyed by global expert index for the initialization and the expert-gradient groups,
    and no GPU check covers them."""
    return False


def stage_layout(config) -> StageLayout:
    experts = config.moe.num_experts if config.moe is not None else 0
    moe = experts > 0
    return StageLayout(
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pipeline_size=config.parallel.pipeline_model_parallel_size,
        tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
        tensor_size=config.parallel.tensor_model_parallel_size,
        num_layers=config.model.num_layers,
        stage_layers=tuple(config.parallel.stage_layers),
        expert_rank=parallel_state.get_expert_model_parallel_rank() if moe else 0,
        expert_size=config.parallel.expert_model_parallel_size if moe else 1,
        local_experts=experts // config.parallel.expert_model_parallel_size if moe else 0,
        expert_tensor_rank=parallel_state.get_expert_tensor_parallel_rank() if moe else 0,
        expert_tensor_size=config.parallel.expert_tensor_parallel_size if moe else 1,
    )


def build_stage_model(config, device: torch.device) -> torch.nn.Module:
    """This rank's model: its stage, or with several chunks per rank (virtual stages, or the V
    placement of ZB-V and DualPipeV) its chunks as one `ModelChunks`."""
    placement = config.pipeline.plan.placement
    rank = parallel_state.get_pipeline_model_parallel_rank()
    stages = None if placement is None else placement.stages_of(rank)
    pipeline, chunks_per_rank = config.pipeline, config.parallel.chunks_per_rank
    if pipeline.emulated:
        chunks = [
            EmulatedStage(
                pipeline.emulated_forward_ms, pipeline.emulated_backward_ms,
                config.model.hidden_size, noise_cv=pipeline.emulated_noise_cv,
                seed=config.training.seed, weight_grad_ms=pipeline.emulated_weight_grad_ms,
                virtual_stage=rank if stages is None else stages[c],
                num_virtual_stages=config.parallel.pipeline_model_parallel_size * chunks_per_rank,
                param_count=pipeline.emulated_param_count,
            )
            for c in range(chunks_per_rank)
        ]  # fmt: skip
        if pipeline.enable_vocab_parallel:  # the rank's rows on its first chunk
            rows = config.model.padded_vocab_size // config.parallel.pipeline_model_parallel_size
            chunks[0].split_vocabulary(rank * rows, rows, pipeline.emulated_vocab_forward_ms,
                                       pipeline.emulated_vocab_backward_ms)  # fmt: skip
            for chunk in chunks[1:]:
                chunk.splits_vocabulary = True
        return chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
    transformer = transformer_config(config, device)
    layout = stage_layout(config)
    if placement is None:
        return build_chunk(config, transformer, layout, device)
    if placement.shape == "v":  # each chunk built as the interleaved chunk of its stage
        n = placement.num_ranks
        layouts = [v_chunk_layout(layout, transformer, stage, n) for stage in stages]
        built = [build_chunk(config, transformer, chunk, device, built_as_other_rank=True)
                 for chunk in layouts]  # fmt: skip
        return ModelChunks(built)
    with virtual_stages_known(config.parallel.chunks_per_rank):
        chunks = [
            build_chunk(config, transformer, chunk_layout(layout, transformer, c), device)
            for c in range(config.parallel.chunks_per_rank)
        ]
    return ModelChunks(chunks)


@contextlib.contextmanager
def virtual_stages_known(chunks: int):
    """megatron-core's layout (`--pipeline-model-parallel-layout`) reads a chunk's layers and
    offset for its `vp_stage` only where its process-wide virtual pipeline size is set (else it
    takes chunk 0's): set while the chunks are built, as Megatron's own set-up would."""
    previous = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(previous)


def build_chunk(config, transformer: TransformerConfig, layout, device: torch.device,
                built_as_other_rank: bool = False) -> torch.nn.Module:  # fmt: skip
    """One model chunk of `layout` from the run's `config`: the one builder of a stage, for the
    ranks and for the single-process engine alike."""
    model = build_gpt_stage(
        transformer,
        layout,
        vocab_size=config.model.padded_vocab_size,
        max_sequence_length=config.model.max_position_embeddings,
        position_embedding_type=config.model.position_embedding_type,
        device=device,
        seed=config.training.seed,
        share_embeddings_and_output_weights=not config.model.untie_embeddings_and_output_weights,
        rotary_percent=config.model.rotary_percent,
        rotary_base=config.model.rotary_base,
        use_transformer_engine=config.model.transformer_impl == "transformer_engine",
        rope_scaling=config.model.use_rope_scaling,
        rope_scaling_factor=config.model.rope_scaling_factor,
        seq_len_interpolation_factor=config.model.rotary_seq_len_interpolation_factor,
        xavier_uniform=config.model.init_method_xavier_uniform,
        built_as_other_rank=built_as_other_rank,
        vocab_parallel=config.pipeline.enable_vocab_parallel,
        split_input=config.pipeline.plan.schedule.embedding_passes,
    )
    if config.pipeline.defer_embedding_wgrad_compute:
        defer_output_layer_weight_gradient(model, config.pipeline.wgrad_deferral_limit)
    if not config.pipeline.plan.flushes:
        for param in model.parameters():  # the last stage's copy of a tied embedding
            param.follows_first_stage = getattr(param, "shared", False)
    # As Megatron's Float16Module: every parameter (norms too) in the model's dtype.
    return model.to(config.model.dtype)


def shard_stage_model(config, model: torch.nn.Module) -> torch.nn.Module:
    """--use-torch-fsdp2 / --use-megatron-fsdp: the stage's weights sharded over its data x
    context parallel ranks (fsdp.py), the routed experts' over their expert-data-parallel
    ranks; without them, the model as it is."""
    if not config.parallel.fully_sharded:
        return model
    experts = None if config.moe is None else parallel_state.get_expert_data_parallel_group()
    return fsdp.shard_model(
        model,
        group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        expert_group=experts,
        compute_dtype=config.model.dtype,
        reshard_after_forward=config.parallel.reshard_after_forward,
        prefetch=config.parallel.fsdp_prefetch,
    )
