import json

import pytest
from datatests_support import TINY_VOCAB_SIZE, tiny_documents

from megatron.training.errors import UserError
from megatron.training.tokenizer import sentencepiece_training
from megatron.training.tokenizer.tokenizer import (
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    bytes_to_unicode,
)

TEXTS = [
    "def f(x):\n    return x + 1\n\n\n",
    "  leading spaces,\ttabs and trailing  ",
    "unicode: café ✓ 日本語 🙂",
    "",
]


def test_sentencepiece_round_trip(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == TINY_VOCAB_SIZE
    assert tok.eod == tok.eos == 2
    assert tok.pad == -1
    for text in TEXTS + tiny_documents()[:3]:
        ids = tok.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    json.dumps(tok.unique_identifiers)  # hashed into megatron-core's dataset cache names


def test_train_tokenizer_is_deterministic(tiny_corpus, sp_model, tmp_path):
    prefix = str(tmp_path / "again")
    args = ["--input", tiny_corpus, "--output-prefix", prefix, "--vocab-size"]
    assert sentencepiece_training.main(args + [str(TINY_VOCAB_SIZE)]) == 0
    with open(prefix + ".model", "rb") as a, open(sp_model, "rb") as b:
        assert a.read() == b.read()


def test_train_tokenizer_reports_user_errors(tiny_corpus, tmp_path, capsys):
    prefix = str(tmp_path / "x")
    assert sentencepiece_training.main(
        ["--input", tiny_corpus, "--output-prefix", prefix, "--vocab-size", "99999"]
    )
    assert (
        sentencepiece_training.main(
            ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", prefix]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "Vocabulary size too high" in err[0] and "nope.jsonl" in err[1]


def test_null_tokenizer_mirrors_megatron():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("1 2  3\n4") == [1, 2, 3, 4]
    assert tok.detokenize([5, 6, 7]) == "5 6 7"
    assert tok.tokenize(tok.detokenize([0, 99, 100])) == [0, 99, 100]
    with pytest.raises(UserError, match="integer ids"):
        tok.tokenize("1 two 3")


def _tiny_gpt2_files(tmp_path, with_eod=True):
    """A byte-level vocabulary with a handful of merges, written as vocab.json/merges.txt."""
    symbols = list(bytes_to_unicode().values())
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r")]
    symbols += [a + b for a, b in merges]
    if with_eod:
        symbols.append("<|endoftext|>")
    vocab = {s: i for i, s in enumerate(symbols)}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (tmp_path / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe_merges_and_round_trip(tmp_path):
    vocab_file, merge_file, vocab = _tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize("hello world")
    assert [tok.inv_vocab[i] for i in ids] == ["hello", "Ġw", "or", "l", "d"]
    for text in TEXTS + ["it's 42 ²x", "a\r\nb"]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_bpe_needs_endoftext(tmp_path):
    vocab_file, merge_file, _ = _tiny_gpt2_files(tmp_path, with_eod=False)
    with pytest.raises(UserError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokenizer_type="BertWordPieceLowerCase"), "unknown --tokenizer-type"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), "needs --merge-file"),
        (dict(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
        (dict(tokenizer_type="NullTokenizer", vocab_size=0), "must be positive"),
        (
            dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="missing.model"),
            "not found: missing.model",
        ),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file="nope.json", merge_file="m.txt"),
            "not found: nope.json",
        ),
    ],
)
def test_build_tokenizer_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        build_tokenizer(**kwargs)


def test_bad_model_and_merge_files(tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(junk))
    vocab_file, merge_file, _ = _tiny_gpt2_files(tmp_path)
    with open(merge_file, "a", encoding="utf-8") as f:
        f.write("one two three\n")
    with pytest.raises(UserError, match="merges.txt:8"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
