"""The training loop's flags: the batch (micro and global, ramp-up, step schedule), the run's
length and exits, the seed and deterministic mode, evaluation and logging, and the check of the
data-parallel replicas' weights (--check-weight-hash-across-dp-replicas-interval, parsed with
the model's flags), with their checks. training.py reads them (as the run's `TrainingConfig`
and `LoggingConfig`); reporting.py writes what they ask for."""

import argparse

from megatron.common.errors import UserError
from megatron.pipeline.schedules.paci import DEFAULT_ARRIVAL_RULE
from megatron.training.batch_schedule import (
    set_step_schedule_iterations,
    validate_rampup,
    validate_step_schedule,
)
from megatron.training.layout_flags import check_virtual_microbatches
from megatron.training.pipeline_flags import validate_emulation_and_rule


def add_training_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("batch and run control").add_argument
    add("--micro-batch-size", type=int, required=True)
    add("--global-batch-size", type=int, default=None, help="default: micro x data parallel")
    add("--train-iters", type=int, default=None)
    add("--train-samples", type=int, default=None, help="instead of --train-iters")
    add("--exit-interval", type=int, default=None, help="stop after an iteration divisible by N")
    add("--exit-duration-in-mins", type=float, default=None,
        help="stop (and save) once this many minutes passed since the run started; all ranks "
        "agree on the iteration (under PACI a drain a few iterations later)")  # fmt: skip
    add("--exit-signal-handler", action="store_true",
        help="on SIGTERM, stop at an iteration all ranks agree on, save and exit 0")  # fmt: skip
    add("--rampup-batch-size", nargs="*", default=None, metavar="N",
        help="START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over "
        "SAMPLES samples (needs --train-samples)")  # fmt: skip
    add("--step-batch-size-schedule", nargs="+", default=None, metavar="THRESHOLD:BATCH",
        help="'0:384 200B:768 ...': the global batch from each threshold of consumed tokens on "
        "(K/M/B/T suffixes); sets --global-batch-size to its last batch")  # fmt: skip
    add("--calculate-per-token-loss", action="store_true",
        help="scale the summed loss by the step's token count (over its microbatches and "
        "data-parallel ranks) instead of averaging per microbatch")  # fmt: skip
    add("--skip-train", action="store_true", help="only evaluate")
    add("--seed", type=int, default=1234)
    add("--enable-experimental", action="store_true",
        help="megatron-core's experimental features (its process-wide flag, as Megatron sets it)")  # fmt: skip
    add("--deterministic-mode", action="store_true",
        help="reproducible runs: PACI follows the fixed 1F1B order instead of reacting to "
        "arrivals")  # fmt: skip


# Here rather than in reporting.py, which imports megatron-core: the flags are parsed and
# checked before it loads.
def add_logging_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("logging").add_argument
    add("--log-interval", type=int, default=100)
    add("--logging-level", type=int, default=None,
        help="the root Python logger's level (10 debug ... 40 error); default: left as it is")  # fmt: skip
    add("--eval-interval", type=int, default=1000)
    add("--eval-iters", type=int, default=100)
    add("--eval-global-batch-size", type=int, default=None,
        help="samples per evaluation iteration (default: --global-batch-size)")  # fmt: skip
    add("--eval-micro-batch-size", type=int, default=None,
        help="evaluation's micro-batch (default: --micro-batch-size)")  # fmt: skip
    add("--tensorboard-dir", default=None)
    add("--log-validation-ppl-to-tensorboard", action="store_true")
    add("--log-params-norm", action="store_true",
        help="1F1B: the model's; PACI: the logging (last) stage's")  # fmt: skip
    add("--log-num-zeros-in-grad", action="store_true",
        help="1F1B: the model's; PACI: the logging (last) stage's")  # fmt: skip
    add("--log-timers-to-tensorboard", action="store_true")
    add("--log-throughput", action="store_true", help="model TFLOP/s per GPU on the iteration line")
    add("--log-memory-to-tensorboard", action="store_true")
    add("--metrics-dir", default=None, help="write summary.json here when the run ends")
    add("--timeline-file", default=None, help="Chrome trace of every stage's actions")


def validate_batch_and_run_length(args: argparse.Namespace) -> None:
    for flag in ("micro_batch_size", "seq_length", "log_interval", "eval_interval"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    validate_step_schedule(args)  # sets the global batch: the schedule's last
    per_microbatch = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_microbatch
    if args.global_batch_size % per_microbatch != 0:
        raise UserError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
            f"{args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_microbatch
    check_virtual_microbatches(args)
    _validate_eval_batch(args)
    _validate_run_length(args)
    validate_rampup(args)
    set_step_schedule_iterations(args)
    if args.exit_interval is not None and args.exit_interval < 1:
        raise UserError("--exit-interval must be >= 1")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise UserError("--exit-duration-in-mins must be >= 0 (0: no limit, as Megatron)")


def _validate_eval_batch(args: argparse.Namespace) -> None:
    """Evaluation's batch (Megatron's defaults: training's) and its microbatches per
    iteration, `args.eval_num_microbatches`."""
    for name, default in (("eval_micro_batch_size", args.micro_batch_size),
                          ("eval_global_batch_size", args.global_batch_size)):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        setattr(args, name, default if value is None else value)
    per_microbatch = args.eval_micro_batch_size * args.data_parallel_size
    if args.eval_global_batch_size % per_microbatch:
        raise UserError(
            f"--eval-global-batch-size {args.eval_global_batch_size} is not divisible by "
            f"--eval-micro-batch-size x data-parallel size = {args.eval_micro_batch_size} x "
            f"{args.data_parallel_size}"
        )
    if args.eval_micro_batch_size % args.micro_batch_size:  # pieces of training's (evaluate)
        raise UserError(
            f"--eval-micro-batch-size {args.eval_micro_batch_size} other than a multiple of "
            f"--micro-batch-size {args.micro_batch_size} is not supported yet"
        )
    args.eval_num_microbatches = args.eval_global_batch_size // per_microbatch
    pieces = args.eval_num_microbatches * args.eval_micro_batch_size // args.micro_batch_size
    if pieces != args.num_microbatches:
        check_virtual_microbatches(args, pieces, "--eval-global-batch-size")


def _validate_run_length(args: argparse.Namespace) -> None:
    """--train-iters or --train-samples; a sample-based run takes its LR schedule in samples."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise UserError("pass exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise UserError(
                "with --train-samples use --lr-decay-samples / --lr-warmup-samples, not iterations"
            )
        args.train_iters = args.train_samples // args.global_batch_size
    elif args.lr_decay_samples is not None or args.lr_warmup_samples:
        raise UserError("--lr-decay-samples / --lr-warmup-samples need --train-samples")
    # a ramp counts its own iterations, and so does a step schedule by samples
    counts_own = args.rampup_batch_size is not None or (
        args.step_batch_size_schedule is not None and args.train_samples is not None
    )
    if args.train_iters < 1 and not counts_own:
        raise UserError("--train-iters must be >= 1 (or --train-samples >= --global-batch-size)")
    validate_emulation_and_rule(args)


def replicas_order_on_their_own(args: argparse.Namespace) -> bool:
    """Data-parallel replicas under a reactive PACI arrival rule: each orders its forwards,
    backwards and steps by its own arrivals."""
    reactive = args.paci_arrival_rule not in (None, DEFAULT_ARRIVAL_RULE)
    return reactive and not args.deterministic_mode and args.data_parallel_size > 1


def validate_weight_hash_check(args: argparse.Namespace) -> None:
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is None:
        return
    if interval < 1:
        raise UserError(
            f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got {interval}"
        )
    if replicas_order_on_their_own(args):
        raise UserError(
            f"--check-weight-hash-across-dp-replicas-interval with --paci-arrival-rule "
            f"{args.paci_arrival_rule} and data parallelism is not supported yet (arrivals "
            "order each replica's steps on their own, so at an iteration's end the replicas "
            "need not have taken the same steps)"
        )
