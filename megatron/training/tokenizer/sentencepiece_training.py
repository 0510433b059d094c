"""Train a SentencePiece BPE tokenizer model from a jsonl corpus.

The model suits source code: no text normalization, whitespace kept as it is (runs of spaces
become pieces), newlines may be part of pieces, digits are split, and characters that did not
make it into the vocabulary fall back to byte pieces, so every text round-trips exactly through
``tokenize``/``detokenize``. Special ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (the end-of-document
token, ``eod``), no padding piece.

Training is deterministic and bounded in time: documents are cut at line boundaries into chunks
of at most ``--chunk-bytes`` bytes, and at most ``--max-chunks`` of them, drawn with a seeded
reservoir sample when there are more, are given to the trainer.

Example::

    python tools/train_tokenizer.py --input data/stdlib.jsonl --json-key text \\
        --output-prefix data/tokenizer/stdlib --vocab-size 8192

writes ``data/tokenizer/stdlib.model`` (for ``--tokenizer-model``) and a readable
``data/tokenizer/stdlib.vocab``.
"""

import argparse
import io
import json
import os
import random
import sys
import time

from megatron.common.errors import UserError

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def iter_documents(path: str, json_key: str):
    """Yield the ``json_key`` text of each line of a jsonl file."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as err:
        raise UserError(f"cannot read --input {path}: {err.strerror}") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{lineno}: not a JSON object") from None
            if not isinstance(record, dict) or json_key not in record:
                raise UserError(f"{path}:{lineno}: no key {json_key!r}")
            yield str(record[json_key])


def iter_chunks(text: str, chunk_bytes: int):
    """Cut a document into pieces of whole lines of at most ``chunk_bytes`` UTF-8 bytes.

    A single line longer than the limit becomes a chunk of its own (the trainer skips those
    longer than its ``max_sentence_length``).
    """
    chunk, size = [], 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if chunk and size + n > chunk_bytes:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


def sample_chunks(documents, chunk_bytes: int, max_chunks: int, seed: int):
    """Reservoir-sample at most ``max_chunks`` chunks, keeping their corpus order."""
    rng = random.Random(seed)
    reservoir = []  # (position in corpus, chunk)
    seen = 0
    n_docs = 0
    for doc in documents:
        n_docs += 1
        for chunk in iter_chunks(doc, chunk_bytes):
            if not chunk.strip():
                continue
            if len(reservoir) < max_chunks:
                reservoir.append((seen, chunk))
            else:
                j = rng.randrange(seen + 1)
                if j < max_chunks:
                    reservoir[j] = (seen, chunk)
            seen += 1
    reservoir.sort(key=lambda item: item[0])
    return [chunk for _, chunk in reservoir], seen, n_docs


def train(chunks, vocab_size: int, seed: int, threads: int, chunk_bytes: int):
    """Train the model and return its serialized bytes."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(chunks),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=0.9999,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=4 * chunk_bytes,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=threads,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        raise UserError(f"sentencepiece training failed: {message}") from None
    return model.getvalue()


def write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def vocab_listing(model_bytes: bytes) -> bytes:
    """One ``piece<TAB>score`` line per id; newlines, tabs and CRs in pieces are escaped."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    lines = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        for raw, escaped in (("\\", "\\\\"), ("\n", "\\n"), ("\t", "\\t"), ("\r", "\\r")):
            piece = piece.replace(raw, escaped)
        lines.append(f"{piece}\t{sp.get_score(i):g}\n")
    return "".join(lines).encode("utf-8")


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--input", required=True, help="jsonl corpus")
    parser.add_argument("--json-key", default="text", help="key of the text in each line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model/.vocab")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--chunk-bytes", type=int, default=2048, help="training chunk size")
    parser.add_argument(
        "--max-chunks", type=int, default=10000, help="bound on chunks given to the trainer"
    )
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    for name in ("vocab_size", "chunk_bytes", "max_chunks", "threads"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be positive, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    try:
        args = get_args(argv)
        start = time.time()
        chunks, n_chunks, n_docs = sample_chunks(
            iter_documents(args.input, args.json_key),
            args.chunk_bytes,
            args.max_chunks,
            args.seed,
        )
        if not chunks:
            raise UserError(f"--input {args.input} has no text under key {args.json_key!r}")
        model_bytes = train(chunks, args.vocab_size, args.seed, args.threads, args.chunk_bytes)
        out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
        os.makedirs(out_dir, exist_ok=True)
        write_atomically(args.output_prefix + ".vocab", vocab_listing(model_bytes))
        write_atomically(args.output_prefix + ".model", model_bytes)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_bytes = sum(len(c.encode("utf-8")) for c in chunks)
    print(
        f"Trained a sentencepiece BPE model, vocab size {args.vocab_size} (unk {UNK_ID}, "
        f"bos {BOS_ID}, eos/eod {EOS_ID}, no pad), on {len(chunks)} of {n_chunks} chunks "
        f"({n_bytes / 1e6:.2f} MB) from {n_docs} documents in {time.time() - start:.1f} s "
        f"-> {args.output_prefix}.model"
    )
    return 0
