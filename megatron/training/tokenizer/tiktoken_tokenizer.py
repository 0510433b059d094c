"""Megatron's ``TikTokenizer``: a byte-level BPE run by the ``tiktoken`` package from a vocabulary
file in Megatron's format (``tiktoken_vocab.py`` writes one from the GPT-2 style BPE that
``tools/train_gpt2_bpe.py`` trains on our corpus, so everything runs offline).

The file (``--tokenizer-model``, ``.json``) is a list of ``{"rank": i, "token_bytes": base64,
"token_str": text}`` in rank order, the first 256 the single bytes 0..255. Ids as Megatron
assigns them: ``--tiktoken-num-special-tokens`` (1000) special tokens first, ``<unk> <s> </s>
<mask> <pad> <cls> <sep>`` (or ``--tokenizer-special-tokens``, which must hold those) then
``<SPECIAL_k>`` fillers, and rank r at id r + that count; ranks past ``--vocab-size`` (default
2**17) minus the specials are cut. ``eod`` is ``</s>``, ``pad`` is ``<pad>``. The words are
split by Megatron's ``--tiktoken-pattern`` ``v1`` or ``v2`` (the default).
"""

import base64
import json
from typing import Dict, List, Optional, Sequence

from megatron.common.errors import UserError
from megatron.training.tokenizer.base import Tokenizer

# Megatron-LM's word-splitting patterns (the format's contract, as its tokenizer defines them).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
DEFAULT_VOCAB_SIZE = 2**17


def read_ranks(path: str, max_ranks: int) -> Dict[bytes, int]:
    """The file's first `max_ranks` tokens -> rank; UserError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except FileNotFoundError:
        raise UserError(f"--tokenizer-model file not found: {path}") from None
    except (OSError, ValueError) as error:
        raise UserError(f"--tokenizer-model {path} is not a TikToken vocabulary: {error}") from None
    if not isinstance(entries, list) or len(entries) < 256:
        raise UserError(f"--tokenizer-model {path}: expected a list of at least 256 tokens")
    ranks = {}
    for index, entry in enumerate(entries[:max_ranks]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise UserError(f"--tokenizer-model {path}: entry {index} is not "
                            "{rank, token_bytes, token_str}")  # fmt: skip
        token = base64.b64decode(entry["token_bytes"])
        if entry["rank"] != index or (index < 256 and token != bytes([index])) or token in ranks:
            raise UserError(f"--tokenizer-model {path}: entry {index} is out of order (rank "
                            f"{entry['rank']}, the first 256 are the bytes 0..255)")  # fmt: skip
        ranks[token] = index
    return ranks


def special_token_list(special_tokens: Optional[List[str]], count: int, vocab_size: int):
    """Megatron's special tokens: the given (or default) ones, then fillers up to `count`."""
    tokens = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing or len(set(tokens)) != len(tokens):
        raise UserError(f"--tokenizer-special-tokens must hold {' '.join(SPECIAL_TOKENS)} once "
                        f"each (missing: {' '.join(missing) or 'none'})")  # fmt: skip
    if not len(tokens) <= count < vocab_size:
        raise UserError(f"--tiktoken-num-special-tokens {count} must be at least the "
                        f"{len(tokens)} special tokens and below --vocab-size {vocab_size}")  # fmt: skip
    return tokens + [f"<SPECIAL_{i}>" for i in range(len(tokens), count)]


class TikTokenizer(Tokenizer):
    """`tiktoken` over a Megatron-format vocabulary file (module docstring)."""

    def __init__(self, path: str, *, pattern: Optional[str] = None, vocab_size=None,
                 num_special_tokens: int = 1000, special_tokens=None) -> None:  # fmt: skip
        import tiktoken

        pattern, vocab_size = pattern or "v2", vocab_size or DEFAULT_VOCAB_SIZE
        if pattern not in PATTERNS:
            raise UserError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        super().__init__(path, pattern=pattern, vocab_size=vocab_size,
                         num_special_tokens=num_special_tokens, special_tokens=special_tokens)  # fmt: skip
        self._specials = special_token_list(special_tokens, num_special_tokens, vocab_size)
        ranks = read_ranks(path, vocab_size - num_special_tokens)
        self._offset, self._vocab_size = num_special_tokens, vocab_size
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._model = tiktoken.Encoding(name="megatron-tiktoken", pat_str=PATTERNS[pattern],
                                        mergeable_ranks=shifted, special_tokens={})  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._specials.index("</s>")

    @property
    def bos(self) -> int:
        return self._specials.index("<s>")

    @property
    def pad(self) -> int:
        return self._specials.index("<pad>")

    def token_to_id(self, token: str) -> Optional[int]:
        """The special tokens are looked up by name (the ranks are byte strings, not names)."""
        return self._specials.index(token) if token in self._specials else None

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode(text, disallowed_special=())

    def detokenize(self, ids: Sequence[int]) -> str:
        pieces = [self._specials[i].encode() if i < self._offset else
                  self._model.decode_single_token_bytes(i) for i in map(int, ids)]  # fmt: skip
        return b"".join(pieces).decode("utf-8", errors="replace")
