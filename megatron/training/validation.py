"""Range and relation checks for numeric flags, output paths, and the devices a flag needs.

`validate_numbers` runs first in `arguments.validate_args`, on the values as the user gave
them (before defaults derived from other flags are filled in), so that a zero, negative or NaN
value ends in one `error: ...` line instead of a division by zero or an assertion deep inside
megatron-core. `check_token_ids` runs once the tokenizer is built: the dataset's largest token
id must fit the tokenizer's vocabulary.
"""

import argparse
import json
import math
import os
import tempfile
from types import SimpleNamespace

import numpy

from megatron.common.errors import UserError

# flag -> smallest accepted value (None: the flag may be absent)
_AT_LEAST_ONE = (
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
    "train_iters", "log_interval", "eval_interval", "distributed_timeout_minutes",
    "make_vocab_size_divisible_by", "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)  # fmt: skip
_AT_LEAST_ONE_IF_GIVEN = (
    "global_batch_size", "ffn_hidden_size", "max_position_embeddings", "lr_decay_iters",
    "save_interval", "vocab_size", "max_consecutive_skips",
)  # fmt: skip
_AT_LEAST_ZERO = ("eval_iters", "lr_warmup_iters", "seed")
# flag -> (low, high, high included): finite floats in a range
_FLOAT_RANGES = {
    "lr": (0.0, math.inf, False),
    "min_lr": (0.0, math.inf, False),
    "decoupled_lr": (0.0, math.inf, False),
    "decoupled_min_lr": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False),
    "clip_grad": (0.0, math.inf, False),
    "init_method_std": (0.0, math.inf, False),
    "attention_dropout": (0.0, 1.0, False),
    "hidden_dropout": (0.0, 1.0, False),
    "adam_beta1": (0.0, 1.0, False),
    "adam_beta2": (0.0, 1.0, False),
    "sgd_momentum": (0.0, math.inf, False),
    "lr_warmup_fraction": (0.0, 1.0, True),
    "emulated_forward_ms": (0.0, math.inf, False),
    "emulated_backward_ms": (0.0, math.inf, False),
    "rendezvous_timeout_seconds": (0.0, math.inf, False),
    "fim_rate": (0.0, 1.0, True),
    "fim_spm_rate": (0.0, 1.0, True),
    "fim_fragment_rate": (0.0, 1.0, True),
}
_FLOAT_HINTS = {"clip_grad": " (0 turns clipping off)"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, and the relations between them, one line each."""
    for name in _AT_LEAST_ONE + _AT_LEAST_ONE_IF_GIVEN + _AT_LEAST_ZERO:
        value = getattr(args, name, None)
        low = 0 if name in _AT_LEAST_ZERO else 1
        if value is not None and value < low:
            raise UserError(f"{flag(name)} must be >= {low}, got {value}")
    for name, (low, high, high_ok) in _FLOAT_RANGES.items():
        _check_float(args, name, low, high, high_ok)
    if not (math.isfinite(args.adam_eps) and args.adam_eps > 0):
        raise UserError(f"--adam-eps must be a positive number, got {args.adam_eps}")
    _check_relations(args)
    _check_devices(args)
    _check_validation_split(args)
    _check_fim(args)
    if getattr(args, "dataloader_type", None) == "external":  # a dataset object, not flags
        raise UserError("--dataloader-type external is not supported yet")


def _check_fim(args) -> None:
    """--fim-data's needs (Megatron asserts the same); its sentinels are checked against the
    tokenizer once it is built (data/fim.py, resolve_token_ids)."""
    if not getattr(args, "fim_data", False):
        return
    if getattr(args, "mock_data", False):
        raise UserError("--fim-data needs --data-path: it does not take --mock-data")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        raise UserError("--fim-split-sample needs --fim-fragment-rate")


def _check_float(args, name: str, low: float, high: float, high_ok: bool) -> None:
    value = getattr(args, name, None)
    if value is None:
        return
    if isinstance(value, list):  # one value per pipeline stage
        for each in value:
            _check_float(SimpleNamespace(**{name: each}), name, low, high, high_ok)
        return
    inside = math.isfinite(value) and low <= value and (value <= high if high_ok else value < high)
    if not inside:
        upper = "" if high == math.inf else f" and {'<=' if high_ok else '<'} {high:g}"
        hint = _FLOAT_HINTS.get(name, "")
        raise UserError(f"{flag(name)} must be a number >= {low:g}{upper}{hint}, got {value}")


def _check_decoupled_lr(args) -> None:
    decoupled, floor = getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    if floor is not None and decoupled is None:
        raise UserError("--decoupled-min-lr needs --decoupled-lr (it is the floor of that LR)")
    floor = args.min_lr if floor is None else floor
    if decoupled is not None and floor > decoupled:
        which = "--decoupled-min-lr" if args.decoupled_min_lr is not None else "--min-lr"
        raise UserError(f"{which} {floor:g} is above --decoupled-lr {decoupled:g}")


def _check_relations(args) -> None:
    if args.min_lr > args.lr:
        raise UserError(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")
    _check_decoupled_lr(args)
    decay_iters = args.lr_decay_iters or args.train_iters
    if decay_iters is None:  # a sample-based run (--train-samples): checked in samples later
        return
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise UserError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
        warmup = int(args.lr_warmup_fraction * decay_iters)
    if warmup >= decay_iters and warmup > 0:
        raise UserError(
            f"{warmup} warmup iterations leave no decay: they must be fewer than the "
            f"{decay_iters} decay iterations (--lr-decay-iters, default --train-iters)"
        )


def _check_devices(args) -> None:
    """Flags that need a GPU fail here, not inside the first CUDA call. (--bf16 and --fp16
    run on CPU too, with torch's CPU kernels.)"""
    if args.distributed_backend != "nccl":
        return
    import torch

    if torch.cuda.is_available():
        return
    raise UserError(
        "--distributed-backend nccl needs a CUDA GPU and this machine has none (use gloo)"
    )


def _check_validation_split(args) -> None:
    """--split is well formed whatever the data (mock data too), and an evaluation the user
    asked for has data to evaluate on."""
    from megatron.training.data.datasets import parse_split

    weights = parse_split(args.split)
    if args.train_iters is None:  # --train-samples: the data builder reports an empty split
        return
    evaluations = args.train_iters // args.eval_interval if args.eval_interval > 0 else 0
    if args.mock_data or not args.eval_iters or not evaluations:
        return
    if len(weights) < 2 or weights[1] <= 0:
        raise UserError(
            f"--split {args.split} leaves no validation data, but --eval-interval "
            f"{args.eval_interval} and --eval-iters {args.eval_iters} ask for evaluation "
            f"(pass --eval-iters 0 to train without it)"
        )


# ---------------------------------------------------------------------------- output paths
OUTPUT_DIRECTORIES = ("save", "metrics_dir", "tensorboard_dir", "data_cache_path", "wandb_save_dir")


def check_output_paths(args: argparse.Namespace) -> None:
    """Every path the run writes to must be writable now, not after the training is done."""
    for name in OUTPUT_DIRECTORIES:
        path = getattr(args, name, None)
        if path:
            _check_writable_directory(flag(name), path)
    if getattr(args, "timeline_file", None):
        path = args.timeline_file
        if os.path.isdir(path):
            raise UserError(f"--timeline-file {path} is a directory, not a file")
        _check_writable_directory("--timeline-file", path, os.path.dirname(os.path.abspath(path)))


def _check_writable_directory(option: str, path: str, directory: str | None = None) -> None:
    """The directory (`path`, or the one `path` is written into) exists and is writable, or
    can be created: its nearest existing ancestor is writable."""
    probe = os.path.abspath(directory or path)
    while not os.path.exists(probe):
        if os.path.islink(probe):  # a dangling link: nothing can be created through it
            raise UserError(
                f"{option} {path}: {probe} is a symbolic link to {os.readlink(probe)}, which "
                "does not exist"
            )
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise UserError(f"{option} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: {probe} is not writable")
    _try_creating_in(option, path, probe)


def _try_creating_in(option: str, path: str, parent: str) -> None:
    """Create (and remove) a directory in `parent`: permission bits do not tell everything
    (root passes `os.access` everywhere, yet nothing can be made under /proc, on a read-only
    mount or a full disk)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=parent))
    except OSError as error:
        raise UserError(
            f"{option} {path}: cannot create a directory in {parent}: {error.strerror}"
        ) from None


# ---------------------------------------------------------------------------- data vs tokenizer
STATS_SUFFIX = ".stats.json"  # written beside .bin/.idx by tools/preprocess_data.py
_SCAN_CHUNK = 1 << 24  # tokens per read when scanning a .bin for its largest id


def largest_token_id(prefix: str, dtype) -> tuple[int, int | None]:
    """(largest token id, vocabulary size the data was tokenized with or None), from the
    statistics preprocess_data.py records, else by scanning the .bin (memory-mapped)."""
    stats_path = prefix + STATS_SUFFIX
    if os.path.isfile(stats_path):
        try:
            stats = json.load(open(stats_path))
            return int(stats["max_token_id"]), stats.get("vocab_size")
        except (ValueError, KeyError, TypeError):
            raise UserError(f"corrupt dataset statistics {stats_path}: remove it or rerun "
                            "tools/preprocess_data.py") from None  # fmt: skip
    tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    largest = -1
    for start in range(0, tokens.size, _SCAN_CHUNK):
        largest = max(largest, int(tokens[start : start + _SCAN_CHUNK].max()))
    return largest, None


def check_token_ids(data_prefixes: list[str], vocab_size: int, padded_vocab_size: int) -> None:
    """Token ids at or above the vocabulary would index past the embedding (an IndexError on
    CPU, a device-side assert on GPU); data made with another tokenizer would train on noise."""
    from megatron.training.data.datasets import read_index_summary

    for prefix in data_prefixes:
        summary = read_index_summary(prefix)
        largest, recorded_vocab = largest_token_id(prefix, summary.dtype)
        if largest >= vocab_size:
            raise UserError(
                f"{prefix}.bin holds token id {largest}, but the tokenizer has only "
                f"{vocab_size} tokens (padded {padded_vocab_size}): the data was made with "
                f"another tokenizer"
            )
        if recorded_vocab is not None and int(recorded_vocab) != vocab_size:
            raise UserError(
                f"{prefix} was tokenized with a {recorded_vocab}-token vocabulary, but the "
                f"tokenizer has {vocab_size}: the data was made with another tokenizer"
            )


# ---------------------------------------------------------------------------- entry points
def add_reliability_args(parser: argparse.ArgumentParser) -> None:
    """Flags for divergence handling and checkpoint fallback."""
    group = parser.add_argument_group("faults")
    group.add_argument("--max-consecutive-skips", type=int, default=10,
                       help="optimizer steps a stage may skip in a row (non-finite gradient "
                       "norm) before the run rolls back to the last good checkpoint at the next "
                       "drain")  # fmt: skip
    group.add_argument("--load-fallback", action="store_true",
                       help="if the newest checkpoint is unreadable, load the newest intact one")  # fmt: skip


def validate_reliability(args: argparse.Namespace) -> None:
    """Called first by `validate_args`: numbers, devices, output paths."""
    validate_numbers(args)
    check_output_paths(args)
