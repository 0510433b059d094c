"""The optimizer's flags, with Megatron's names and defaults, and their checks: --optimizer with
its learning-rate schedule, weight decay, clipping and moments; the optimizer suite's settings
(Muon, Lion) and the delay mitigations (ours); mixed precision, loss scaling and the distributed
optimizer. build.py reads them (as the run's `OptimizerConfig` and `LRScheduleConfig`).

PACI's per-stage learning-rate scale is parsed with PACI's flags (training/pipeline_flags.py) and
checked here (`validate_stage_lr_scale`): build.py applies it."""

import argparse
import math

from megatron.common.errors import UserError
from megatron.distributed.data_parallel import validate_data_parallel_args

OPTIMIZER_NAMES = ("adam", "sgd", "muon", "lion", "adan", "soap", "mars")  # suite.py's


def add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("optimizer").add_argument
    add("--optimizer", default="adam", help=f"one of: {', '.join(OPTIMIZER_NAMES)}")
    add("--lr", type=float, required=True)
    add("--min-lr", type=float, default=0.0)
    add(
        "--decoupled-lr",
        type=float,
        default=None,
        help="peak LR of the word embedding and the output layer (default: --lr)",
    )
    add("--decoupled-min-lr", type=float, default=None,
        help="their LR floor (default: --min-lr); needs --decoupled-lr")  # fmt: skip
    add("--lr-decay-style", default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root"])  # fmt: skip
    add("--lr-decay-iters", type=int, default=None)
    add("--lr-decay-samples", type=int, default=None)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-warmup-init", type=float, default=0.0, help="the LR the warmup starts from")
    add("--lr-warmup-samples", type=int, default=0)
    add("--lr-warmup-fraction", type=float, default=None)
    add("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
        help="take the LR schedule from the command line, not the checkpoint")  # fmt: skip
    add("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="take the LR schedule from the checkpoint")  # fmt: skip
    add("--weight-decay", type=float, default=0.01)
    add("--apply-wd-to-qk-layernorm", action="store_true",
        help="weight decay on the q/k layernorms too (Qwen3-Next), not only on matrices")  # fmt: skip
    add("--clip-grad", type=float, default=1.0)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--adam-eps", type=float, default=1e-8)
    add("--sgd-momentum", type=float, default=0.9)


def add_optimizer_suite_args(parser: argparse.ArgumentParser) -> None:
    """Muon's settings under Megatron's names and defaults; the delay mitigations (ours)."""
    add = parser.add_argument_group("optimizer suite and delay mitigations").add_argument
    add("--muon-momentum", type=float, default=0.9)
    add("--muon-nesterov", "--muon-use-nesterov", action="store_true",
        help="Nesterov momentum inside Muon (--muon-use-nesterov: this project's older spelling)")  # fmt: skip
    add("--muon-coefficient-type", default="quintic",
        help="Newton-Schulz coefficients: simple (torch's), quintic, polar_express, aol")  # fmt: skip
    add("--muon-scalar-optimizer", default="adam", choices=["adam", "lion"],
        help="for what Muon does not step: embeddings, output layer, 1-D parameters")  # fmt: skip
    add("--lion-beta1", type=float, default=0.95, help="Lion: the update's sign mix")
    add("--lion-beta2", type=float, default=0.98, help="Lion: the momentum's average")
    add("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
        help="orthogonalize the fused QKV weight as one matrix (default: Q, K, V apart)")  # fmt: skip
    add("--muon-scale-mode", default="spectral",
        help="spectral: sqrt(max(rows, cols)), unit_rms_norm: sqrt(rows/cols), "
        "shape_scaling: sqrt(max(1, rows/cols))")  # fmt: skip
    add("--muon-fp32-matmul-prec", default="medium",
        help="medium only: Newton-Schulz with bf16 operands (torch.optim.Muon)")  # fmt: skip
    add("--muon-num-ns-steps", type=int, default=5)
    add("--muon-tp-mode", default="duplicated",
        help="duplicated: orthogonalize the full matrix gathered over tensor parallelism (the "
        "TP = 1 update); blockwise: each rank its local shard")  # fmt: skip
    add("--muon-extra-scale-factor", type=float, default=1.0)
    add("--async-error-feedback", action="store_true",
        help="update-level error feedback x(t+1) = x(t) - 2u(t) + u(t-1), decay outside u")  # fmt: skip
    add("--async-error-feedback-stretch", action="store_true",
        help="with --async-error-feedback: a stage whose gradients are up to d > 1 steps stale "
        "extrapolates over its d steps, x(t+1) = x(t) - (1 + d) u(t) + d u(t-1)")  # fmt: skip
    add("--async-error-feedback-delayed-stages", action="store_true",
        help="with --async-error-feedback: only the stages whose gradients can be stale "
        "extrapolate; a stage whose delay bound is 0 (PACI's last) steps its plain update")  # fmt: skip
    add("--delay-compensation-lambda", type=float, default=0.0,
        help="DC-ASGD: g += lambda * g * g * (x now - x at the gradient), 0 = off")  # fmt: skip
    add("--async-nesterov-lookahead", action="store_true",
        help="Muon/AdamW: Nesterov look-ahead stretched over each stage's gradient delay d, "
        "m + (1 + d) beta (m - m_old)")  # fmt: skip
    add("--async-delay-momentum", type=float, default=None,
        help="Muon/AdamW first-moment coefficient raised with each stage's delay, up to this "
        "value on the most delayed stage")  # fmt: skip
    add("--async-sync-warmup-iters", type=int, default=0,
        help="1F1B-flush for the first K iterations, then the asynchronous schedule")  # fmt: skip
    add("--async-sync-cooldown-iters", type=int, default=0,
        help="1F1B-flush for the last K iterations")  # fmt: skip


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's mixed-precision and distributed-optimizer flags (docs/precision.md)."""
    add = parser.add_argument_group("mixed precision and distributed optimizer").add_argument
    add("--fp16", action="store_true",
        help="fp16 parameters and activations, fp32 main weights, loss scaling per stage")  # fmt: skip
    add("--loss-scale", type=float, default=None,
        help="static fp16 loss scale (default: dynamic)")  # fmt: skip
    add("--initial-loss-scale", type=float, default=2**32)
    add("--min-loss-scale", type=float, default=1.0)
    add("--loss-scale-window", type=float, default=1000,
        help="clean steps before the dynamic scale doubles")  # fmt: skip
    add("--hysteresis", type=int, default=2,
        help="overflowing steps before the dynamic scale halves")  # fmt: skip
    add("--accumulate-allreduce-grads-in-fp32", action="store_true",
        help="our behaviour with --bf16/--fp16 (fp32 main_grad); fp32 runs are fp32 anyway")  # fmt: skip
    add("--use-distributed-optimizer", action="store_true",
        help="shard fp32 main weights and optimizer state over the stage's data-parallel group")  # fmt: skip
    add("--no-use-layer-wise-param-layout", action="store_false",
        dest="use_layer_wise_param_layout",
        help="--optimizer muon with --use-distributed-optimizer: every parameter owned whole by "
        "one data-parallel rank, the AdamW ones too (Megatron's legacy layer-wise path); "
        "the only layer-wise path here, so the default gives the same run")  # fmt: skip
    add("--overlap-param-gather", action="store_true",
        help="with --use-distributed-optimizer and --overlap-grad-reduce: gather the updated "
        "parameters per bucket asynchronously, each waited for by the forward that reads it")  # fmt: skip
    add("--overlap-param-gather-with-optimizer-step", action="store_true",
        help="accepted with --overlap-param-gather and virtual stages; changes nothing here: "
        "every bucket's gather already starts at the end of the step")  # fmt: skip
    add("--num-distributed-optimizer-instances", type=int, default=1,
        help="copies of the distributed optimizer over the stage's data-parallel ranks: each "
        "copy shards over data-parallel size / copies ranks")  # fmt: skip
    add("--use-precision-aware-optimizer", action="store_true",
        help="adam: store the moments as --exp-avg-dtype / --exp-avg-sq-dtype, compute in fp32")  # fmt: skip
    add("--main-params-dtype", default="fp32", choices=["fp32", "fp16"])
    add("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"])
    add("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"])
    add("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"])
    add("--ddp-average-in-collective", action="store_true",
        help="average the data-parallel gradients in the collective (ReduceOp.AVG) instead of a "
        "sum and a division")  # fmt: skip


# Not element-wise (per matrix); Muon is distributed by whole parameters (layer_wise.py).
DISTRIBUTED_OPTIMIZER_REFUSES = ("soap", "mars")


def validate_optimizer_suite_args(args: argparse.Namespace) -> None:
    if args.optimizer not in OPTIMIZER_NAMES:
        known = ", ".join(OPTIMIZER_NAMES)
        raise UserError(f"unknown --optimizer {args.optimizer!r} (known: {known})")
    scale_modes = ("spectral", "unit_rms_norm", "shape_scaling")
    if args.muon_scale_mode not in scale_modes:
        raise UserError(
            f"unknown --muon-scale-mode {args.muon_scale_mode!r} (known: {', '.join(scale_modes)})"
        )
    _validate_muon_args(args)
    if args.muon_num_ns_steps < 1:
        raise UserError("--muon-num-ns-steps must be >= 1")
    if args.delay_compensation_lambda < 0:
        raise UserError("--delay-compensation-lambda must be >= 0")
    if args.delay_compensation_lambda and args.pipeline_schedule == "1f1b":
        raise UserError(
            "--delay-compensation-lambda needs an asynchronous --pipeline-schedule: "
            "under 1f1b no gradient is stale"
        )
    _validate_delay_lookahead(args)
    _validate_error_feedback_by_delay(args)
    for flag in ("async_sync_warmup_iters", "async_sync_cooldown_iters"):
        name = "--" + flag.replace("_", "-")
        if getattr(args, flag) < 0:
            raise UserError(f"{name} must be >= 0")
        if getattr(args, flag) and args.pipeline_schedule == "1f1b":
            raise UserError(f"{name} needs an asynchronous --pipeline-schedule (1f1b is flush)")
        # their per-stage momentum is set once, for the asynchronous phase's delays
        for other, value in (("--async-nesterov-lookahead", args.async_nesterov_lookahead),
                             ("--async-delay-momentum", args.async_delay_momentum)):  # fmt: skip
            if getattr(args, flag) and value not in (None, False):
                raise UserError(f"{name} with {other} is not supported yet")


def _validate_muon_args(args: argparse.Namespace) -> None:
    from megatron.training.optimizer.muon import COEFFICIENT_SETS, TP_MODES, coefficient_schedule

    if args.muon_tp_mode == "distributed":
        raise UserError("--muon-tp-mode distributed is not supported yet (duplicated gives its "
                        "update: the full matrix's)")  # fmt: skip
    if args.muon_tp_mode not in TP_MODES:
        raise UserError(f"unknown --muon-tp-mode {args.muon_tp_mode!r} (known: duplicated, "
                        "blockwise, distributed)")  # fmt: skip
    if args.muon_fp32_matmul_prec != "medium":
        raise UserError(f"--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec} is not supported "
                        "yet (only medium)")  # fmt: skip
    if args.muon_coefficient_type not in COEFFICIENT_SETS:
        known = ", ".join(COEFFICIENT_SETS)
        raise UserError(f"--muon-coefficient-type {args.muon_coefficient_type} is not supported "
                        f"yet (known: {known})")  # fmt: skip
    if args.muon_num_ns_steps >= 1:
        try:
            coefficient_schedule(args.muon_coefficient_type, args.muon_num_ns_steps)
        except ValueError as error:
            raise UserError(f"--muon-coefficient-type {args.muon_coefficient_type}: {error} "
                            "(--muon-num-ns-steps)") from None  # fmt: skip
    for flag in ("lion_beta1", "lion_beta2"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise UserError(
                f"--{flag.replace('_', '-')} must be a number >= 0 and < 1, got {value}"
            )


def _validate_delay_lookahead(args: argparse.Namespace) -> None:
    """--async-nesterov-lookahead and --async-delay-momentum: per-stage settings by the
    asynchronous schedule's delay bound, for Muon's momentum and AdamW's first moment."""
    momentum = getattr(args, "async_delay_momentum", None)
    flags = [flag for flag, on in (("--async-nesterov-lookahead",
                                    getattr(args, "async_nesterov_lookahead", False)),
                                   ("--async-delay-momentum", momentum is not None)) if on]  # fmt: skip
    if momentum is not None and not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
        raise UserError(f"--async-delay-momentum must be a number >= 0 and < 1, got {momentum}")
    for flag in flags:
        if args.pipeline_schedule == "1f1b":
            raise UserError(f"{flag} needs an asynchronous --pipeline-schedule: under 1f1b no "
                            "gradient is stale")  # fmt: skip
        unsupported = (
            (f"--optimizer {args.optimizer}", args.optimizer not in ("adam", "muon")),
            ("--muon-scalar-optimizer lion",
             args.optimizer == "muon" and args.muon_scalar_optimizer == "lion"),
            ("--use-precision-aware-optimizer", getattr(args, "use_precision_aware_optimizer",
                                                        False)),
            ("--use-distributed-optimizer", args.use_distributed_optimizer),
            ("virtual pipeline stages", (getattr(args, "virtual_pipeline_model_parallel_size",
                                                 None) or 1) > 1),
        )  # fmt: skip
        for what, on in unsupported:
            if on:
                raise UserError(f"{flag} with {what} is not supported yet")


def _validate_error_feedback_by_delay(args: argparse.Namespace) -> None:
    """--async-error-feedback-stretch and --async-error-feedback-delayed-stages read the stage's
    delay bound, as the look-ahead does."""
    for flag in ("--async-error-feedback-stretch", "--async-error-feedback-delayed-stages"):
        if not getattr(args, flag[2:].replace("-", "_"), False):
            continue
        if not args.async_error_feedback:
            raise UserError(f"{flag} needs --async-error-feedback")
        if (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
            raise UserError(f"{flag} with virtual pipeline stages is not supported yet")


def validate_precision_args(args: argparse.Namespace) -> None:
    _validate_precision_aware_optimizer(args)
    if args.fp16 and args.bf16:
        raise UserError("--fp16 and --bf16 exclude each other")
    for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(args, name)
        if value is not None and not (0 < value < float("inf")):
            raise UserError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.min_loss_scale > args.initial_loss_scale:
        raise UserError("--min-loss-scale is above --initial-loss-scale")
    if args.loss_scale_window < 1 or args.hysteresis < 1:
        raise UserError("--loss-scale-window and --hysteresis must be >= 1")
    validate_data_parallel_args(args)
    if args.overlap_param_gather and not (
        args.use_distributed_optimizer and args.overlap_grad_reduce
    ):
        raise UserError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
        )
    if args.overlap_param_gather_with_optimizer_step and not (
        args.overlap_param_gather and args.virtual_pipeline_model_parallel_size is not None
    ):
        raise UserError(  # Megatron's rules
            "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather (and so "
            "--use-distributed-optimizer) and virtual pipeline stages"
        )
    _validate_optimizer_instances(args)
    if not args.use_distributed_optimizer:
        return
    if args.optimizer in DISTRIBUTED_OPTIMIZER_REFUSES:
        raise UserError(
            f"--use-distributed-optimizer with --optimizer {args.optimizer} is not supported yet"
        )
    if args.optimizer == "muon" and args.num_distributed_optimizer_instances > 1:
        raise UserError("--num-distributed-optimizer-instances > 1 with --optimizer muon is not "
                        "supported yet (the layer-wise distributed optimizer has one copy)")  # fmt: skip
    for flag, value in (("--async-error-feedback", args.async_error_feedback),
                        ("--delay-compensation-lambda", args.delay_compensation_lambda)):  # fmt: skip
        if value:
            raise UserError(f"--use-distributed-optimizer with {flag} is not supported yet")


def _validate_precision_aware_optimizer(args: argparse.Namespace) -> None:
    """--use-precision-aware-optimizer: Adam's moments in a lower dtype (optimizer/
    precision_aware.py); what it does not cover yet, one line each."""
    dtypes = {"--main-params-dtype": args.main_params_dtype,
              "--main-grads-dtype": args.main_grads_dtype,
              "--exp-avg-dtype": args.exp_avg_dtype,
              "--exp-avg-sq-dtype": args.exp_avg_sq_dtype}  # fmt: skip
    if not args.use_precision_aware_optimizer:
        for flag, value in dtypes.items():
            if value != "fp32":
                raise UserError(f"{flag} {value} needs --use-precision-aware-optimizer")
        return
    if args.optimizer != "adam":
        raise UserError(
            f"--use-precision-aware-optimizer with --optimizer {args.optimizer} is not supported yet"
        )
    for flag, value in dtypes.items():
        if value == "fp8" or (value != "fp32" and flag in ("--main-params-dtype",
                                                           "--main-grads-dtype")):  # fmt: skip
            raise UserError(f"{flag} {value} is not supported yet")


def _validate_optimizer_instances(args: argparse.Namespace) -> None:
    instances = args.num_distributed_optimizer_instances
    if instances == 1:
        return
    if instances < 1 or args.data_parallel_size % instances != 0:
        raise UserError(
            f"--num-distributed-optimizer-instances {instances} must divide the data-parallel "
            f"size {args.data_parallel_size}"
        )
    if not args.use_distributed_optimizer:
        raise UserError("--num-distributed-optimizer-instances needs --use-distributed-optimizer")


def validate_stage_lr_scale(args: argparse.Namespace) -> None:
    """--paci-stage-lr-scale: PACI's per-stage staleness (N - 1 - s) / a with one a and one
    model chunk per stage."""
    scale = getattr(args, "paci_stage_lr_scale", None)
    if scale is None:
        return
    if not math.isfinite(scale) or scale < 0:
        raise UserError(f"--paci-stage-lr-scale {scale:g} must be finite and >= 0")
    if args.pipeline_schedule != "paci":
        raise UserError(
            f"--paci-stage-lr-scale is not supported yet with --pipeline-schedule "
            f"{args.pipeline_schedule}"
        )
    for flag, value in (
        ("--paci-accumulation-schedule", getattr(args, "paci_accumulation_schedule", None)),
        ("--rampup-batch-size", args.rampup_batch_size),
        ("--step-batch-size-schedule", args.step_batch_size_schedule),
        ("virtual pipeline stages", (getattr(args, "virtual_pipeline_model_parallel_size", None)
                                     or 1) > 1),
    ):  # fmt: skip
        if value:
            raise UserError(f"--paci-stage-lr-scale with {flag} is not supported yet")


def validate_lr_schedule_source(args: argparse.Namespace) -> None:
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UserError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
            "each other"
        )
