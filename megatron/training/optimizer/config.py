"""What the optimizer package reads, as two small typed configs built once from the flags.

`OptimizerConfig` is everything that builds a stage's optimizer (the `--optimizer` suite, fp32
main params, the distributed optimizer, fp16 loss scaling, delay mitigation);
`LRScheduleConfig` is the learning-rate and weight-decay schedule. The training loop builds
both with `from_args(args)`; the package itself never sees the parsed flags, so a test or a
study can build an optimizer from a config alone, as with megatron-core's `OptimizerConfig`.
"""

from dataclasses import dataclass

import torch

from megatron.training.batch_schedule import lr_in_samples


def model_dtype(args) -> torch.dtype:
    """The dtype of the model's parameters and activations: --bf16, --fp16 or fp32."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


@dataclass(frozen=True)
class OptimizerConfig:
    """The settings of one stage's optimizer (Megatron's flag names, without the dashes)."""

    optimizer: str = "adam"  # --optimizer: one of suite.OPTIMIZERS
    lr: float = 1e-3
    min_lr: float = 0.0
    # --decoupled-lr / --decoupled-min-lr: the embedding's and output layer's own schedule
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False  # the q/k layernorms decayed too (Qwen3-Next)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    # The first-moment coefficient of lion/adan/soap/mars (the delay study's momentum sweep);
    # None keeps each library's default.
    optimizer_beta1: float | None = None
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"
    muon_tp_mode: str = "duplicated"
    muon_scalar_optimizer: str = "adam"
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_split_qkv: bool = True
    # The attention shape Muon's fused-QKV split needs when the model has no config of its own.
    num_attention_heads: int | None = None
    tensor_model_parallel_size: int = 1
    mup_width_mult: float = 1.0  # --use-mup: hidden / --mup-base-hidden-size (mup.py)
    # An asynchronous schedule steps while activations are held (PACI, 2BW, PipeDream).
    steps_with_microbatches_in_flight: bool = False
    params_dtype: torch.dtype = torch.float32  # bf16 / fp16 models get fp32 main params
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    # the updated parameters gathered in the gradient reduction's buckets, each waited for by
    # the forward that reads it (param_gather.py)
    overlap_param_gather: bool = False
    # fp16 loss scaling (used when params_dtype is float16): a static scale, else dynamic.
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # --use-precision-aware-optimizer: adam's moments stored in these dtypes (precision_aware.py)
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    async_error_feedback: bool = False  # delay mitigation (delay_mitigation.py)
    async_error_feedback_stretch: bool = False
    async_error_feedback_delayed_stages: bool = False
    delay_compensation_lambda: float = 0.0
    # --async-nesterov-lookahead, --async-delay-momentum (delay_lookahead.py), and the stage's
    # gradient delay bound and the pipeline's largest, which they and the error feedback's
    # stretch read (set by `for_stage`)
    async_nesterov_lookahead: bool = False
    async_delay_momentum: float | None = None
    stage_delay: int = 0
    max_stage_delay: int = 0

    @property
    def needs_main_params(self) -> bool:
        """fp32 main copies: a bf16/fp16 model, or one sharded over data parallelism."""
        return self.params_dtype != torch.float32 or self.use_distributed_optimizer

    @classmethod
    def from_args(cls, args) -> "OptimizerConfig":
        from megatron.pipeline.schedules import get_schedule

        fields = {name: getattr(args, name) for name in _FLAG_FIELDS if hasattr(args, name)}
        schedule = getattr(args, "pipeline_schedule", "1f1b")
        base = getattr(args, "mup_base_hidden_size", None) or getattr(args, "hidden_size", 1)
        mup = getattr(args, "use_mup", False)
        return cls(
            **fields,
            mup_width_mult=args.hidden_size / base if mup else 1.0,
            steps_with_microbatches_in_flight=not get_schedule(schedule).flushes_every_call,
            params_dtype=model_dtype(args),
            delay_compensation_lambda=getattr(args, "delay_compensation_lambda", 0.0) or 0.0,
        )


_DERIVED = (
    "mup_width_mult",
    "steps_with_microbatches_in_flight",
    "params_dtype",
    "delay_compensation_lambda",
    "stage_delay",
    "max_stage_delay",
)
_FLAG_FIELDS = [name for name in OptimizerConfig.__dataclass_fields__ if name not in _DERIVED]


@dataclass(frozen=True)
class LRScheduleConfig:
    """megatron-core's OptimizerParamScheduler settings; warmup and decay in scheduler steps
    (iterations, or samples under --rampup-batch-size or a sample-based
    --step-batch-size-schedule)."""

    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    decay_style: str = "linear"
    weight_decay: float = 0.01
    warmup_init: float = 0.0  # --lr-warmup-init: the LR the warmup starts from
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False

    @classmethod
    def from_args(cls, args) -> "LRScheduleConfig":
        warmup, decay = _schedule_lengths(args)
        return cls(
            max_lr=args.lr,
            min_lr=args.min_lr,
            warmup_steps=warmup,
            decay_steps=decay,
            decay_style=args.lr_decay_style,
            weight_decay=args.weight_decay,
            warmup_init=getattr(args, "lr_warmup_init", 0.0),
            use_checkpoint_opt_param_scheduler=getattr(
                args, "use_checkpoint_opt_param_scheduler", False
            ),
            override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
        )


def _schedule_lengths(args) -> tuple[float, float]:
    """(warmup, decay) in iterations. A sample-based run (--train-samples) gives them in
    samples; with a constant global batch, samples / batch is Megatron's sample schedule.
    With --rampup-batch-size, or --step-batch-size-schedule by --train-samples, they stay in
    samples, and each step advances the schedule by its iteration's global batch (the training
    loop sets `scheduler_increment`), as Megatron. (A step schedule by --train-iters counts
    iterations: Megatron's would count --lr-decay-iters x micro batch x data parallel samples,
    its global batch then, and end the decay early.)"""
    if lr_in_samples(args):
        decay = args.lr_decay_samples or args.train_samples
        fraction = args.lr_warmup_fraction
        return (fraction * decay if fraction is not None else args.lr_warmup_samples), decay
    if getattr(args, "train_samples", None) is not None:
        batch = args.global_batch_size
        decay = (args.lr_decay_samples or args.train_samples) / batch
        warmup = args.lr_warmup_samples / batch
    else:
        decay = args.lr_decay_iters or args.train_iters
        warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
        warmup = warmup if getattr(args, "train_samples", None) is not None else int(warmup)
    return warmup, decay
