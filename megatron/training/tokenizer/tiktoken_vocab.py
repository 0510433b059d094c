"""A TikToken vocabulary file in Megatron's format (tiktoken_tokenizer.py describes it) from a
GPT-2 style byte-level BPE ``vocab.json``, such as ``tools/train_gpt2_bpe.py`` trains on the
corpus: ``tools/build_tiktoken_vocab.py``."""

import base64
import json
from typing import Dict, List

from megatron.common.errors import UserError
from megatron.training.tokenizer.tokenizer import GPT2BPETokenizer, bytes_to_unicode


def ranks_from_gpt2_bpe(vocab: Dict[str, int]) -> List[bytes]:
    """A GPT-2 byte-level BPE vocabulary (vocab.json's token -> id) as tiktoken ranks: the 256
    bytes in byte order, then every merged token in the order its merge made it (its id);
    its special token <|endoftext|>, which no merge makes, is left out."""
    byte_of = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    merged = []
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        if token == GPT2BPETokenizer.EOD_TOKEN:
            continue
        if len(token) > 1 and all(symbol in byte_of for symbol in token):
            merged.append(bytes(byte_of[symbol] for symbol in token))
    return [bytes([i]) for i in range(256)] + merged


def vocabulary_entries(tokens: List[bytes]) -> List[dict]:
    """Megatron's vocabulary-file entries for `tokens` in rank order."""
    return [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
             "token_str": token.decode("utf-8", errors="replace")}
            for rank, token in enumerate(tokens)]  # fmt: skip


def main(argv=None) -> int:
    """tools/build_tiktoken_vocab.py: a GPT-2 BPE vocab.json -> a Megatron TikToken vocabulary file."""
    import argparse
    import os

    parser = argparse.ArgumentParser(description=main.__doc__.split(": ", 1)[1])
    parser.add_argument("--vocab-file", required=True, help="GPT-2 BPE vocab.json")
    parser.add_argument("--output", required=True, help="the vocabulary file to write (.json)")
    args = parser.parse_args(argv)
    try:
        with open(args.vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read --vocab-file {args.vocab_file}: {error}") from None
    entries = vocabulary_entries(ranks_from_gpt2_bpe(vocab))
    temporary = f"{args.output}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(entries, handle)
    os.replace(temporary, args.output)
    print(f"> wrote {args.output} ({len(entries)} tokens)")
    return 0
