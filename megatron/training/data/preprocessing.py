"""Tokenize a jsonl corpus into Megatron indexed datasets (``.bin``/``.idx``).

Megatron's command line: for each ``--json-keys`` key, writes
``{output_prefix}_{key}_document.bin`` and ``.idx`` through megatron-core's
``IndexedDatasetBuilder``, one document per input line, documents in input order whatever
``--workers`` is. Files are written under temporary names and renamed at the end, so an
interrupted run leaves no partial file under the final names.

Example::

    python tools/preprocess_data.py --input data/stdlib.jsonl \\
        --output-prefix data/stdlib --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tokenizer/stdlib.model --append-eod --workers 2

writes ``data/stdlib_text_document.bin`` and ``data/stdlib_text_document.idx``.
"""

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy

from megatron.common.errors import UserError
from megatron.training.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    add_tiktoken_args,
    build_tokenizer,
)
from megatron.training.validation import STATS_SUFFIX

_worker = {}  # per-process state: the tokenizer and what to encode


def _init_worker(tokenizer_kwargs: dict, json_keys, append_eod: bool) -> None:
    _worker["tokenizer"] = build_tokenizer(**tokenizer_kwargs)
    _worker["json_keys"] = list(json_keys)
    _worker["append_eod"] = append_eod


def _encode(item):
    """Tokenize one input line: returns (line number, {key: ids}, bytes read)."""
    lineno, line = item
    tokenizer = _worker["tokenizer"]
    if not line.strip():
        return lineno, None, len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise UserError(f"--input line {lineno} is not valid JSON") from None
    if not isinstance(record, dict):
        raise UserError(f"--input line {lineno} is not a JSON object")
    ids = {}
    for key in _worker["json_keys"]:
        if key not in record:
            raise UserError(f"--input line {lineno} has no key {key!r}")
        text = record[key]
        if text is None:  # a missing document, not the text "None": skipped and counted
            ids[key] = []
            continue
        if not isinstance(text, str):
            raise UserError(
                f"--input line {lineno}: {key!r} is a JSON {type(text).__name__}, not a string"
            )
        doc = tokenizer.tokenize(text)
        if doc and _worker["append_eod"]:
            doc.append(tokenizer.eod)
        ids[key] = doc
    return lineno, ids, len(line.encode("utf-8"))


def _read_lines(path: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            yield lineno, line


def checked_document(ids, lengths, vocab_size: int, dtype, where: str) -> numpy.ndarray:
    """The document as an array of ``dtype``, after checking ids and lengths.

    ``IndexedDatasetBuilder.add_document`` trusts ``lengths``; lengths that do not add up to
    the document corrupt the index (and can hang the dataset build later), so check here.
    """
    array = numpy.asarray(ids, dtype=numpy.int64)
    if array.ndim != 1 or any(n <= 0 for n in lengths) or sum(lengths) != array.size:
        raise UserError(f"{where}: sequence lengths {lengths} do not add up to {array.size}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise UserError(f"{where}: token id {bad} outside the vocabulary [0, {vocab_size})")
    return array.astype(dtype)


class _AtomicDataset:
    """An IndexedDatasetBuilder writing temporary files that ``commit`` renames into place."""

    def __init__(self, prefix: str, dtype) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        suffix = f".tmp-{os.getpid()}"
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        self.tmp_bin, self.tmp_idx = self.bin_path + suffix, self.idx_path + suffix
        self.tmp_stats = prefix + STATS_SUFFIX + suffix
        self.builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0
        self.empty = 0  # empty or null documents, skipped
        self.max_token_id = -1

    def add(self, array: numpy.ndarray) -> None:
        self.builder.add_document(array, [array.size])
        self.documents += 1
        self.tokens += array.size
        self.max_token_id = max(self.max_token_id, int(array.max()))

    def commit(self, vocab_size: int) -> None:
        self.builder.finalize(self.tmp_idx)
        # What training checks the tokenizer against without scanning the .bin.
        stats = {"max_token_id": self.max_token_id, "vocab_size": vocab_size}
        with open(self.tmp_stats, "w") as handle:
            json.dump(stats, handle)
        # Drop the old index first: a crash between the renames then leaves a .bin without an
        # .idx (reported as missing), never a new .bin beside a stale .idx.
        if os.path.exists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self.tmp_bin, self.bin_path)
        os.replace(self.tmp_idx, self.idx_path)
        os.replace(self.tmp_stats, self.prefix + STATS_SUFFIX)

    def discard(self) -> None:
        if not self.builder.data_file.closed:
            self.builder.data_file.close()
        for path in (self.tmp_bin, self.tmp_idx, self.tmp_stats):
            if os.path.exists(path):
                os.remove(path)


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="path to the input jsonl file")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each json line"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, help=", ".join(TOKENIZER_TYPES))
    group.add_argument("--tokenizer-model", default=None, help="sentencepiece model file")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer's ids; TikTokenizer's whole vocabulary")  # fmt: skip
    add_tiktoken_args(group)
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between logs")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers must be positive, got {args.workers}")
    if args.log_interval < 1:
        raise UserError(f"--log-interval must be positive, got {args.log_interval}")
    if os.path.isdir(args.input):
        raise UserError(f"--input {args.input} is a directory, not a jsonl file")
    if not os.path.isfile(args.input):
        raise UserError(f"--input file not found: {args.input}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise UserError(f"--json-keys repeats a key: {args.json_keys}")
    _check_output_directory(args.output_prefix)
    return args


def _check_output_directory(prefix: str) -> None:
    """The directory of ``prefix`` exists and is writable, checked before the tokenizing."""
    out_dir = os.path.dirname(os.path.abspath(prefix))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--output-prefix {prefix}: {out_dir} is a file, not a directory")
    if not os.path.isdir(out_dir):
        raise UserError(f"--output-prefix directory does not exist: {out_dir}")
    # root passes os.access on a read-only directory: writes are also caught in `preprocess`
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UserError(f"--output-prefix directory is not writable: {out_dir}")


@dataclass(frozen=True)
class PreprocessOptions:
    """What `preprocess` reads of the command line, built once from `get_args`'s namespace."""

    input: str  # the jsonl file
    json_keys: tuple[str, ...]  # one dataset per key, no key twice
    tokenizer_type: str
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    vocab_size: int | None
    tiktoken_pattern: str | None  # TikTokenizer
    tiktoken_num_special_tokens: int
    special_tokens: tuple[str, ...] | None
    append_eod: bool
    output_prefix: str
    workers: int  # tokenizer processes (1: tokenize in this process)
    log_interval: int  # documents between progress lines

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PreprocessOptions":
        return cls(
            input=args.input,
            json_keys=tuple(args.json_keys),
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            tiktoken_pattern=args.tiktoken_pattern,
            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
            special_tokens=tuple(args.special_tokens) if args.special_tokens else None,
            append_eod=args.append_eod,
            output_prefix=args.output_prefix,
            workers=args.workers,
            log_interval=args.log_interval,
        )

    def tokenizer_kwargs(self) -> dict:
        """`build_tokenizer`'s arguments (also sent to the worker processes)."""
        return dict(
            tokenizer_type=self.tokenizer_type,
            tokenizer_model=self.tokenizer_model,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            vocab_size=self.vocab_size,
            tiktoken_pattern=self.tiktoken_pattern,
            tiktoken_num_special_tokens=self.tiktoken_num_special_tokens,
            special_tokens=self.special_tokens,
        )


def _file_error(err: OSError, options: PreprocessOptions) -> UserError:
    """An OSError of reading the input or writing the outputs, as one line naming the file."""
    path = err.filename2 or err.filename or options.output_prefix  # a rename: its target
    if path == options.input:
        return UserError(f"cannot read --input {path}: {err.strerror}")
    path = re.sub(r"\.tmp-\d+$", "", str(path))  # the name it was to have, not the temporary one
    prefix = options.output_prefix
    return UserError(f"cannot write {path} (--output-prefix {prefix}): {err.strerror}")


def _log_progress(count: int, n_bytes: int, elapsed: float) -> None:
    elapsed = max(elapsed, 1e-9)
    print(
        f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
        f"{n_bytes / elapsed / 1024 / 1024:.2f} MB/s).",
        file=sys.stderr,
        flush=True,
    )


def preprocess(options: PreprocessOptions) -> list:
    """Tokenize ``options.input`` into one dataset per json key; returns the written datasets."""
    tokenizer_kwargs = options.tokenizer_kwargs()
    tokenizer = build_tokenizer(**tokenizer_kwargs)  # fails early on bad tokenizer arguments
    vocab_size = tokenizer.vocab_size
    init_args = (tokenizer_kwargs, options.json_keys, options.append_eod)
    # Fork the workers before megatron-core (and torch) are imported: lighter processes.
    pool = None
    if options.workers > 1:
        pool = multiprocessing.Pool(options.workers, _init_worker, init_args)
    else:
        _init_worker(*init_args)

    from megatron.core.datasets.indexed_dataset import DType

    dtype = DType.optimal_dtype(vocab_size)
    outputs = {}
    try:
        for key in options.json_keys:
            outputs[key] = _AtomicDataset(f"{options.output_prefix}_{key}_document", dtype)
        lines = _read_lines(options.input)
        encoded = pool.imap(_encode, lines, chunksize=16) if pool else map(_encode, lines)
        start = time.time()
        count, n_bytes = 0, 0
        for lineno, ids, size in encoded:
            n_bytes += size
            if ids is None:
                continue
            for key, doc in ids.items():
                if not doc:
                    outputs[key].empty += 1
                    continue
                where = f"--input line {lineno}, key {key!r}"
                outputs[key].add(checked_document(doc, [len(doc)], vocab_size, dtype, where))
            count += 1
            if count % options.log_interval == 0:
                _log_progress(count, n_bytes, time.time() - start)
        if count == 0:
            raise UserError(f"--input {options.input} has no documents")
        for output in outputs.values():
            output.commit(vocab_size)
    except UnicodeDecodeError:
        raise UserError(f"--input {options.input} is not UTF-8 text") from None
    except OSError as err:  # read-only file system, disk full, a directory in the way
        raise _file_error(err, options) from None
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for output in outputs.values():
            output.discard()
    return list(outputs.values())


def main(argv=None) -> int:
    start = time.time()
    try:
        outputs = preprocess(PreprocessOptions.from_args(get_args(argv)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for output in outputs:
        skipped = f", {output.empty} empty skipped" if output.empty else ""
        print(
            f"Wrote {output.prefix}.bin/.idx: {output.documents} documents, "
            f"{output.tokens} tokens{skipped} ({numpy.dtype(output.builder.dtype).name})"
        )
    print(f"Done in {time.time() - start:.1f} s.")
    return 0
