import json

import pytest
from datatests_support import TINY_VOCAB_SIZE, tiny_documents

from megatron.common.errors import UserError
from megatron.training.tokenizer import sentencepiece_training
from megatron.training.tokenizer.tokenizer import (
    GPT2BPETokenizer,
    Llama2Tokenizer,
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


def test_llama2_tokenizer_starts_each_text_with_bos(sp_model):
    """Megatron's Llama2Tokenizer: the SentencePiece ids with the model's bos first; eod is its
    eos, and decoding drops the bos."""
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert isinstance(tok, Llama2Tokenizer) and tok.bos == 1 and tok.eod == plain.eod == 2
    assert tok.vocab_size == plain.vocab_size and tok.pad == -1
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == [tok.bos] + plain.tokenize(text)
        assert tok.detokenize(ids) == text
    assert tok.unique_identifiers["class"] == "Llama2Tokenizer"  # its own dataset cache
    with pytest.raises(UserError, match="--tokenizer-type Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer("Llama2Tokenizer")


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


# ---------------------------------------------------------------------------- vocab/merges pair
def _train_gpt2_pair(directory, texts, vocab_size=400):
    from megatron.training.tokenizer import gpt2_bpe_training

    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    argv = ["--input", str(corpus), "--output-dir", str(directory), "--vocab-size", str(vocab_size)]
    assert gpt2_bpe_training.main(argv) == 0
    return str(directory / "vocab.json"), str(directory / "merges.txt")


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    return _train_gpt2_pair(tmp_path_factory.mktemp("bpe"), tiny_documents())


def _merge_lines(merge_file):
    lines = open(merge_file, encoding="utf-8").read().splitlines()
    assert lines[0].startswith("#version") and len(lines) > 50
    return lines


def test_trained_vocab_and_merges_are_accepted(trained_pair):
    vocab_file, merge_file = trained_pair
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.vocab_size == 400
    assert tok.detokenize(tok.tokenize(tiny_documents()[0])) == tiny_documents()[0]


def test_shuffled_merges_are_rejected_naming_both_files(trained_pair, tmp_path):
    import random

    vocab_file, merge_file = trained_pair
    lines = _merge_lines(merge_file)
    body = lines[1:]
    random.Random(0).shuffle(body)
    shuffled = tmp_path / "shuffled_merges.txt"
    shuffled.write_text("\n".join(lines[:1] + body) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as caught:
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(shuffled))
    message = str(caught.value)
    assert f"--merge-file {shuffled} does not belong to --vocab-file {vocab_file}" in message
    assert "out of order" in message and "\n" not in message


def test_merges_of_another_vocabulary_are_rejected(trained_pair, tmp_path):
    vocab_file, _ = trained_pair
    other_texts = [
        f"Lorem ipsum dolor sit amet {i}, consectetur adipiscing elit." for i in range(40)
    ]
    _, other_merges = _train_gpt2_pair(tmp_path, other_texts, vocab_size=300)
    with pytest.raises(UserError, match="which is not in the vocabulary") as caught:
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=other_merges)
    assert other_merges in str(caught.value) and vocab_file in str(caught.value)


def _write_pair(tmp_path, symbols, merges):
    vocab = {s: i for i, s in enumerate(symbols)}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (tmp_path / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_special_tokens_first_and_a_result_made_twice_are_accepted(tmp_path):
    """Vocabularies with special tokens before the bytes (merge i is id base + i), and a later
    merge making a text an earlier one made (it keeps its id): both consistent pairs."""
    merges = [("a", "b"), ("ab", "c"), ("b", "c"), ("a", "bc"), ("c", "d")]
    results = ["ab", "abc", "bc", "cd"]  # "abc" once, at its first merge
    symbols = ["<s>", "<pad>"] + list(bytes_to_unicode().values()) + results + ["<|endoftext|>"]
    vocab_file, merge_file = _write_pair(tmp_path, symbols, merges)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert [tok.inv_vocab[i] for i in tok.tokenize("abcd")] == ["abc", "d"]


def test_two_merges_swapped_are_rejected(tmp_path):
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    symbols = list(bytes_to_unicode().values()) + ["he", "ll", "hell", "<|endoftext|>"]
    vocab_file, merge_file = _write_pair(tmp_path, symbols, [merges[1], merges[0], merges[2]])
    with pytest.raises(UserError, match=r"merge 2 \(h e\) makes id 256, below id 257 of merge 1"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)


# ---------------------------------------------------------------------------- TikTokenizer
@pytest.fixture(scope="module")
def tiktoken_vocab(trained_pair, tmp_path_factory):
    """A Megatron-format TikToken vocabulary converted from the GPT-2 BPE trained above."""
    from megatron.training.tokenizer import tiktoken_vocab

    path = str(tmp_path_factory.mktemp("tiktoken") / "vocab.json")
    assert tiktoken_vocab.main(["--vocab-file", trained_pair[0], "--output", path]) == 0
    return path


def test_tiktoken_vocabulary_is_megatrons_format(tiktoken_vocab, trained_pair):
    """Ranks 0..255 the bytes in order, then one token per merged GPT-2 token, each decodable
    from base64 and made of two lower-ranked tokens' bytes."""
    import base64

    entries = json.load(open(tiktoken_vocab))
    tokens = [base64.b64decode(e["token_bytes"]) for e in entries]
    assert [e["rank"] for e in entries] == list(range(len(entries)))
    assert tokens[:256] == [bytes([i]) for i in range(256)]
    assert len(entries) == len(json.load(open(trained_pair[0]))) - 1  # <|endoftext|> left out
    known = set(tokens[:256])
    for token in tokens[256:]:
        assert any(token[:k] in known and token[k:] in known for k in range(1, len(token)))
        known.add(token)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_round_trip_and_megatrons_ids(tiktoken_vocab, pattern):
    """Megatron's ids: 1000 special tokens first (<unk> <s> </s> <mask> <pad> ...), rank r at
    r + 1000; eod is </s>, pad <pad>; every text round-trips, and merges are used."""
    tok = build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_vocab, tiktoken_pattern=pattern)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (2**17, 1, 2, 4)
    for text in TEXTS + tiny_documents()[:3]:
        ids = tok.tokenize(text)
        assert all(1000 <= i < 1000 + 400 for i in ids)
        assert tok.detokenize(ids) == text
    words = "def return self " * 4
    assert len(tok.tokenize(words)) < len(words.encode())  # merged, not byte by byte
    assert tok.detokenize([tok.bos, 1000 + ord("a")]) == "<s>a"


def test_tiktokenizer_options(tiktoken_vocab):
    """--vocab-size cuts the ranks, --tiktoken-num-special-tokens moves them, and custom special
    tokens keep Megatron's required ones."""
    tok = build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_vocab, vocab_size=300,
                          tiktoken_num_special_tokens=10)  # fmt: skip
    ids = tok.tokenize("def return")
    assert tok.vocab_size == 300 and all(10 <= i < 300 for i in ids)
    special = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<x>"]
    tok = build_tokenizer(
        "TikTokenizer", tokenizer_model=tiktoken_vocab, special_tokens=special[::-1]
    )
    assert tok.eod == 5 and tok.pad == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"tiktoken_num_special_tokens": 3}, "must be at least the 7 special tokens"),
    ({"special_tokens": ["<s>", "</s>"]}, "must hold <unk> <s> </s>"),
    ({"tiktoken_pattern": "v3"}, "--tiktoken-pattern must be v1 or v2"),
])  # fmt: skip
def test_tiktokenizer_bad_options_are_one_line(tiktoken_vocab, kwargs, message):
    with pytest.raises(UserError, match=message):
        build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_vocab, **kwargs)


def test_tiktokenizer_bad_files_are_one_line(tmp_path):
    with pytest.raises(UserError, match="--tokenizer-model file not found"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path / "missing.json"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": ""}] * 300))
    with pytest.raises(UserError, match="entry 0 is out of order"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(wrong))
    with pytest.raises(UserError, match="--tokenizer-type TikTokenizer needs --tokenizer-model"):
        build_tokenizer("TikTokenizer")
