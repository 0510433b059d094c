"""Command-line arguments, with Megatron's flag names, and their validation.

Validation runs before anything heavy (process groups, model, data) and raises `UserError`
with one line naming the problem.
"""

import argparse
import os

from megatron.pipeline.schedules import SCHEDULES
from megatron.pipeline.schedules.paci import ARRIVAL_RULES, DEFAULT_ARRIVAL_RULE
from megatron.pipeline.simulation.costs import stage_values

from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="GPT pretraining on megatron-core with synchronous and asynchronous "
        "pipeline schedules",
        allow_abbrev=False,
    )
    add = parser.add_argument_group("model").add_argument
    add("--num-layers", type=int, required=True)
    add("--hidden-size", type=int, required=True)
    add("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    add("--num-attention-heads", type=int, required=True)
    add("--seq-length", type=int, required=True)
    add("--max-position-embeddings", type=int, default=None, help="default: seq length")
    add("--init-method-std", type=float, default=0.02)
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
    )
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--bf16", action="store_true", help="bf16 parameters and activations (GPU)")

    add = parser.add_argument_group("parallelism").add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--distributed-backend", default=None, choices=["nccl", "gloo"],
        help="default: nccl when CUDA is available, else gloo")  # fmt: skip
    add("--distributed-timeout-minutes", type=int, default=10)
    add("--decoder-first-pipeline-num-layers", type=int, default=None,
        help="layers on the first stage (the rest split evenly)")  # fmt: skip
    add("--decoder-last-pipeline-num-layers", type=int, default=None,
        help="layers on the last stage, e.g. fewer to balance the output layer and loss")  # fmt: skip
    add("--pipeline-schedule", default="1f1b",
        help=f"one of: {', '.join(sorted(SCHEDULES))}")  # fmt: skip

    add = parser.add_argument_group("batch").add_argument
    add("--micro-batch-size", type=int, required=True)
    add("--global-batch-size", type=int, default=None, help="default: micro x data parallel")
    add("--train-iters", type=int, required=True)

    add = parser.add_argument_group("optimizer").add_argument
    add("--optimizer", default="adam", choices=["adam", "sgd"])
    add("--lr", type=float, required=True)
    add("--min-lr", type=float, default=0.0)
    add(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
    )
    add("--lr-decay-iters", type=int, default=None)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-warmup-fraction", type=float, default=None)
    add("--weight-decay", type=float, default=0.01)
    add("--clip-grad", type=float, default=1.0)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--adam-eps", type=float, default=1e-8)
    add("--sgd-momentum", type=float, default=0.9)

    add = parser.add_argument_group("data").add_argument
    add("--data-path", nargs="*", default=None, help="prefixes, or 'weight prefix ...' pairs")
    add("--split", default="969,30,1")
    add("--mock-data", action="store_true", help="synthetic tokens (megatron-core MockGPTDataset)")
    add("--tokenizer-type", default="SentencePieceTokenizer",
        choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer"])  # fmt: skip
    add("--tokenizer-model", default=None)
    add("--vocab-file", default=None)
    add("--merge-file", default=None)
    add("--vocab-size", type=int, default=None, help="for NullTokenizer")
    add("--data-cache-path", default=None)

    add = parser.add_argument_group("logging and checkpoints").add_argument
    add("--log-interval", type=int, default=1)
    add("--eval-interval", type=int, default=1000)
    add("--eval-iters", type=int, default=10)
    add("--tensorboard-dir", default=None)
    add("--metrics-dir", default=None, help="write summary.json here when the run ends")
    add("--timeline-file", default=None, help="Chrome trace of every stage's actions")
    add("--save", default=None)
    add("--save-interval", type=int, default=None)
    add("--load", default=None)
    add("--seed", type=int, default=1234)
    add("--deterministic-mode", action="store_true",
        help="reproducible runs: PACI follows the fixed 1F1B order instead of reacting to "
        "arrivals")  # fmt: skip
    add("--paci-arrival-rule", default=None, choices=list(ARRIVAL_RULES),
        help=f"what a PACI stage runs first when it may (default {DEFAULT_ARRIVAL_RULE})")  # fmt: skip

    add = parser.add_argument_group("benchmarking").add_argument
    add("--emulated-forward-ms", type=stage_values, default=None,
        help="replace each stage's forward by a wait of this many ms, or a comma list with one "
        "value per stage (schedule benchmarks)")  # fmt: skip
    add("--emulated-backward-ms", type=stage_values, default=None)
    add("--emulated-noise-cv", type=stage_values, default=0.0,
        help="lognormal noise on each emulated action: CV, or one per stage (seeded by --seed)")  # fmt: skip
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return args


def validate_args(args: argparse.Namespace, *, world_size: int) -> None:
    """Fill defaults that depend on other flags and reject inconsistent ones."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise UserError(
            "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1"
        )
    if world_size % (tp * pp) != 0:
        raise UserError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"{tp} x {pp} = {tp * pp}"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    if args.pipeline_schedule not in SCHEDULES:
        known = ", ".join(sorted(SCHEDULES))
        raise UserError(f"unknown --pipeline-schedule {args.pipeline_schedule!r} (known: {known})")
    _validate_layer_split(args, pp)
    if args.hidden_size % args.num_attention_heads != 0:
        raise UserError("--hidden-size must be divisible by --num-attention-heads")
    if args.num_attention_heads % tp != 0:
        raise UserError("--num-attention-heads must be divisible by --tensor-model-parallel-size")
    for flag in ("micro_batch_size", "train_iters", "seq_length", "log_interval", "eval_interval"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
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
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise UserError("--seq-length exceeds --max-position-embeddings")
    _validate_data_args(args)
    if (args.emulated_forward_ms is None) != (args.emulated_backward_ms is None):
        raise UserError("--emulated-forward-ms and --emulated-backward-ms go together")
    if (
        args.paci_arrival_rule not in (None, DEFAULT_ARRIVAL_RULE)
        and args.pipeline_schedule != "paci"
    ):
        raise UserError("--paci-arrival-rule applies to --pipeline-schedule paci only")
    for flag in ("emulated_forward_ms", "emulated_backward_ms", "emulated_noise_cv"):
        if isinstance(getattr(args, flag), list) and len(getattr(args, flag)) != pp:
            raise UserError(
                f"--{flag.replace('_', '-')}: one value, or one per pipeline stage ({pp})"
            )
    if args.save_interval is not None and args.save is None:
        raise UserError("--save-interval needs --save DIR")


def _validate_layer_split(args: argparse.Namespace, pp: int) -> None:
    uneven = {
        "--decoder-first-pipeline-num-layers": args.decoder_first_pipeline_num_layers,
        "--decoder-last-pipeline-num-layers": args.decoder_last_pipeline_num_layers,
    }
    given = {flag: n for flag, n in uneven.items() if n is not None}
    if not given:
        if args.num_layers % pp != 0:
            raise UserError(
                f"--num-layers {args.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {pp}"
            )
        return
    if pp < 2:
        raise UserError(f"{' and '.join(given)} need a pipeline of at least 2 stages")
    for flag, layers in given.items():
        if layers < 1:
            raise UserError(f"{flag} must be >= 1")
    rest, middle = args.num_layers - sum(given.values()), pp - len(given)
    if rest < middle or (middle and rest % middle) or (not middle and rest):
        raise UserError(
            f"--num-layers {args.num_layers} minus {sum(given.values())} on uneven stages leaves "
            f"{rest}, which does not split evenly over the other {middle} stages"
        )


def _validate_data_args(args: argparse.Namespace) -> None:
    if args.mock_data:
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            raise UserError("NullTokenizer needs --vocab-size")
        return
    if not args.data_path:
        raise UserError("no training data: pass --data-path PREFIX (or --mock-data)")
    from .data import parse_data_path, validate_indexed_dataset

    prefixes, _ = parse_data_path(args.data_path)
    for prefix in prefixes:
        validate_indexed_dataset(prefix)
