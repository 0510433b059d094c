"""One typed configuration of a run, built once from the validated flags and frozen.

`RunConfig.from_args(args, vocab_size=...)` is called once by `pretrain` (and by the
single-process engine); from there the loop, the model builder, the runtime, checkpointing,
logging and the studies read typed sections instead of the parsed namespace:

    config.model       the GPT model (shape, embeddings, switches, recompute, dtype)
    config.moe         the experts and router (None for a dense model)
    config.parallel    the process layout and the layer split over the pipeline ranks
    config.pipeline    the resolved PipelinePlan and the schedule's own options
    config.training    the batch and the run's length, evaluation, stopping, health checks
    config.data        the data source, its sample options and the tokenizer
    config.checkpoint  --save/--load and what a checkpoint holds
    config.logging     the iteration line, TensorBoard, W&B, summary.json, timelines
    config.optimizer   OptimizerConfig      config.lr   LRScheduleConfig

Each section's fields are Megatron's flag names without the dashes, so `--hidden-size` is
`config.model.hidden_size`. The argparse namespace stays at the edges: parsing, validation
(training/arguments.py), and Megatron's `get_args()` for users' `forward_step` functions.
"""

import dataclasses
from dataclasses import dataclass, field, fields

import torch

from megatron.common.errors import UserError
from megatron.pipeline.plan import PipelinePlan, resolve_plan
from megatron.training.optimizer.config import LRScheduleConfig, OptimizerConfig


class _Section:
    @classmethod
    def from_flags(cls, args, **derived):
        """The section from the flags of the same names, and `derived` values; a flag a
        namespace lacks (one built by a tool, not our parser) keeps the section's default."""
        values = {
            spec.name: getattr(args, spec.name)
            for spec in fields(cls)
            if spec.init and spec.name not in derived and hasattr(args, spec.name)
        }
        return cls(**values, **derived)


@dataclass(frozen=True)
class ModelConfig(_Section):
    num_layers: int = 1
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 1
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int = 128
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rotary_interleaved: bool = False
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rotary_seq_len_interpolation_factor: float | None = None
    init_method_std: float = 0.02
    init_method_xavier_uniform: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: int | None = None  # the tokenizer's, padded (`RunConfig.from_args`)
    transformer_impl: str = "local"
    bf16: bool = False
    fp16: bool = False
    calculate_per_token_loss: bool = False
    # Megatron's model switches (TransformerConfig fields: model/build.py model_switches)
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    swiglu: bool = False
    squared_relu: bool = False
    openai_gelu: bool = False
    qk_layernorm: bool = False
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False
    apply_residual_connection_post_layernorm: bool = False
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    test_mode: bool = False
    # multi-latent attention (mla.py; Megatron's defaults)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str | None = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Gated DeltaNet hybrid attention and the attention output gate (gated_delta_net.py)
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | tuple | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    attention_output_gate: bool = False
    # DeepSeek sparse attention (dsa.py)
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    dsa_indexer_loss_coeff: float | None = None
    dsa_indexer_use_sparse_loss: bool = False
    # multi-token prediction (mtp.py; Megatron's defaults)
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    # --position-embedding-type yarn (mla.py)
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    yarn_correction_range_round_to_int: bool | None = None
    # muP (mup.py; Megatron's defaults)
    use_mup: bool = False
    mup_base_hidden_size: int | None = None
    mup_base_head_dim: float | None = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_attn_scale_power: float = 1.0
    # activation recomputation (recompute.py)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the parameters and activations: --bf16, --fp16 or fp32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights


@dataclass(frozen=True)
class MoEConfig(_Section):
    """The routed experts (Megatron's --num-experts and --moe-* flags)."""

    num_experts: int = 0
    moe_layer_freq: object = 1
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_topk: int = 2
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: str | None = None
    moe_router_force_load_balancing: bool = False
    moe_router_fusion: bool = False
    moe_aux_loss_coeff: object = 0.0
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_apply_probs_on_input: bool = False
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False


@dataclass(frozen=True)
class ParallelConfig(_Section):
    """The process layout (tensor x context x expert x pipeline x data) and the layer split."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    cp_comm_type: tuple = ("p2p",)  # one type for every layer, or one per layer
    hierarchical_context_parallel_sizes: tuple | None = None  # a2a+p2p: (inner, outer)
    data_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    use_tp_pp_dp_mapping: bool = False
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_virtual_pipeline_stage: int | None = None
    stage_layers: tuple = ()  # layers per pipeline rank (validation resolves the split)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: object = None
    distributed_backend: str | None = None
    distributed_timeout_minutes: int = 10
    rendezvous_timeout_seconds: float | None = None
    disable_gloo_process_groups: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    # --use-torch-fsdp2 / --use-megatron-fsdp (fsdp_flags.py): "torch_fsdp2", "megatron_fsdp"
    fully_sharded: str | None = None
    reshard_after_forward: bool = True  # the gathered weights freed after each forward
    fsdp_prefetch: bool = True  # each layer starts its neighbour's all-gather (fsdp.py)
    ddp_average_in_collective: bool = False
    # the data-parallel reduction in buckets (distributed/data_parallel.py)
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = None
    ddp_num_buckets: int | None = None
    deterministic_mode: bool = False
    cpu_mmap_threshold_kib: int = 128

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks per rank: Megatron's virtual_pipeline_model_parallel_size (1 without)."""
        return self.virtual_pipeline_model_parallel_size or 1


def _context_parallel_fields(args) -> dict:
    """--cp-comm-type and --hierarchical-context-parallel-sizes as tuples (a namespace built
    by a tool may lack them)."""
    comm_type = getattr(args, "cp_comm_type", None) or ["p2p"]
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    return dict(cp_comm_type=tuple(comm_type), hierarchical_context_parallel_sizes=(
        tuple(int(size) for size in sizes) if sizes else None))  # fmt: skip


@dataclass(frozen=True)
class PipelineConfig(_Section):
    """The schedule, resolved once, and the options that shape its runs."""

    plan: PipelinePlan = None
    enable_vocab_parallel: bool = False  # the plan's schedule places the output shards' passes
    # children per rank of the output layer's message tree (`VocabLinks.tree_arity`)
    vocab_parallel_tree_arity: int = 2
    # the last stage's output-layer weight gradient at the drain (pipeline/deferred_wgrad.py)
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0  # most microbatches deferred between drains; 0: all
    paci_arrival_rule: str | None = None
    paci_inflight_limit: str | None = None
    paci_stage_lr_scale: float | None = None
    # the update lands before the D-th backward after its step (None: at the step)
    paci_deferred_step: int | None = None
    # [(a, iterations), ...] (validated by batch_schedule.validate_accumulation_schedule)
    paci_accumulation_schedule: tuple = ()
    async_sync_warmup_iters: int = 0
    async_sync_cooldown_iters: int = 0
    # emulated compute instead of the model (model/emulated_stage.py)
    emulated_forward_ms: object = None
    emulated_backward_ms: object = None
    emulated_weight_grad_ms: object = None
    emulated_noise_cv: object = 0.0
    emulated_vocab_forward_ms: object = 0.0
    emulated_vocab_backward_ms: object = 0.0
    emulated_param_count: int | None = None  # parameters per emulated stage (chunk)
    # each rank's sends paced as on a link of this many GB/s (pipeline/p2p.py's PacedLink)
    emulated_link_gbs: float | None = None
    emulated_link_latency_us: float = 0.0
    emulated_link_unpaced_embedding: bool = False

    @property
    def emulated(self) -> bool:
        return self.emulated_forward_ms is not None


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """The batch, the run's length, evaluation, stopping rules and health checks."""

    micro_batch_size: int = 1
    global_batch_size: int = 1
    num_microbatches: int = 1
    rampup_batch_size: tuple | None = None
    # ((first sample, batch), ...) (validated by batch_schedule.validate_step_schedule)
    step_batch_size_schedule: tuple | None = None
    train_iters: int = 0
    train_samples: int | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    eval_global_batch_size: int | None = None  # None: global_batch_size (Megatron's default)
    eval_micro_batch_size: int | None = None  # None: micro_batch_size
    eval_num_microbatches: int | None = None  # per evaluation iteration; None: num_microbatches
    skip_train: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    seed: int = 1234
    clip_grad: float = 1.0
    max_consecutive_skips: int | None = None
    check_weight_hash_across_dp_replicas_interval: int | None = None
    enable_experimental: bool = False
    # result validation (rerun.py)
    rerun_mode: str = "disabled"
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    check_for_large_grads: bool = False
    result_rejected_tracker_filename: str | None = None

    @property
    def eval_batch(self) -> tuple[int, int, int]:
        """Evaluation's (global batch, micro-batch, microbatches per iteration)."""
        return (
            self.eval_global_batch_size or self.global_batch_size,
            self.eval_micro_batch_size or self.micro_batch_size,
            self.eval_num_microbatches or self.num_microbatches,
        )


@dataclass(frozen=True)
class DataConfig(_Section):
    mock_data: bool = False
    source: object = None  # sources.DataSource, read once (None with --mock-data)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    dataloader_type: str = "single"  # or "cyclic" (data/cyclic_order.py)
    data_sharding: bool = True  # --no-data-sharding: cyclic's one permutation for all ranks
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    tokenizer_type: str = "GPT2BPETokenizer"
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str | None = None  # TikTokenizer (tokenizer/tiktoken_tokenizer.py)
    tiktoken_num_special_tokens: int = 1000
    special_tokens: tuple | None = None
    # --fim-*: fill-in-the-middle samples (data/fim.py, FimSettings.of_run)
    fim_data: bool = False
    fim_rate: float = 0.5
    fim_spm_rate: float = 0.5
    fim_split_sample: str | None = None
    fim_fragment_rate: float | None = None
    fim_no_prefix: str | None = None
    fim_prefix_token: str = "<fim_prefix>"
    fim_middle_token: str = "<fim_middle>"
    fim_suffix_token: str = "<fim_suffix>"
    fim_pad_token: str = "<fim_pad>"
    fim_eod_token: str = "<|endoftext|>"


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    save: str | None = None
    save_interval: int | None = None
    save_retain_interval: int | None = None
    load: str | None = None
    ckpt_format: str = "torch"
    ckpt_step: int | None = None
    auto_detect_ckpt_format: bool = True
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    load_fallback: bool = False
    verify_integrity: bool = False
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False
    run_id: str | None = None  # this run's, once rank 0 holds --save (writer_lock.py)


@dataclass(frozen=True)
class LoggingConfig(_Section):
    log_interval: int = 100
    logging_level: int | None = None  # --logging-level: the root logger's level
    log_throughput: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    tensorboard_dir: str | None = None
    metrics_dir: str | None = None
    timeline_file: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_entity: str | None = None
    wandb_save_dir: str | None = None
    # every flag, plainly typed, for the W&B run's config page (tracking/wandb_run.py)
    flags: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    moe: MoEConfig | None
    parallel: ParallelConfig
    pipeline: PipelineConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    optimizer: OptimizerConfig
    lr: LRScheduleConfig

    @classmethod
    def from_args(cls, args, *, vocab_size: int | None = None) -> "RunConfig":
        """The run's configuration from flags `validate_args` has checked. `vocab_size` (the
        tokenizer's, also later by `with_vocabulary`) sets `model.padded_vocab_size`."""
        from megatron.training.data.sources import data_source
        from megatron.training.tracking.wandb_run import plain_flags

        mock = getattr(args, "mock_data", False)
        accumulation = getattr(args, "paci_accumulation_schedule", None) or ()
        config = cls(
            model=ModelConfig.from_flags(
                args,
                recompute_modules=_tuple(getattr(args, "recompute_modules", None)),
                linear_attention_freq=_int_or_tuple(getattr(args, "linear_attention_freq", None)),
            ),
            moe=MoEConfig.from_flags(args) if getattr(args, "num_experts", None) else None,
            parallel=ParallelConfig.from_flags(
                args, stage_layers=tuple(args.stage_layers), **_context_parallel_fields(args)
            ),
            pipeline=PipelineConfig.from_flags(
                args, plan=pipeline_plan(args), paci_accumulation_schedule=tuple(accumulation)
            ),
            training=TrainingConfig.from_flags(
                args,
                rampup_batch_size=_tuple(getattr(args, "rampup_batch_size", None)),
                step_batch_size_schedule=_pairs(getattr(args, "step_batch_size_schedule", None)),
            ),
            data=DataConfig.from_flags(
                args,
                source=None if mock else data_source(args),
                special_tokens=_tuple(getattr(args, "special_tokens", None)),
                dataloader_type=getattr(args, "dataloader_type", None) or "single",
            ),
            checkpoint=CheckpointConfig.from_flags(args),
            logging=LoggingConfig.from_flags(args, flags=plain_flags(args)),
            optimizer=OptimizerConfig.from_args(args),
            lr=LRScheduleConfig.from_args(args),
        )
        return config if vocab_size is None else config.with_vocabulary(vocab_size)

    def with_vocabulary(self, vocab_size: int) -> "RunConfig":
        """The configuration once the tokenizer is known: Megatron pads the vocabulary to a
        multiple of --make-vocab-size-divisible-by x the tensor-parallel size."""
        divisible_by = self.model.make_vocab_size_divisible_by
        multiple = divisible_by * self.parallel.tensor_model_parallel_size
        padded = -(-vocab_size // multiple) * multiple
        if self.pipeline.enable_vocab_parallel:  # a shard per pipeline x tensor rank
            check_vocabulary_split(padded, self.parallel.pipeline_model_parallel_size
                                   * self.parallel.tensor_model_parallel_size)  # fmt: skip
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, padded_vocab_size=padded)
        )

    def with_run_id(self, run_id: str) -> "RunConfig":
        """The configuration once rank 0 holds --save: the id its checkpoints record."""
        return dataclasses.replace(
            self, checkpoint=dataclasses.replace(self.checkpoint, run_id=run_id)
        )


def check_vocabulary_split(padded_vocab_size: int, ranks: int) -> None:
    """--enable-vocab-parallel: every pipeline x tensor rank gets an equal share of the rows."""
    if padded_vocab_size < ranks:
        raise UserError(
            f"--enable-vocab-parallel: a vocabulary of {padded_vocab_size} is smaller than the "
            f"{ranks} pipeline x tensor ranks"
        )
    if padded_vocab_size % ranks:
        raise UserError(
            f"--enable-vocab-parallel: the padded vocabulary of {padded_vocab_size} does not "
            f"split evenly over {ranks} pipeline x tensor ranks (set "
            "--make-vocab-size-divisible-by to a multiple of the pipeline size)"
        )


def pipeline_plan(args, *, vocab_passes: bool | None = None) -> PipelinePlan:
    """The pipeline of the flags, resolved (`megatron.pipeline.plan`): once per run by
    `RunConfig.from_args`, and by the flag checks, which refuse a combination no schedule
    defines. PACI's options reach only PACI (the checks refuse them elsewhere);
    `vocab_passes` (None: --enable-vocab-parallel) places the output shards' passes. UserError
    (one line) for a combination no schedule defines."""
    if vocab_passes is None:
        vocab_passes = getattr(args, "enable_vocab_parallel", False)
    try:
        return resolve_plan(
            args.pipeline_schedule,
            num_stages=args.pipeline_model_parallel_size,
            chunks_per_rank=args.virtual_pipeline_model_parallel_size,
            microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
            arrival_rule=args.paci_arrival_rule,
            inflight_limit=args.paci_inflight_limit,
            weight_stashing=getattr(args, "paci_weight_stashing", False),
            vocab_passes=vocab_passes,
        )
    except ValueError as error:
        raise UserError(str(error)) from None


def _tuple(values):
    return None if values is None else tuple(values)


def _int_or_tuple(value):
    """An int, or a list (made a tuple: the config is frozen), as given."""
    return value if value is None or isinstance(value, int) else tuple(value)


def _pairs(values):
    return None if values is None else tuple(tuple(pair) for pair in values)
