"""Where the training data comes from and how samples are shaped, under Megatron's data flags.

* one blend split by `--split`: `--data-path PREFIX...` or `WEIGHT PREFIX ...`, or the same
  text in a file, `--data-args-path FILE`;
* one blend per split: `--train-data-path`, `--valid-data-path`, `--test-data-path`, or a
  JSON file `{"train": ..., "valid": ..., "test": ...}`, `--per-split-data-args-path FILE`
  (`--split` is then not used, as in Megatron);
* per-sample options of megatron-core's GPT dataset: `--eod-mask-loss` (no loss on
  end-of-document tokens), `--reset-position-ids` (positions restart after each end of
  document), `--reset-attention-mask` (attention within each document only: the dataset's
  per-sample mask goes with the batch to the core attention).

The result is megatron-core's blend configuration (`blend` or `blend_per_split` of its
`BlendedMegatronDatasetConfig`). The "data" group's flags live here too (`add_data_args`):
`--data-path`, `--split`, `--mock-data`, the tokenizer's, the data loader's and
fill-in-the-middle's (fim.py).
"""

import argparse
import json
from dataclasses import dataclass
from typing import List, Optional

from megatron.common.errors import UserError
from megatron.training.tokenizer.tokenizer import TOKENIZER_CHOICES, add_tiktoken_args

SPLITS = ("train", "valid", "test")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def add_data_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("data").add_argument
    add("--data-path", nargs="*", default=None, help="prefixes, or 'weight prefix ...' pairs")
    add("--split", default="969,30,1")
    add("--mock-data", action="store_true", help="synthetic tokens (megatron-core MockGPTDataset)")
    add("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_CHOICES)
    add("--tokenizer-model", default=None)
    add("--vocab-file", default=None)
    add("--merge-file", default=None)
    add("--vocab-size", type=int, default=None,
        help="NullTokenizer's ids; TikTokenizer's whole vocabulary (default 2**17)")  # fmt: skip
    add_tiktoken_args(parser.add_argument_group("TikTokenizer"))
    add("--data-cache-path", default=None)
    add("--dataloader-type", default=None, choices=("single", "cyclic", "external"),
        help="single (default): one pass in order; cyclic: random order, epoch after epoch")  # fmt: skip
    add("--no-data-sharding", action="store_false", dest="data_sharding",
        help="cyclic: one permutation of the data dealt to all ranks, not a bucket per rank")  # fmt: skip
    _add_fim_args(parser)


def _add_fim_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's fill-in-the-middle flags (names and defaults): data/fim.py."""
    add = parser.add_argument_group("fill-in-the-middle (data/fim.py)").add_argument
    add("--fim-data", action="store_true", help="rearrange samples for fill-in-the-middle")
    add("--fim-rate", type=float, default=0.5, help="the share of samples rearranged")
    add("--fim-spm-rate", type=float, default=0.5,
        help="the share of rearranged samples laid out SPM (the rest PSM)")  # fmt: skip
    add("--fim-split-sample", default=None,
        help="a token between the files of a document: each file rearranged on its own")  # fmt: skip
    add("--fim-fragment-rate", type=float, default=None,
        help="with --fim-split-sample: the share of files rearranged")  # fmt: skip
    add("--fim-no-prefix", default=None, help="leave text that starts with this as it is")
    add("--fim-prefix-token", default="<fim_prefix>")
    add("--fim-middle-token", default="<fim_middle>")
    add("--fim-suffix-token", default="<fim_suffix>")
    add("--fim-pad-token", default="<fim_pad>")
    add("--fim-eod-token", default="<|endoftext|>",
        help="the token between documents (each rearranged on its own)")  # fmt: skip


def add_data_source_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("data sources and sample options").add_argument
    add("--data-args-path", default=None,
        help="a file holding the --data-path value (prefixes, or 'weight prefix' pairs)")  # fmt: skip
    add("--train-data-path", nargs="*", default=None, help="the training split's blend")
    add("--valid-data-path", nargs="*", default=None, help="the validation split's blend")
    add("--test-data-path", nargs="*", default=None, help="the test split's blend")
    add("--per-split-data-args-path", default=None,
        help='a JSON file {"train": ..., "valid": ..., "test": ...} of per-split blends')  # fmt: skip
    add("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    add("--reset-position-ids", action="store_true",
        help="position ids restart after each end-of-document token")  # fmt: skip
    add("--reset-attention-mask", action="store_true",
        help="tokens attend only within their document (a per-sample attention mask)")  # fmt: skip


@dataclass
class DataSource:
    """megatron-core's blend settings: `data_path` (split by --split) or `per_split` (three
    lists of prefixes or weight/prefix pairs, None for a split without data)."""

    data_path: Optional[List[str]] = None
    per_split: Optional[List[Optional[List[str]]]] = None


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as error:
        raise UserError(f"{flag} {path}: {error.strerror}") from None


def data_source(args: argparse.Namespace) -> DataSource:
    """The blend the flags ask for; one line on conflicting or unreadable ones."""
    given = {flag: getattr(args, flag[2:].replace("-", "_"), None)
             for flag in PER_SPLIT_FLAGS + ("--per-split-data-args-path", "--data-path",
                                            "--data-args-path")}  # fmt: skip
    per_split_given = [flag for flag in PER_SPLIT_FLAGS + ("--per-split-data-args-path",)
                       if given[flag] is not None]  # fmt: skip
    single_given = [f for f in ("--data-path", "--data-args-path") if given[f] is not None]
    if len(single_given) > 1:
        raise UserError("--data-path and --data-args-path exclude each other")
    if single_given and per_split_given:
        raise UserError(f"{single_given[0]} and {per_split_given[0]} exclude each other")
    if "--per-split-data-args-path" in per_split_given and len(per_split_given) > 1:
        raise UserError(f"--per-split-data-args-path and {per_split_given[0]} exclude each other")
    if given["--data-args-path"] is not None:
        return DataSource(data_path=_read(given["--data-args-path"], "--data-args-path").split())
    if given["--per-split-data-args-path"] is not None:
        return DataSource(per_split=_per_split_file(given["--per-split-data-args-path"]))
    if per_split_given:
        return DataSource(per_split=[given[flag] or None for flag in PER_SPLIT_FLAGS])
    return DataSource(data_path=given["--data-path"])


def _per_split_file(path: str) -> List[Optional[List[str]]]:
    flag = "--per-split-data-args-path"
    try:
        content = json.loads(_read(path, flag))
    except ValueError as error:
        raise UserError(f"{flag} {path}: not JSON ({error})") from None
    if not isinstance(content, dict) or any(name not in content for name in SPLITS):
        raise UserError(f'{flag} {path}: needs an object with "train", "valid" and "test"')
    per_split = []
    for name in SPLITS:
        value = content[name]
        per_split.append((value.split() if isinstance(value, str) else list(value)) or None)
    return per_split


def prefixes_of(source: DataSource) -> List[str]:
    """Every dataset prefix the source reads (for file and token checks)."""
    from megatron.training.data.datasets import parse_data_path

    if source.per_split is None:
        return parse_data_path(source.data_path)[0] if source.data_path else []
    return [prefix for paths in source.per_split if paths for prefix in parse_data_path(paths)[0]]


def validate_data_source(args: argparse.Namespace) -> None:
    """Every prefix's files are sound, and training has data."""
    from megatron.training.data.datasets import validate_indexed_dataset

    source = data_source(args)
    if source.per_split is not None and not source.per_split[0]:
        raise UserError('no training data: --train-data-path (or the file\'s "train") is empty')
    if source.per_split is None and not source.data_path:
        raise UserError("no training data: pass --data-path PREFIX (or --mock-data)")
    evaluations = args.eval_iters and args.train_iters and args.train_iters // args.eval_interval
    if source.per_split is not None and not source.per_split[1] and evaluations:
        raise UserError(
            f"no validation data (--valid-data-path), but --eval-interval {args.eval_interval} "
            f"and --eval-iters {args.eval_iters} ask for evaluation (pass --eval-iters 0 to "
            "train without it)"
        )
    for prefix in prefixes_of(source):
        validate_indexed_dataset(prefix)


def validate_data_args(args: argparse.Namespace, *, check_files: bool = True) -> None:
    """With --mock-data, NullTokenizer's vocabulary size; else (`check_files`) the data files."""
    if args.mock_data:
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            raise UserError("NullTokenizer needs --vocab-size")
        return
    if check_files:
        validate_data_source(args)


def validate_sample_options(args: argparse.Namespace) -> None:
    """--reset-attention-mask: the mask travels with the batch, which only the first and the
    last stage read, into our SDPA core attention; one line where that does not hold."""
    if not getattr(args, "reset_attention_mask", False):
        return
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if args.pipeline_model_parallel_size > 2 or chunks > 1:
        raise UserError(
            "--reset-attention-mask with pipeline stages that read no batch (more than 2 "
            "stages, or virtual stages) is not supported yet"
        )
    if args.emulated_forward_ms is not None:
        raise UserError("--reset-attention-mask needs the model, not emulated compute")
    import importlib.util

    import torch

    te_attention = (args.transformer_impl == "transformer_engine" and torch.cuda.is_available()
                    and importlib.util.find_spec("transformer_engine") is not None)  # fmt: skip
    if te_attention:
        raise UserError(
            "--reset-attention-mask with Transformer Engine's attention is not supported yet "
            "(add --transformer-impl local)"
        )
