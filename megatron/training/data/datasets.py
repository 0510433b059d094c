"""Training data: checks on indexed datasets, Megatron's ``--data-path`` blends, and iterators.

``build_data_iterators`` builds megatron-core's ``GPTDataset`` splits (or ``MockGPTDataset``)
with its ``BlendedMegatronDatasetBuilder`` and wraps each split in a ``MicrobatchIterator`` that
hands out microbatches as dicts of CPU tensors, in the order of Megatron's pretraining sampler.

Run as a module to check dataset files from the shell::

    python -m megatron.training.data.datasets data/stdlib_text_document

torch and megatron-core are imported only by ``build_data_iterators``, so the checks are cheap.
"""

import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatron.common.errors import UserError
from megatron.training.data.cyclic_order import CyclicOrder
from megatron.training.data.fim import FimSettings, resolve_token_ids

# The .idx layout written by megatron-core's IndexedDatasetBuilder (indexed_dataset.py):
# magic, version (<Q, 1), dtype code (<B), sequence count (<Q), document count (<Q), then
# int32 sequence lengths, int64 sequence byte offsets into the .bin, int64 document indices
# (sequence index where each document starts, plus a final one), and for multimodal datasets
# one int8 mode per sequence.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")
_DTYPE_CODES = {
    1: numpy.uint8,
    2: numpy.int8,
    3: numpy.int16,
    4: numpy.int32,
    5: numpy.int64,
    6: numpy.float64,
    7: numpy.float32,
    8: numpy.uint16,
}
_CHECK_CHUNK = 1 << 20  # sequences per vectorized check, to bound memory on huge datasets

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class IndexSummary:
    """What a valid ``.idx`` says about its dataset."""

    path_prefix: str
    dtype: type
    sequences: int
    documents: int
    tokens: int


def validate_indexed_dataset(path_prefix: str) -> None:
    """Raise UserError, naming the file, unless ``path_prefix.idx``/``.bin`` look sound.

    Checks that both files exist, the header (magic, version, dtype code), that the index size
    matches its counts, that document indices are ordered and end at the sequence count, and
    that the sequence offsets are contiguous and end exactly at the ``.bin`` size. Reads the
    header and memory-maps the arrays; nothing from the ``.bin`` but its size.
    """
    read_index_summary(path_prefix)


def read_index_summary(path_prefix: str) -> IndexSummary:
    """Validate like ``validate_indexed_dataset`` and return the dataset's counts."""
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise UserError(f"dataset file not found: {path}")
    bin_size = os.path.getsize(bin_path)
    dtype, n_seq, n_doc = _read_index_header(idx_path)
    tokens = _count_index_tokens(idx_path, dtype, n_seq, n_doc)
    itemsize = numpy.dtype(dtype).itemsize
    if tokens * itemsize != bin_size:
        raise UserError(
            f"dataset {bin_path} has {bin_size} bytes but {idx_path} describes "
            f"{tokens * itemsize} ({tokens} tokens of {numpy.dtype(dtype).name}): "
            f"truncated, or the two files come from different runs"
        )
    return IndexSummary(path_prefix, dtype, n_seq, n_doc - 1, tokens)


def _corrupt(idx_path: str, problem: str) -> UserError:
    return UserError(f"corrupt dataset index {idx_path}: {problem}")


def _read_index_header(idx_path: str) -> Tuple[type, int, int]:
    """The index's (dtype, sequence count, document index count), after checking the header
    and that the file size matches the counts."""
    idx_size = os.path.getsize(idx_path)
    try:
        with open(idx_path, "rb") as f:
            header = f.read(_IDX_HEADER.size)
    except OSError as err:
        raise UserError(f"cannot read dataset index {idx_path}: {err.strerror}") from None
    if len(header) < _IDX_HEADER.size:
        raise _corrupt(idx_path, f"truncated header ({idx_size} bytes)")
    magic, version, code, n_seq, n_doc = _IDX_HEADER.unpack(header)
    if magic != _IDX_MAGIC:
        raise _corrupt(idx_path, "bad magic, not a Megatron indexed dataset")
    if version != 1:
        raise _corrupt(idx_path, f"unsupported version {version}")
    if code not in _DTYPE_CODES:
        raise _corrupt(idx_path, f"unknown dtype code {code}")
    expected = _IDX_HEADER.size + 12 * n_seq + 8 * n_doc
    if idx_size not in (expected, expected + n_seq):
        raise _corrupt(
            idx_path,
            f"{idx_size} bytes, but {n_seq} sequences and {n_doc} document indices need "
            f"{expected} (truncated or overwritten?)",
        )
    if n_doc < 1:
        raise _corrupt(idx_path, "no document indices")
    return _DTYPE_CODES[code], n_seq, n_doc


def _count_index_tokens(idx_path: str, dtype, n_seq: int, n_doc: int) -> int:
    """The number of tokens the index describes, after checking its document indices and that
    its sequence offsets are contiguous (memory-maps the index's arrays)."""
    offset = _IDX_HEADER.size
    lengths = numpy.memmap(idx_path, dtype=numpy.int32, mode="r", offset=offset, shape=(n_seq,))
    offset += 4 * n_seq
    pointers = numpy.memmap(idx_path, dtype=numpy.int64, mode="r", offset=offset, shape=(n_seq,))
    offset += 8 * n_seq
    documents = numpy.memmap(idx_path, dtype=numpy.int64, mode="r", offset=offset, shape=(n_doc,))

    if documents[0] != 0 or documents[-1] != n_seq:
        raise _corrupt(idx_path, f"document indices must run from 0 to {n_seq}")
    if n_doc > 1 and numpy.any(numpy.diff(documents) < 0):
        raise _corrupt(idx_path, "document indices are not in order")

    itemsize = numpy.dtype(dtype).itemsize
    tokens = 0
    for beg in range(0, n_seq, _CHECK_CHUNK):
        chunk = numpy.asarray(lengths[beg : beg + _CHECK_CHUNK], dtype=numpy.int64)
        if chunk.min() < 0:
            raise _corrupt(idx_path, "negative sequence length")
        expected_pointers = (tokens + numpy.cumsum(chunk) - chunk) * itemsize
        if not numpy.array_equal(expected_pointers, pointers[beg : beg + len(chunk)]):
            raise _corrupt(idx_path, "sequence offsets do not match sequence lengths")
        tokens += int(chunk.sum())
    del lengths, pointers, documents
    return tokens


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Parse Megatron's ``--data-path``: ``PREFIX...`` or ``WEIGHT PREFIX WEIGHT PREFIX ...``.

    Returns megatron-core's blend ``(prefixes, weights)``; ``weights`` is None for a plain list
    of prefixes (megatron-core then weights by dataset size).
    """
    items = [str(item).strip() for item in data_path or []]
    if not items or any(not item for item in items):
        raise UserError("--data-path needs at least one dataset prefix")
    weights = [_as_float(item) for item in items[0::2]]
    if len(items) % 2 == 1 or all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        raise UserError(
            "--data-path mixes weights and prefixes: give either PREFIX... "
            "or WEIGHT PREFIX WEIGHT PREFIX..."
        )
    prefixes = items[1::2]
    bad = [p for p in prefixes if _as_float(p) is not None]
    if bad:
        raise UserError(f"--data-path expects a prefix after each weight, got {bad[0]!r}")
    if any(w < 0 or w != w for w in weights) or sum(weights) <= 0:
        raise UserError("--data-path weights must be non-negative with a positive sum")
    return prefixes, weights


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


_SPLIT_NUMBER = re.compile(r"^(\d+(\.\d*)?|\.\d+)$")


def parse_split(split: str) -> List[float]:
    """Parse ``--split`` ("969,30,1"): up to three non-negative weights, normalized."""
    parts = [p.strip() for p in str(split).split(",")]
    if not 1 <= len(parts) <= 3 or not all(_SPLIT_NUMBER.match(p) for p in parts):
        raise UserError(
            f"--split must be up to three non-negative numbers like 969,30,1: {split!r}"
        )
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    total = sum(values)
    if total <= 0:
        raise UserError(f"--split weights must have a positive sum: {split!r}")
    return [v / total for v in values]


def check_batch_token_ids(batch: Dict, vocab_limit: int, dataset=None,
                          samples: Optional[Sequence[int]] = None):  # fmt: skip
    """Stop on a token id outside ``[0, vocab_limit)`` before it reaches the embedding.

    The start-up check trusts the ``.stats.json`` beside each ``.bin``, so a ``.bin`` damaged
    after it was written would otherwise end in an IndexError inside the embedding (a device
    assert on GPU) on the first stage and a lost peer on every other. One min/max over the
    CPU batch per microbatch (no device sync); only on failure are the batch's rows (the
    dataset indices ``samples``, default 0 on) traced back to their dataset and document.
    """
    import torch

    for key in ("tokens", "labels"):  # the labels hold each sample's last token too
        low, high = torch.aminmax(batch[key])
        if int(low) < 0 or int(high) >= vocab_limit:
            if samples is None:
                samples = range(len(batch[key]))
            raise UserError(_describe_bad_batch(batch[key], vocab_limit, dataset, samples))


def _describe_bad_batch(ids, vocab_limit: int, dataset, samples: Sequence[int]) -> str:
    bad_rows = ((ids < 0) | (ids >= vocab_limit)).any(dim=1).nonzero().flatten().tolist()
    row = bad_rows[0]
    found = locate_bad_tokens(dataset, samples[row], vocab_limit) if dataset else None
    outside = f"outside the padded vocabulary of {vocab_limit} tokens"
    cause = "(the file is damaged or was tokenized with another tokenizer)"
    if found is None:  # not a GPT dataset on indexed files (mock data, a custom dataset)
        values = ids[row]
        bad = int(values[(values < 0) | (values >= vocab_limit)][0])
        return f"sample {samples[row]} holds token id {bad}, {outside} {cause}"
    prefix, document, bad = found
    return f"{prefix}.bin: document {document} holds token id {bad}, {outside} {cause}"


def locate_bad_tokens(dataset, sample: int, vocab_limit: int) -> Optional[Tuple[str, int, int]]:
    """(path prefix, document, token id) of the first token id outside ``[0, vocab_limit)``
    in ``dataset[sample]``, for megatron-core's GPTDataset and BlendedDataset of them; None
    for other datasets or if the sample's tokens are all in range."""
    while hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):  # a blend
        part = int(dataset.dataset_index[sample])
        sample, dataset = int(dataset.dataset_sample_index[sample]), dataset.datasets[part]
    needed = ("shuffle_index", "sample_index", "document_index", "dataset")
    if any(getattr(dataset, name, None) is None for name in needed):
        return None
    indexed = dataset.dataset
    if not hasattr(indexed, "path_prefix"):  # MockGPTDataset's in-memory documents
        return None
    # The walk of GPTDataset.__getitem__: the shuffled sample spans documents beg..end of the
    # document index, from an offset in the first to an offset in the last.
    extra = int(dataset.config.add_extra_token_to_sequence)
    shuffled = int(dataset.shuffle_index[sample])
    beg, beg_offset = (int(v) for v in dataset.sample_index[shuffled])
    end, end_offset = (int(v) for v in dataset.sample_index[shuffled + 1])
    for i in range(beg, end + 1):
        sequence = int(dataset.document_index[i])
        offset = beg_offset if i == beg else 0
        length = end_offset - offset + extra if i == end else None
        part = numpy.asarray(indexed.get(sequence, offset=offset, length=length), numpy.int64)
        bad = part[(part < 0) | (part >= vocab_limit)]
        if bad.size:
            # megatron-core's "documents" are the .idx's sequences: name the user's document
            document = int(numpy.searchsorted(indexed.document_indices, sequence, "right")) - 1
            return indexed.path_prefix, document, int(bad[0])
    return None


def microbatch_pieces(iterator, pieces: int):
    """Each microbatch of ``iterator`` as ``pieces`` microbatches, cut along the batch."""
    for batch in iterator:
        cut = {key: value.chunk(pieces) for key, value in batch.items()}
        for piece in range(pieces):
            yield {key: parts[piece] for key, parts in cut.items()}


@dataclass(frozen=True)
class Reading:
    """How the iterators read the splits: ``dataloader_type`` "single" (one pass in order) or
    "cyclic" (Megatron's random order, epoch after epoch without end: cyclic_order.py, with
    ``data_sharding`` its two ways), and the valid/test micro-batch (None: training's)."""

    dataloader_type: str = "single"
    data_sharding: bool = True
    eval_micro_batch_size: Optional[int] = None


class MicrobatchIterator:
    """Microbatches of one data-parallel rank, in Megatron's pretraining-sampler order.

    Microbatch ``j`` is samples ``[b + rank * mbs, b + (rank + 1) * mbs)`` with
    ``b = start + j * mbs * dp``: every global batch covers the same samples whatever the
    data-parallel size. Only whole ``mbs * dp`` rows are used. When ``cycle`` is set the
    iterator starts over at sample 0 after the last whole row (for evaluation), otherwise it
    stops there. ``next_sample`` is the first sample of the next row (for checkpointing).
    With ``order`` (``--dataloader-type cyclic``, cyclic_order.py) the rows are that order's,
    epoch after epoch without end; ``next_sample`` counts the samples read by all ranks.
    With ``vocab_limit`` (the padded vocabulary), every microbatch's token ids are checked
    against it (``check_batch_token_ids``).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        start_sample: int = 0,
        cycle: bool = False,
        vocab_limit: Optional[int] = None,
        order: Optional[CyclicOrder] = None,
    ) -> None:
        self.dataset = dataset
        self.order = order
        self.vocab_limit = vocab_limit
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.cycle = cycle
        self.row = micro_batch_size * data_parallel_size
        self.num_samples = len(dataset)
        if cycle and order is None and self.row <= self.num_samples:
            # `start_sample` samples read from the start, starting over after the last whole row
            start_sample %= self.num_samples - self.num_samples % self.row
        self.next_sample = start_sample

    def __iter__(self) -> "MicrobatchIterator":
        return self

    def __next__(self) -> Dict[str, "torch.Tensor"]:  # noqa: F821
        if self.order is not None:
            samples = self.order.microbatch(self.next_sample)
        else:
            if self.next_sample + self.row > self.num_samples:
                if not self.cycle or self.row > self.num_samples:
                    raise StopIteration
                self.next_sample = 0
            first = self.next_sample + self.data_parallel_rank * self.micro_batch_size
            samples = range(first, first + self.micro_batch_size)
        self.next_sample += self.row
        batch = self.collate([self.dataset[i] for i in samples])
        if self.vocab_limit is not None:
            check_batch_token_ids(batch, self.vocab_limit, self.dataset, samples=samples)
        return batch

    @staticmethod
    def collate(samples: List[Dict]) -> Dict[str, "torch.Tensor"]:  # noqa: F821
        import torch

        keys = BATCH_KEYS + (("attention_mask",) if "attention_mask" in samples[0] else ())
        return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def data_iterators_of_run(
    config,
    tokenizer,
    *,
    train_samples: int,
    valid_samples: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
):
    """`build_data_iterators` for a run (`RunConfig`: its data source or mock data, split,
    sample options, sequence length, seed and micro batch); (train, valid). Their batches are
    checked against the model's padded vocabulary."""
    data, source = config.data, config.data.source
    train, valid, _ = build_data_iterators(
        data_path=source and source.data_path,
        per_split=source and source.per_split,
        sample_options=dict(
            eod_mask_loss=data.eod_mask_loss,
            reset_position_ids=data.reset_position_ids,
            reset_attention_mask=data.reset_attention_mask,
            fim=FimSettings.of_run(data),
        ),
        mock_data=data.mock_data,
        split=data.split,
        seq_length=config.model.seq_length,
        seed=config.training.seed,
        tokenizer=tokenizer,
        data_cache_path=data.data_cache_path,
        micro_batch_size=config.training.micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        train_samples=train_samples,
        valid_samples=valid_samples,
        test_samples=0,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples,
        vocab_limit=config.model.padded_vocab_size,
        reading=Reading(data.dataloader_type, data.data_sharding, config.training.eval_batch[1]),
    )
    return train, valid


def _checked_blends(data_path, per_split, mock_data: bool, split: str):
    """(blend, per-split blends, split) for megatron-core, each dataset file checked first."""
    if per_split is not None:
        blend_per_split = [parse_data_path(paths) if paths else None for paths in per_split]
        for prefixes in (b[0] for b in blend_per_split if b is not None):
            for prefix in prefixes:
                validate_indexed_dataset(prefix)
        return None, blend_per_split, None  # megatron-core: per-split blends take no --split
    if mock_data:
        return None, None, split
    parse_split(split)
    blend = parse_data_path(data_path)
    for prefix in blend[0]:
        _check_splits_have_tokens(prefix, split)
    return blend, None, split


def build_data_iterators(
    *,
    data_path: Optional[List[str]],
    mock_data: bool,
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    data_cache_path: Optional[str],
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    vocab_limit: Optional[int] = None,
    per_split: Optional[List[Optional[List[str]]]] = None,
    sample_options: Optional[Dict] = None,
    reading: Optional[Reading] = None,
):
    """Build (train, valid, test) ``MicrobatchIterator`` s over megatron-core GPT datasets.

    ``per_split``: one blend per split instead of ``data_path`` split by ``split`` (None for a
    split without data). ``sample_options``: megatron-core's ``eod_mask_loss`` /
    ``reset_position_ids`` (default off), ``fim`` (FimSettings: fim_dataset.py).

    Each split is built for at least the requested number of samples; a split not requested
    (0 samples) or left empty by ``--split`` gives None. Microbatches are dicts of CPU tensors
    ``[micro_batch_size, seq_length]``: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``.
    Training starts at ``consumed_train_samples`` and stops at the end; valid/test cycle,
    valid from ``consumed_valid_samples`` on (evaluations read on where the last stopped, also
    after a resume, as Megatron's do).
    ``reading``: the order (``Reading``) and evaluation's micro-batch. With ``vocab_limit``,
    token ids must be below it.

    Under torch.distributed every rank must call this (megatron-core's builder holds barriers
    on the default group); rank 0 writes the index cache (``data_cache_path``) first.
    """
    sizes = [train_samples, valid_samples, test_samples]
    consumed = (consumed_train_samples, consumed_valid_samples)
    _check_iterator_arguments(
        data_path=data_path or per_split, mock_data=mock_data, seq_length=seq_length,
        tokenizer=tokenizer, micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size,
        sizes=sizes, consumed=consumed,
    )  # fmt: skip
    blend, blend_per_split, split = _checked_blends(data_path, per_split, mock_data, split)
    datasets = _build_datasets(
        (blend, blend_per_split), split, seq_length, seed, tokenizer, data_cache_path, sizes,
        sample_options or {},
    )  # fmt: skip

    common = dict(micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                  data_parallel_size=data_parallel_size, vocab_limit=vocab_limit)  # fmt: skip
    return _split_iterators(datasets, sizes, split, consumed, common, reading)


def _check_iterator_arguments(
    *,
    data_path,
    mock_data: bool,
    seq_length: int,
    tokenizer,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    sizes: List[int],
    consumed: tuple[int, int],
) -> None:
    """Reject the arguments of ``build_data_iterators`` that cannot build iterators."""
    _check_positive(seq_length=seq_length, micro_batch_size=micro_batch_size)
    _check_positive(data_parallel_size=data_parallel_size)
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise UserError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
    if any(n < 0 for n in (*sizes, *consumed)):
        raise UserError(f"sample counts must be non-negative: {sizes}, consumed {consumed}")
    if mock_data and data_path:
        raise UserError("--mock-data and --data-path are mutually exclusive")
    if not mock_data and not data_path:
        raise UserError("no training data: give --data-path PREFIX or --mock-data")
    if tokenizer is None:
        raise UserError("a tokenizer is needed to build the datasets")


def _split_iterators(datasets, sizes, split: str, consumed: tuple[int, int], common: dict,
                     reading: Optional[Reading]):  # fmt: skip
    """(train, valid, test) iterators over the split datasets: None for a split not requested
    (0 samples) or left empty by ``--split`` (an error for the training split). ``consumed``:
    the training and validation samples read before (a resumed run's)."""
    reading = reading or Reading()
    data_parallel_size = common["data_parallel_size"]
    names = ("train", "valid", "test")
    iterators = []
    for name, dataset, samples in zip(names, datasets, sizes):
        micro_batch_size = common["micro_batch_size"]
        if name != "train" and reading.eval_micro_batch_size is not None:
            micro_batch_size = reading.eval_micro_batch_size
        mine = dict(common, micro_batch_size=micro_batch_size)
        if samples == 0:
            iterators.append(None)
            continue
        if dataset is None:
            if name == "train":
                raise UserError(f"--split {split!r} leaves no data for the training split")
            iterators.append(None)
            continue
        if len(dataset) < micro_batch_size * data_parallel_size:
            raise UserError(
                f"the {name} split has {len(dataset)} samples, fewer than one micro-batch on "
                f"every data-parallel rank ({micro_batch_size} x {data_parallel_size})"
            )
        order = None
        if reading.dataloader_type == "cyclic":
            ranks = (common["data_parallel_rank"], data_parallel_size)
            order = CyclicOrder(len(dataset), micro_batch_size, *ranks, reading.data_sharding)
        if name == "train":
            iterators.append(MicrobatchIterator(
                dataset, start_sample=consumed[0], order=order, **mine
            ))  # fmt: skip
        else:
            start = consumed[1] if name == "valid" else 0
            iterators.append(MicrobatchIterator(dataset, start_sample=start, cycle=True,
                                                order=order, **mine))  # fmt: skip
    return tuple(iterators)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise UserError(f"{name} must be positive, got {value}")


def _check_splits_have_tokens(prefix: str, split: str) -> None:
    """Validate the files, and that no split of them is empty.

    megatron-core would loop forever building the index of a split without tokens. The split
    bounds are computed by megatron-core's own functions, as its builder does.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    summary = read_index_summary(prefix)
    n = summary.sequences
    lengths = numpy.memmap(
        prefix + ".idx", dtype=numpy.int32, mode="r", offset=_IDX_HEADER.size, shape=(n,)
    )
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, bounds in zip(("train", "valid", "test"), matrix):
        if bounds is None:
            continue
        first, last = int(round(bounds[0] * float(n))), int(round(bounds[1] * float(n)))
        if int(numpy.sum(lengths[first:last], dtype=numpy.int64)) == 0:
            raise UserError(
                f"--split {split!r} leaves the {name} split of {prefix} without tokens "
                f"({summary.documents} documents): use more data or change --split"
            )
    del lengths


def _build_datasets(blends, split, seq_length, seed, tokenizer, data_cache_path, sizes, options):
    """megatron-core's GPT datasets for `blends` = (blend, blend_per_split), both None: mock
    data; `options`: GPTDatasetConfig's per-sample settings, and `fim` (FimSettings or None)."""
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    blend, blend_per_split = blends
    blended = [b for b in ([blend] + (blend_per_split or [])) if b is not None]
    if (
        any(len(b[0]) > 1 or b[1] is not None for b in blended)
        and data_cache_path
        and not torch.distributed.is_initialized()
    ):
        # megatron-core 0.16.1's BlendedDataset asks torch.distributed for the rank when it
        # misses its cache, which fails without a process group: build it uncached instead.
        data_cache_path = None

    config_class, dataset_class, fim_fields = _gpt_dataset_classes(
        options.get("fim"), tokenizer, blended
    )
    config = config_class(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=options.get("reset_position_ids", False),
        reset_attention_mask=options.get("reset_attention_mask", False),
        eod_mask_loss=options.get("eod_mask_loss", False),
        create_attention_mask=options.get("reset_attention_mask", False),
        **fim_fields,
    )
    # A split asked for no samples is not built: megatron-core would still shuffle a whole
    # epoch of it (about a third of a small run's set-up). Each split draws its own indices, so
    # the others are the same either way.
    for i, samples in enumerate(sizes):
        if samples == 0:
            if config.split_matrix is not None:
                config.split_matrix[i] = None
            if config.blend_per_split is not None:
                config.blend_per_split[i] = None
    cls = MockGPTDataset if not blended else dataset_class
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def _gpt_dataset_classes(fim: Optional[FimSettings], tokenizer, blended: list):
    """(config class, dataset class, the config's extra fields): megatron-core's GPTDataset,
    or with ``--fim-data`` our GPTFIMDataset (its sentinels checked first, one line each)."""
    if fim is None:
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        return GPTDatasetConfig, GPTDataset, {}
    from megatron.training.data.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

    if not blended:
        raise UserError("--fim-data needs --data-path: it does not take --mock-data")
    resolve_token_ids(fim, tokenizer)  # a missing sentinel fails here, before any index
    return GPTFIMDatasetConfig, GPTFIMDataset, {"fim": fim}


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron.training.data.datasets PREFIX...``: check datasets and print their sizes."""
    import argparse

    parser = argparse.ArgumentParser(description="Check Megatron indexed datasets (.bin/.idx).")
    parser.add_argument("prefixes", nargs="+", help="dataset path prefixes (without .bin/.idx)")
    args = parser.parse_args(argv)
    try:
        for prefix in args.prefixes:
            s = read_index_summary(prefix)
            print(
                f"{prefix}: ok, {s.documents} documents, {s.sequences} sequences, "
                f"{s.tokens} tokens ({numpy.dtype(s.dtype).name})"
            )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
