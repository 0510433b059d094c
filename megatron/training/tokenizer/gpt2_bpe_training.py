"""Train a GPT-2 style byte-level BPE (``vocab.json`` + ``merges.txt``) from a jsonl corpus.

The pair is what Megatron's ``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``
read: text is cut into words by GPT-2's pattern, each word's UTF-8 bytes are mapped to
printable characters (``bytes_to_unicode``), and the most frequent adjacent pair is merged,
again and again, until the vocabulary has ``--vocab-size`` entries: the 256 byte symbols, one
per merge, and ``<|endoftext|>`` last. Ties go to the pair that sorts first, so training is
deterministic. ``--special-tokens`` (for example the fill-in-the-middle sentinels
``<fim_prefix> <fim_middle> <fim_suffix> <fim_pad>`` of ``--fim-data``) come after
``<|endoftext|>``, on top of ``--vocab-size``: the other ids are the same with or without them,
so data tokenized with one vocabulary reads the same with the other.

    python tools/train_gpt2_bpe.py --input data/stdlib.jsonl --output-dir data/gpt2 \\
        --vocab-size 8192
"""

import argparse
import collections
import heapq
import json
import os
import sys

from megatron.common.errors import UserError
from megatron.training.tokenizer.tokenizer import (
    GPT2BPETokenizer,
    _gpt2_pattern,
    bytes_to_unicode,
)


def count_words(path: str, json_key: str, max_bytes: int) -> collections.Counter:
    """Byte-encoded words of the corpus (its first `max_bytes` bytes of text) and their counts."""
    pattern, byte_encoder = _gpt2_pattern(), bytes_to_unicode()
    counts, seen = collections.Counter(), 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            text = json.loads(line)[json_key]
            counts.update(pattern.findall(text))
            seen += len(text)
            if seen >= max_bytes:
                break
    return collections.Counter(
        {"".join(byte_encoder[b] for b in word.encode("utf-8")): n for word, n in counts.items()}
    )


class PairCounts:
    """Adjacent-pair counts over the words, updated word by word as merges apply."""

    def __init__(self, words: collections.Counter):
        self.symbols = [list(word) for word in words]
        self.frequency = list(words.values())
        self.counts = collections.Counter()
        self.where = collections.defaultdict(set)  # pair -> indices of words holding it
        self.heap = []  # (-count, pair), stale entries skipped when popped
        for index in range(len(self.symbols)):
            self._count(index, +1)

    def _count(self, index: int, sign: int) -> None:
        parts = self.symbols[index]
        for pair in zip(parts, parts[1:]):
            self.counts[pair] += sign * self.frequency[index]
            if sign > 0:
                self.where[pair].add(index)
                heapq.heappush(self.heap, (-self.counts[pair], pair))

    def best(self):
        """The most frequent pair; of equally frequent ones, the one that sorts first."""
        while self.heap:
            negative, pair = self.heap[0]
            current = self.counts.get(pair, 0)
            if current > 0 and -negative == current:
                return pair
            heapq.heappop(self.heap)
            if current > 0:
                heapq.heappush(self.heap, (-current, pair))
        return None

    def merge(self, pair) -> None:
        for index in sorted(self.where.pop(pair, ())):
            self._count(index, -1)
            parts, merged, i = self.symbols[index], [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            self.symbols[index] = merged
            self._count(index, +1)
        self.counts.pop(pair, None)


def train(words: collections.Counter, vocab_size: int, special_tokens=()) -> tuple[dict, list]:
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    merges, pairs = [], PairCounts(words)
    while len(vocab) < vocab_size - 1:  # the last id is <|endoftext|>
        pair = pairs.best()
        if pair is None:
            break
        pairs.merge(pair)
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
    vocab[GPT2BPETokenizer.EOD_TOKEN] = len(vocab)
    for token in special_tokens:
        if token in vocab:
            raise UserError(f"--special-tokens: {token!r} is already in the vocabulary")
        vocab[token] = len(vocab)
    return vocab, merges


def write(output_dir: str, vocab: dict, merges: list) -> None:
    os.makedirs(output_dir, exist_ok=True)
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
    }
    for name, text in files.items():
        path = os.path.join(output_dir, name)
        with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(f"{path}.tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="jsonl corpus")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--output-dir", required=True, help="writes vocab.json and merges.txt")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-bytes", type=int, default=4_000_000,
                        help="train on the corpus's first N characters of text")  # fmt: skip
    parser.add_argument("--special-tokens", nargs="+", default=[],
                        help="tokens added after <|endoftext|>, beyond --vocab-size")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.vocab_size < 257:
            raise UserError("--vocab-size must be > 256 (the byte symbols and <|endoftext|>)")
        if not os.path.isfile(args.input):
            raise UserError(f"--input file not found: {args.input}")
        vocab, merges = train(count_words(args.input, args.json_key, args.max_bytes),
                              args.vocab_size, args.special_tokens)  # fmt: skip
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write(args.output_dir, vocab, merges)
    print(f"> wrote {args.output_dir}/vocab.json ({len(vocab)} tokens) and merges.txt "
          f"({len(merges)} merges)")  # fmt: skip
    return 0
