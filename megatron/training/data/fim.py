"""Fill-in-the-middle (FIM) samples: the transform behind Megatron-LM's ``--fim-data``.

A model trained left to right only ever continues text. FIM teaches it to fill a gap: some
samples are cut into prefix, middle and suffix and reordered so that the middle comes last,
after sentinel tokens that say which part is which (Bavarian et al. 2022, "Efficient Training of
Language Models to Fill in the Middle"). One sample (the ``seq_length + 1`` tokens that
megatron-core's GPTDataset draws) is rearranged as follows:

1. It is cut at every ``--fim-eod-token`` into documents; the eod tokens stay where they are
   and each non-empty document is rearranged on its own.
2. With ``--fim-split-sample TOKEN``, a document holding TOKEN is, with probability
   ``--fim-rate``, cut at every TOKEN into fragments, each rearranged with probability
   ``--fim-fragment-rate`` (TOKEN stays between them). A document without it: as in 3.
3. A document (or fragment) is rearranged with probability ``--fim-rate``: its text (the
   tokenizer's ``detokenize``), unless it starts with ``--fim-no-prefix``, is cut at two
   character positions drawn uniformly from ``0..len(text)`` into prefix, middle and suffix,
   each tokenized again, and laid out, with probability ``--fim-spm-rate`` as SPM, else PSM:

   - PSM: ``<prefix> prefix <suffix> suffix <middle> middle``
   - SPM: ``<prefix> <suffix> suffix <middle> prefix middle``

4. The sentinels (and tokenizing the three parts apart) change the length: the sample is cut
   back to its length, or padded with ``--fim-pad-token``.

The sentinels are looked up by name in the tokenizer's vocabulary (``Tokenizer.token_to_id``);
a name it lacks is an error. (Megatron asks its Hugging Face tokenizer, which answers its
unknown token for a name it lacks: with GPT-2's vocabulary every sentinel is then
``<|endoftext|>``.)

The draws of a sample come from a generator of its own, seeded by the sample's key (the seed,
the split, the dataset, the sample's index), so a sample is the same in every run, after a
resume, and whatever order the samples are read in. (Megatron draws from one generator per
dataset in the order the samples are read.) This module needs neither torch nor
megatron-core; ``fim_dataset.py`` holds the dataset class.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy

from megatron.common.errors import UserError


@dataclass(frozen=True)
class FimSettings:
    """The ``--fim-*`` flags (Megatron's defaults)."""

    rate: float = 0.5
    spm_rate: float = 0.5
    split_sample: Optional[str] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None
    prefix_token: str = "<fim_prefix>"
    middle_token: str = "<fim_middle>"
    suffix_token: str = "<fim_suffix>"
    pad_token: str = "<fim_pad>"
    eod_token: str = "<|endoftext|>"

    @classmethod
    def of_run(cls, data) -> Optional["FimSettings"]:
        """The settings of a run's `DataConfig`; None without ``--fim-data``."""
        if not getattr(data, "fim_data", False):
            return None
        return cls(
            rate=data.fim_rate,
            spm_rate=data.fim_spm_rate,
            split_sample=data.fim_split_sample,
            fragment_rate=data.fim_fragment_rate,
            no_prefix=data.fim_no_prefix,
            prefix_token=data.fim_prefix_token,
            middle_token=data.fim_middle_token,
            suffix_token=data.fim_suffix_token,
            pad_token=data.fim_pad_token,
            eod_token=data.fim_eod_token,
        )


@dataclass(frozen=True)
class FimTokenIds:
    """The ids of the sentinels and separators, resolved once from the tokenizer."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split_sample: Optional[int] = None


def resolve_token_ids(settings: FimSettings, tokenizer) -> FimTokenIds:
    """Each ``--fim-*-token`` (and ``--fim-split-sample``) by name in the tokenizer's vocabulary;
    a UserError, one line naming the flag and the token, for a name the vocabulary lacks."""

    def lookup(flag: str, name: str) -> int:
        token_id = tokenizer.token_to_id(name) if hasattr(tokenizer, "token_to_id") else None
        if token_id is None:
            raise UserError(
                f"{flag} {name!r} is not a token of the tokenizer ({type(tokenizer).__name__}): "
                f"pass a token it has with {flag}, or add {name!r} to its vocabulary (a GPT-2 "
                f"BPE: tools/train_gpt2_bpe.py --special-tokens)"
            )
        return int(token_id)

    split = settings.split_sample
    return FimTokenIds(
        prefix=lookup("--fim-prefix-token", settings.prefix_token),
        middle=lookup("--fim-middle-token", settings.middle_token),
        suffix=lookup("--fim-suffix-token", settings.suffix_token),
        pad=lookup("--fim-pad-token", settings.pad_token),
        eod=lookup("--fim-eod-token", settings.eod_token),
        split_sample=None if split is None else lookup("--fim-split-sample", split),
    )


def fim_layout(prefix, middle, suffix, ids: FimTokenIds, spm: bool) -> numpy.ndarray:
    """The three parts behind their sentinels: SPM if `spm`, else PSM (module docstring)."""
    if spm:
        parts = [[ids.prefix, ids.suffix], suffix, [ids.middle], prefix, middle]
    else:
        parts = [[ids.prefix], prefix, [ids.suffix], suffix, [ids.middle], middle]
    return numpy.concatenate([numpy.asarray(part, dtype=numpy.int64) for part in parts])


def fit_length(tokens: numpy.ndarray, length: int, pad: int) -> numpy.ndarray:
    """`tokens` cut to `length`, or padded to it with `pad`."""
    if len(tokens) >= length:
        return tokens[:length]
    return numpy.concatenate([tokens, numpy.full(length - len(tokens), pad, dtype=numpy.int64)])


def cut_at(tokens: numpy.ndarray, separator: int) -> List[numpy.ndarray]:
    """The pieces of `tokens` between the occurrences of `separator` (one more than there are
    occurrences; a piece may be empty)."""
    cuts = numpy.flatnonzero(tokens == separator)
    starts = numpy.concatenate([[0], cuts + 1])
    ends = numpy.concatenate([cuts, [len(tokens)]])
    return [tokens[start:end] for start, end in zip(starts, ends)]


def join_with(pieces: Sequence[numpy.ndarray], separator: int) -> numpy.ndarray:
    """The inverse of `cut_at`: the pieces with `separator` between each two."""
    parts: List = []
    for index, piece in enumerate(pieces):
        if index:
            parts.append([separator])
        parts.append(piece)
    return numpy.concatenate([numpy.asarray(part, dtype=numpy.int64) for part in parts])


def sample_generator(*key: int) -> numpy.random.Generator:
    """The generator of one sample's draws, from its key (seed, split, dataset, index)."""
    return numpy.random.default_rng([int(part) for part in key])


class FimTransform:
    """One sample's FIM rearrangement (module docstring): ``transform(tokens, rng)``."""

    def __init__(self, settings: FimSettings, tokenizer) -> None:
        if settings.split_sample is not None and settings.fragment_rate is None:
            raise UserError("--fim-split-sample needs --fim-fragment-rate")
        self.settings = settings
        self.tokenizer = tokenizer
        self.ids = resolve_token_ids(settings, tokenizer)

    def __call__(self, tokens: numpy.ndarray, rng: numpy.random.Generator) -> numpy.ndarray:
        """`tokens` rearranged document by document, as long as they were (int64)."""
        tokens = numpy.asarray(tokens, dtype=numpy.int64)
        documents = [
            self._rearrange_document(document, rng) if len(document) else document
            for document in cut_at(tokens, self.ids.eod)
        ]
        return fit_length(join_with(documents, self.ids.eod), len(tokens), self.ids.pad)

    def _rearrange_document(self, document: numpy.ndarray, rng) -> numpy.ndarray:
        split = self.ids.split_sample
        if split is None or not numpy.any(document == split):
            return self.rearrange(document, self.settings.rate, rng)
        # A document of several files (--fim-split-sample between them): the document's draw
        # decides whether any file is rearranged, then each file has its own.
        if rng.random() >= self.settings.rate:
            return document
        fragments = [
            (
                self.rearrange(fragment, self.settings.fragment_rate, rng)
                if len(fragment)
                else fragment
            )
            for fragment in cut_at(document, split)
        ]
        return join_with(fragments, split)

    def rearrange(self, tokens: numpy.ndarray, rate: float, rng) -> numpy.ndarray:
        """With probability `rate`, `tokens` as PSM or SPM (cut at two random characters of
        their text); else (or if the text starts with --fim-no-prefix) unchanged."""
        if rng.random() >= rate:
            return tokens
        text = self.tokenizer.detokenize(tokens)
        no_prefix = self.settings.no_prefix
        if no_prefix is not None and text.startswith(no_prefix):
            return tokens
        low, high = sorted(int(position) for position in rng.integers(0, len(text) + 1, size=2))
        spm = bool(rng.random() < self.settings.spm_rate)
        prefix, middle, suffix = (
            self.tokenizer.tokenize(part) for part in (text[:low], text[low:high], text[high:])
        )
        return fim_layout(prefix, middle, suffix, self.ids, spm)
