"""Megatron's fully-sharded-data-parallel flags (`--use-torch-fsdp2`, `--use-megatron-fsdp` and
theirs), as Megatron-LM's arguments define them, and what they resolve to here (fsdp.py):

* `--use-torch-fsdp2`: every parameter, gradient and optimizer state sharded (ZeRO-3), the
  weights gathered for each pass; `--torch-fsdp2-no-reshard-after-forward` keeps them gathered
  from a layer's forward to its backward (ZeRO-2's memory for the weights).
* `--use-megatron-fsdp` with `--data-parallel-sharding-strategy`: `optim_grads_params` (the
  default) is the same ZeRO-3; `optim_grads` keeps the weights gathered from forward to
  backward; `optim` is the distributed optimizer (ZeRO-1, optimizer/distributed_optimizer.py)
  and `no_shard` the replicated optimizer. As in Megatron, Megatron-FSDP turns the
  distributed optimizer on (except for `no_shard`, whose optimizer state is not sharded).
  Main weights are fp32 and gradients are accumulated and reduced in fp32 (`fp32`, and the
  flags' `auto` for an fp32 model or for the gradients, as `--bf16` does here everywhere).
* `--no-fsdp-prefetch` (ours, a benchmark switch): no layer's forward starts the next layer's
  all-gather; the backward keeps torch's own prefetch (the previous layer's gather).
"""

import argparse

from megatron.common.errors import UserError

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPE_CHOICES = ("fp32", "bf16", "fp16", "auto")
# Schedules whose every backward is one autograd call over the whole stage (no split of the
# weight gradient, no stashed weight versions): torch's fully_shard hooks see whole passes.
SCHEDULES = ("1f1b", "paci")
# Not element-wise: the update of a row depends on the other rows (the whole matrix).
MATRIX_OPTIMIZERS = ("muon", "soap", "mars")


def add_fsdp_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("fully sharded data parallelism (fsdp.py)").add_argument
    add("--use-torch-fsdp2", action="store_true",
        help="shard weights, gradients and optimizer state over the stage's data-parallel ranks "
        "(torch's fully_shard, one unit per transformer layer)")  # fmt: skip
    add("--torch-fsdp2-no-reshard-after-forward", action="store_false",
        dest="torch_fsdp2_reshard_after_forward",
        help="keep a layer's gathered weights from its forward to its backward")  # fmt: skip
    add("--no-fsdp-prefetch", action="store_false", dest="fsdp_prefetch",
        help="a benchmark switch: a layer's forward gathers its own weights only, not the next "
        "layer's ahead (fsdp.md)")  # fmt: skip
    add("--use-megatron-fsdp", action="store_true",
        help="Megatron-FSDP's sharding, by --data-parallel-sharding-strategy")  # fmt: skip
    add("--data-parallel-sharding-strategy", default="optim_grads_params",
        choices=SHARDING_STRATEGIES)  # fmt: skip
    add("--outer-dp-sharding-strategy", default="no_shard", choices=("no_shard", "optim"))
    add("--megatron-fsdp-main-params-dtype", default="fp32", choices=DTYPE_CHOICES)
    add("--megatron-fsdp-main-grads-dtype", default="auto", choices=DTYPE_CHOICES)
    add("--megatron-fsdp-grad-comm-dtype", default="auto", choices=DTYPE_CHOICES)


def validate_fsdp_args(args: argparse.Namespace, *, replicas_order_on_their_own: bool = False):
    """Resolves `args.fully_sharded` ("torch_fsdp2", "megatron_fsdp" or None: no FSDP units)
    and `args.reshard_after_forward`; what is not supported yet fails in one line.
    `replicas_order_on_their_own`: a reactive PACI arrival rule lets each data-parallel replica
    order its passes by its own arrivals, and FSDP's gathers in every pass need one order."""
    if args.use_torch_fsdp2 and args.use_megatron_fsdp:
        raise UserError("--use-torch-fsdp2 and --use-megatron-fsdp exclude each other")
    args.fully_sharded, args.reshard_after_forward = None, True
    if args.use_torch_fsdp2:
        if args.use_distributed_optimizer:  # Megatron's rule
            raise UserError("--use-torch-fsdp2 is not supported with --use-distributed-optimizer "
                            "(as in Megatron): FSDP shards the optimizer state itself")  # fmt: skip
        args.fully_sharded = "torch_fsdp2"
        args.reshard_after_forward = args.torch_fsdp2_reshard_after_forward
    elif args.use_megatron_fsdp:
        _validate_megatron_fsdp(args)
    if args.fully_sharded is not None:
        _reject_what_is_not_supported_yet(args)
        if replicas_order_on_their_own:
            flag = "--use-torch-fsdp2" if args.use_torch_fsdp2 else "--use-megatron-fsdp"
            raise UserError(
                f"{flag} with --paci-arrival-rule {args.paci_arrival_rule} and data "
                "parallelism is not supported yet (each replica orders its passes by its own "
                "arrivals, and FSDP gathers over the replicas in every pass; add "
                "--deterministic-mode or keep the fixed order)"
            )
    elif not getattr(args, "fsdp_prefetch", True):
        raise UserError("--no-fsdp-prefetch needs --use-torch-fsdp2 or --use-megatron-fsdp")
    elif args.ckpt_format == "fsdp_dtensor":
        raise UserError("--ckpt-format fsdp_dtensor needs a fully sharded model: "
                        "--use-megatron-fsdp (with --data-parallel-sharding-strategy "
                        "optim_grads_params or optim_grads) or --use-torch-fsdp2")  # fmt: skip


def _validate_megatron_fsdp(args: argparse.Namespace) -> None:
    strategy = args.data_parallel_sharding_strategy
    if args.outer_dp_sharding_strategy != "no_shard":
        raise UserError(
            f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy} is not supported "
            "yet (hybrid sharding)"
        )
    fp32_model = not (args.bf16 or args.fp16)
    for name in ("main_params", "main_grads", "grad_comm"):
        flag = f"--megatron-fsdp-{name.replace('_', '-')}-dtype"
        value = getattr(args, f"megatron_fsdp_{name}_dtype")
        main_params_auto = flag.endswith("params-dtype") and value == "auto" and not fp32_model
        if value in ("bf16", "fp16") or main_params_auto:
            what = f"{value} (the model's dtype)" if value == "auto" else value
            raise UserError(f"{flag} {what} is not supported yet: fp32 main weights and "
                            "gradients")  # fmt: skip
    args.use_distributed_optimizer = strategy != "no_shard"  # Megatron-FSDP v1 needs it
    if strategy in ("optim_grads", "optim_grads_params"):
        args.fully_sharded = "megatron_fsdp"
        args.reshard_after_forward = strategy == "optim_grads_params"


def _reject_what_is_not_supported_yet(args: argparse.Namespace) -> None:
    flag = "--use-torch-fsdp2" if args.use_torch_fsdp2 else "--use-megatron-fsdp"
    several_stages = args.pipeline_model_parallel_size > 1
    cases = (
        (f"--pipeline-schedule {args.pipeline_schedule}", args.pipeline_schedule not in SCHEDULES),
        ("virtual pipeline stages", (args.virtual_pipeline_model_parallel_size or 1) > 1),
        (f"--optimizer {args.optimizer}", args.optimizer in MATRIX_OPTIMIZERS),
        ("embeddings tied over several pipeline stages (add "
         "--untie-embeddings-and-output-weights)",
         several_stages and not args.untie_embeddings_and_output_weights),
        ("--mtp-num-layers over several pipeline stages",
         several_stages and bool(getattr(args, "mtp_num_layers", None))),
        ("an --expert-tensor-parallel-size other than the tensor-parallel size",
         getattr(args, "expert_tensor_parallel_size", None)
         not in (None, args.tensor_model_parallel_size)),
        ("--num-distributed-optimizer-instances > 1", args.num_distributed_optimizer_instances > 1),
        ("--use-precision-aware-optimizer", args.use_precision_aware_optimizer),
        ("--async-error-feedback", args.async_error_feedback),
        ("--delay-compensation-lambda", bool(args.delay_compensation_lambda)),
        ("--async-nesterov-lookahead", getattr(args, "async_nesterov_lookahead", False)),
        ("--async-delay-momentum", getattr(args, "async_delay_momentum", None) is not None),
        ("--defer-embedding-wgrad-compute", getattr(args, "defer_embedding_wgrad_compute", False)),
        ("--enable-vocab-parallel", getattr(args, "enable_vocab_parallel", False)),
        ("--check-weight-hash-across-dp-replicas-interval (no replicas: each rank holds its "
         "rows)", getattr(args, "check_weight_hash_across_dp_replicas_interval", None)
         is not None),
        ("--rerun-mode validate_results", getattr(args, "rerun_mode", "disabled")
         == "validate_results"),
        ("emulated stages", getattr(args, "emulated_forward_ms", None) is not None),
    )  # fmt: skip
    for what, on in cases:
        if on:
            raise UserError(f"{flag} with {what} is not supported yet")
