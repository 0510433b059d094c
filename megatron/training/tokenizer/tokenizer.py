"""Tokenizers selected by Megatron's ``--tokenizer-type`` names.

``build_tokenizer`` returns an object that megatron-core's datasets accept as
``GPTDatasetConfig.tokenizer``: they read ``vocab_size``, ``eod``, ``pad`` (``-1``: no padding
token), ``eos`` and ``unique_identifiers`` (hashed into the dataset cache names). The same object
serves ``tools/preprocess_data.py`` (``tokenize``) and humans (``detokenize``).

Types:

- ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``): ``--tokenizer-model``;
  ``eod`` is the model's eos id.
- ``Llama2Tokenizer``: a SentencePiece model as Megatron's Llama-2 tokenizer reads it: every
  text starts with the model's bos id (when it has one), ``eod`` is its eos id, ``pad`` its pad
  id (-1: none).
- ``GPT2BPETokenizer``: ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt), GPT-2's
  byte-level BPE, implemented here; ``eod`` is ``<|endoftext|>``.
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local ``tokenizer.json`` or a directory
  holding one, read with the ``tokenizers`` package (nothing is downloaded); ``eod`` is the
  ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first of ``</s>``,
  ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` in the vocabulary.
- ``TikTokenizer``: a Megatron-format TikToken vocabulary (``--tokenizer-model``, ``.json``)
  run by the ``tiktoken`` package (``pip install -e .[tiktoken]``), ``--tiktoken-pattern``,
  ``--tiktoken-num-special-tokens``, ``--tokenizer-special-tokens``, ``--vocab-size``:
  ``tiktoken_tokenizer.py``.
- ``NullTokenizer``: ``--vocab-size N``; text is whitespace-separated integer ids. As in
  Megatron, ``eod`` is ``N`` and ``vocab_size`` is ``N + 1``.

This module imports neither torch nor megatron-core, so tools that only tokenize start quickly.
"""

import functools
import json
import os
import re
import unicodedata
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.common.errors import UserError
from megatron.training.tokenizer.base import Tokenizer

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
_ALIASES = {"GPTSentencePieceTokenizer": "SentencePieceTokenizer"}


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tiktoken_pattern: Optional[str] = None,
    tiktoken_num_special_tokens: int = 1000,
    special_tokens: Optional[List[str]] = None,
):
    """Build the tokenizer named by ``tokenizer_type`` (Megatron's ``--tokenizer-type``).

    Raises UserError for an unknown type, a missing argument, or a missing/unreadable file.
    """
    kind = _ALIASES.get(tokenizer_type, tokenizer_type)
    if kind == "SentencePieceTokenizer":
        _require(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return SentencePieceTokenizer(tokenizer_model)
    if kind == "Llama2Tokenizer":
        _require(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return Llama2Tokenizer(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        _require(vocab_file, "--vocab-file", tokenizer_type)
        _require(merge_file, "--merge-file", tokenizer_type)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "HuggingFaceTokenizer":
        _require(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return HuggingFaceTokenizer(tokenizer_model)
    if kind == "TikTokenizer":
        _require(tokenizer_model, "--tokenizer-model", tokenizer_type)
        from megatron.training.tokenizer.tiktoken_tokenizer import TikTokenizer

        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens,
                            special_tokens=special_tokens)  # fmt: skip
    if kind == "NullTokenizer":
        _require(vocab_size, "--vocab-size", tokenizer_type)
        return NullTokenizer(vocab_size)
    known = ", ".join(TOKENIZER_TYPES)
    raise UserError(f"unknown --tokenizer-type {tokenizer_type!r} (known: {known})")


# --tokenizer-type's choices (GPTSentencePieceTokenizer: SentencePieceTokenizer's alias)
TOKENIZER_CHOICES = [
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
]


def add_tiktoken_args(group) -> None:
    """TikTokenizer's flags (Megatron's names and defaults), for pretraining and preprocessing."""
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                       help="the word-splitting pattern (default v2)")  # fmt: skip
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="ids before the vocabulary's first rank")  # fmt: skip
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       dest="special_tokens", help="TikTokenizer's named special tokens")  # fmt: skip


def build_tokenizer_of_run(data):
    """`build_tokenizer` with the tokenizer flags of a run (its `DataConfig`)."""
    return build_tokenizer(
        data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        vocab_size=data.vocab_size,
        tiktoken_pattern=data.tiktoken_pattern,
        tiktoken_num_special_tokens=data.tiktoken_num_special_tokens,
        special_tokens=data.special_tokens,
    )


def _require(value, flag: str, tokenizer_type: str) -> None:
    if value is None or value == "":
        raise UserError(f"--tokenizer-type {tokenizer_type} needs {flag}")


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{flag} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {flag} file {path}: {err}") from None


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; ``eod`` is the model's eos id."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        import sentencepiece

        try:
            with open(model_path, "rb") as f:
                proto = f.read()
        except FileNotFoundError:
            raise UserError(f"--tokenizer-model file not found: {model_path}") from None
        except OSError as err:
            raise UserError(f"cannot read --tokenizer-model {model_path}: {err.strerror}") from None
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError, TypeError):
            raise UserError(
                f"--tokenizer-model {model_path} is not a sentencepiece model"
            ) from None
        if self._sp.eos_id() < 0:
            raise UserError(f"--tokenizer-model {model_path} has no eos piece to use as eod")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def vocab(self) -> Dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    def token_to_id(self, token: str) -> Optional[int]:
        # piece_to_id answers the unknown piece's id for a piece it lacks
        token_id = self._sp.piece_to_id(token)
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """A SentencePiece model with Llama-2's framing: each text begins with the bos id."""

    def tokenize(self, text: str) -> List[int]:
        ids = self._sp.encode(text, out_type=int)
        return [self.bos] + ids if self.bos >= 0 else ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self.bos])


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids; ``eod`` is ``vocab_size - 1``.

    Mirrors Megatron: ``NullTokenizer(N)`` has ids ``0..N-1`` for data plus ``N`` for eod.
    """

    def __init__(self, vocab_size: int) -> None:
        try:
            n = int(vocab_size)
        except (TypeError, ValueError):
            raise UserError(f"--vocab-size must be an integer, got {vocab_size!r}") from None
        if n < 1:
            raise UserError(f"--vocab-size must be positive, got {n}")
        super().__init__(vocab_size=n)
        self._n = n

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise UserError(f"NullTokenizer expects integer ids, got {word[:40]!r}") from None
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from a ``vocab.json`` and a ``merges.txt``.

    Text is cut into words by GPT-2's pattern, each word's UTF-8 bytes are mapped to printable
    characters, then adjacent symbols are merged, lowest merge rank first, until no listed pair
    is left; the resulting symbols are looked up in the vocabulary.
    """

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        self.encoder = _load_vocab(vocab_file)
        self.decoder = {i: token for token, i in self.encoder.items()}
        self.ranks = _load_merges(merge_file)
        if self.EOD_TOKEN not in self.encoder:
            raise UserError(f"--vocab-file {vocab_file} has no {self.EOD_TOKEN} token")
        check_merges_match_vocab(self.encoder, self.ranks, vocab_file, merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._pattern = _gpt2_pattern()
        self._cache: Dict[str, Tuple[int, ...]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[self.EOD_TOKEN]

    @property
    def vocab(self) -> Dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self.decoder

    def token_to_id(self, token: str) -> Optional[int]:
        return self.encoder.get(token)

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        for word in self._pattern.findall(text):
            ids.extend(self._word_ids(word))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        symbols = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in symbols).decode("utf-8", errors="replace")

    def _word_ids(self, word: str) -> Tuple[int, ...]:
        cached = self._cache.get(word)
        if cached is None:
            symbols = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            try:
                cached = tuple(self.encoder[s] for s in self.bpe(symbols))
            except KeyError as err:
                raise UserError(
                    f"BPE symbol {err.args[0]!r} is missing from the vocab file"
                ) from None
            self._cache[word] = cached
        return cached

    def bpe(self, symbols: str) -> List[str]:
        """Merge the characters of one byte-encoded word by rank until no merge applies."""
        parts = list(symbols)
        while len(parts) > 1:
            pairs = list(zip(parts, parts[1:]))
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` read from local files with the ``tokenizers`` package."""

    EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        try:
            from tokenizers import Tokenizer as TokenizerFile
        except ImportError:
            raise UserError(
                "--tokenizer-type HuggingFaceTokenizer needs the tokenizers package "
                "(pip install tokenizers)"
            ) from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise UserError(
                f"--tokenizer-model {path}: no tokenizer.json there (local files only; "
                "nothing is downloaded)"
            )
        try:
            self._tokenizer = TokenizerFile.from_file(file)
        except Exception:  # the package raises its own exception types for malformed files
            raise UserError(f"--tokenizer-model {file} is not a tokenizer.json") from None
        self._eod = self._find_eod(os.path.dirname(file))

    def _find_eod(self, directory: str) -> int:
        names = list(self.EOD_CANDIDATES)
        config = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config):
            eos = json.loads(_read_text(config, "tokenizer_config.json")).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names = [eos] + names if eos else names
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise UserError(f"--tokenizer-model {directory}: no end-of-document token ({names})")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Bytes that are printable Latin-1 characters map to themselves; the others (controls,
    space, ...) map, in byte order, to the characters from U+0100 upward.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("\u00a1"), ord("\u00ac") + 1))
    printable |= set(range(ord("\u00ae"), ord("\u00ff") + 1))
    mapping, shifted = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _load_vocab(path: str) -> Dict[str, int]:
    try:
        vocab = json.loads(_read_text(path, "--vocab-file"))
    except json.JSONDecodeError:
        raise UserError(f"--vocab-file {path} is not valid JSON") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UserError(f"--vocab-file {path} must map tokens to integer ids")
    return vocab


def _load_merges(path: str) -> Dict[Tuple[str, str], int]:
    ranks: Dict[Tuple[str, str], int] = {}
    for lineno, line in enumerate(_read_text(path, "--merge-file").split("\n"), start=1):
        if not line.strip() or (lineno == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise UserError(f"--merge-file {path}:{lineno}: expected two symbols, got {line!r}")
        ranks.setdefault((pair[0], pair[1]), len(ranks))
    return ranks


def check_merges_match_vocab(
    vocab: Dict[str, int], ranks: Dict[Tuple[str, str], int], vocab_file: str, merge_file: str
) -> None:
    """A merges file trained with another vocabulary, or reordered, tokenizes without an error
    into many more (and different) tokens, so check the pair belongs together.

    BPE training adds each merge's result to the vocabulary as it makes it: GPT-2's files
    and tools/train_gpt2_bpe.py give merge i the id 256 + i, and vocabularies with special
    tokens first give it base + i. The rule checked: every merge's result is in the
    vocabulary, and results not made by an earlier merge have increasing ids (a result made
    again by a later merge, from another split of the same text, keeps its first id).
    """
    made: set = set()
    last_id, last_merge = -1, None
    for (left, right), rank in ranks.items():
        result = left + right
        merge = f"merge {rank + 1} ({left} {right})"
        if result not in vocab:
            raise UserError(
                f"--merge-file {merge_file} does not belong to --vocab-file {vocab_file}: "
                f"{merge} makes {result!r}, which is not in the vocabulary"
            )
        if result in made:
            continue
        made.add(result)
        if vocab[result] <= last_id:
            raise UserError(
                f"--merge-file {merge_file} does not belong to --vocab-file {vocab_file}: "
                f"{merge} makes id {vocab[result]}, below id {last_id} of {last_merge} before it "
                f"(merges out of order, or trained with another vocabulary)"
            )
        last_id, last_merge = vocab[result], merge


# Planes 4 and up hold no letters or numbers (unassigned, tags, private use).
_LAST_LETTER_OR_NUMBER_PLANE_END = 0x40000


@functools.lru_cache(maxsize=None)
def _gpt2_pattern() -> "re.Pattern[str]":
    """GPT-2's word-splitting regex, with \\p{L} and \\p{N} spelled out for the re module."""
    letters, numbers = _category_classes(("L", "N"))
    return re.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d"
        rf"| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+"
        r"|\s+(?!\S)|\s+"
    )


def _category_classes(majors: Tuple[str, ...]) -> List[str]:
    """For each major Unicode category (``"L"``...), its code points as regex class ranges."""
    # one letter per code point, then each category's runs found by re (in C): 0.07 s a
    # process, against 0.17 s for a Python loop over the 262,144 code points
    table = "".join(unicodedata.category(chr(cp))[0]
                    for cp in range(_LAST_LETTER_OR_NUMBER_PLANE_END))  # fmt: skip
    classes = []
    for major in majors:
        runs = (run.span() for run in re.finditer(f"{re.escape(major)}+", table))
        classes.append("".join(_escape(start) + (f"-{_escape(end - 1)}" if end - 1 > start else "")
                               for start, end in runs))  # fmt: skip
    return classes


def _escape(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"
