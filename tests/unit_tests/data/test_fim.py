"""Fill-in-the-middle samples (--fim-data): the transform against layouts worked out by hand,
its invariants over many random draws, the dataset's determinism, and the one-line errors."""

import json

import numpy
import pytest
from datatests_support import write_indexed_dataset

from megatron.common.errors import UserError
from megatron.training.data.datasets import build_data_iterators
from megatron.training.data.fim import (
    FimSettings,
    FimTransform,
    cut_at,
    resolve_token_ids,
    sample_generator,
)
from megatron.training.tokenizer.base import Tokenizer
from megatron.training.tokenizer.tokenizer import build_tokenizer

P, M, S, PAD, EOD = 200, 201, 202, 203, 204  # the character tokenizer's special tokens
AAAA = 205  # one token for "aaaa": retokenizing a rearranged "aaaa" shortens it


class CharTokenizer(Tokenizer):
    """One token per character (its code point), "aaaa" as one token, and FIM's sentinels: a
    rearranged sample's parts tokenize back to exactly their characters."""

    SPECIALS = {"<fim_prefix>": P, "<fim_middle>": M, "<fim_suffix>": S, "<fim_pad>": PAD,
                "<|endoftext|>": EOD, "|": ord("|")}  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def eod(self) -> int:
        return EOD

    def token_to_id(self, token):
        return self.SPECIALS.get(token)

    def tokenize(self, text):
        ids = []
        for run in text.split("aaaa"):
            ids += [ord(c) for c in run] + [AAAA]
        return ids[:-1]

    def detokenize(self, ids):
        return "".join("aaaa" if i == AAAA else chr(i) for i in ids)


class FixedDraws:
    """A generator stub whose draws are given: random() in order, integers() in order."""

    def __init__(self, randoms, boundaries=()):
        self.randoms, self.boundaries = list(randoms), list(boundaries)

    def random(self):
        return self.randoms.pop(0)

    def integers(self, low, high, size):
        drawn = self.boundaries.pop(0)
        assert len(drawn) == size and all(low <= b < high for b in drawn)
        return numpy.array(drawn)


def ids(text):
    return numpy.array([ord(c) for c in text], dtype=numpy.int64)


TOKENIZER = CharTokenizer()


def test_psm_and_spm_layouts_worked_out_by_hand():
    fim = FimTransform(FimSettings(rate=0.5, spm_rate=0.5), TOKENIZER)
    # "abcdefgh" cut at characters 2 and 5: prefix "ab", middle "cde", suffix "fgh"
    psm = fim.rearrange(ids("abcdefgh"), 0.5, FixedDraws([0.1, 0.9], [[5, 2]]))
    assert psm.tolist() == [P, *b"ab", S, *b"fgh", M, *b"cde"]
    spm = fim.rearrange(ids("abcdefgh"), 0.5, FixedDraws([0.1, 0.2], [[2, 5]]))
    assert spm.tolist() == [P, S, *b"fgh", M, *b"ab", *b"cde"]
    # the rate's draw at or above the rate: unchanged, and nothing more is drawn
    assert fim.rearrange(ids("abc"), 0.5, FixedDraws([0.5])).tolist() == [*b"abc"]


def test_documents_apart_and_the_sample_cut_back_to_its_length():
    fim = FimTransform(FimSettings(rate=0.5, spm_rate=0.5), TOKENIZER)
    sample = numpy.concatenate([ids("abcdef"), [EOD], ids("gh")])
    # first document: PSM cut at 1 and 4; second: its rate's draw 0.9 leaves it as it is
    out = fim(sample, FixedDraws([0.1, 0.7, 0.9], [[4, 1]]))
    rearranged = [P, *b"a", S, *b"ef", M, *b"bcd", EOD, *b"gh"]
    assert out.tolist() == rearranged[: len(sample)]  # three sentinels longer: cut to 9


def test_a_shorter_retokenized_sample_is_padded():
    fim = FimTransform(FimSettings(rate=1.0, spm_rate=0.0), TOKENIZER)
    sample = ids("a" * 8)  # 8 tokens, whose text tokenizes back into 2
    out = fim(sample, FixedDraws([0.0, 0.5], [[0, 0]]))
    assert out.tolist() == [P, S, AAAA, AAAA, M, PAD, PAD, PAD]


def _text_of_psm(out):
    """The document back from PSM: <prefix> prefix <suffix> suffix <middle> middle."""
    tokens = out.tolist()
    assert tokens[0] == P and tokens.count(S) == tokens.count(M) == 1
    between = tokens[tokens.index(S) + 1 : tokens.index(M)]
    return tokens[1 : tokens.index(S)] + tokens[tokens.index(M) + 1 :] + between


def _text_of_spm(out):
    """The document back from SPM: <prefix> <suffix> suffix <middle> prefix middle. (With an
    empty prefix PSM reads the same.)"""
    tokens = out.tolist()
    assert tokens[:2] == [P, S] and tokens.count(M) == 1
    return tokens[tokens.index(M) + 1 :] + tokens[2 : tokens.index(M)]


@pytest.mark.parametrize("spm_rate", [0.0, 1.0, 0.5])
def test_rate_one_rearranges_every_document_keeping_its_tokens(spm_rate):
    fim = FimTransform(FimSettings(rate=1.0, spm_rate=spm_rate), TOKENIZER)
    document = ids("def middle(x):\n    return x")
    starts_with_both = 0
    for index in range(200):
        out = fim.rearrange(document, 1.0, sample_generator(1234, 0, 0, index))
        assert len(out) == len(document) + 3
        assert sorted(out.tolist()) == sorted(document.tolist() + [P, M, S])
        reader = {0.0: _text_of_psm, 1.0: _text_of_spm}.get(spm_rate)
        if reader is None:
            reader = _text_of_spm if out[1] == S else _text_of_psm
        assert reader(out) == document.tolist()
        starts_with_both += out[1] == S
    # SPM always starts <prefix> <suffix>; PSM only when its prefix is empty (a cut at 0)
    low, high = {0.0: (1, 40), 1.0: (200, 200), 0.5: (80, 150)}[spm_rate]
    assert low <= starts_with_both <= high


def test_rate_zero_leaves_samples_unchanged():
    fim = FimTransform(FimSettings(rate=0.0), TOKENIZER)
    sample = numpy.concatenate([ids("hello world"), [EOD], ids("second"), [EOD]])
    for index in range(50):
        assert fim(sample, sample_generator(1, 0, 0, index)).tolist() == sample.tolist()


def test_lengths_kept_and_draws_fixed_by_the_key():
    fim = FimTransform(FimSettings(rate=0.5, spm_rate=0.5), TOKENIZER)
    sample = numpy.concatenate([ids("x = 1\ny = 2\n"), [EOD], ids("print(x + y)"), [EOD], ids("z")])
    outs = [fim(sample, sample_generator(7, 0, 0, index)) for index in range(40)]
    assert all(len(out) == len(sample) for out in outs)
    assert any(out.tolist() != sample.tolist() for out in outs)
    again = [fim(sample, sample_generator(7, 0, 0, index)) for index in reversed(range(40))]
    assert [o.tolist() for o in outs] == [o.tolist() for o in reversed(again)]
    other_seed = [fim(sample, sample_generator(8, 0, 0, index)) for index in range(40)]
    assert [o.tolist() for o in outs] != [o.tolist() for o in other_seed]


def test_split_sample_rearranges_each_file_and_no_prefix_skips():
    settings = FimSettings(rate=1.0, spm_rate=0.0, split_sample="|", fragment_rate=1.0)
    fim = FimTransform(settings, TOKENIZER)
    document = ids("first file|second|third one")
    sample = numpy.concatenate([document, [EOD], ids("z" * 12)])
    out = fim(sample, sample_generator(3, 0, 0, 0))
    assert out[len(document) + 9] == EOD  # each of the three files gained three sentinels
    files = cut_at(out[: len(document) + 9], ord("|"))
    assert len(files) == 3
    for rearranged, original in zip(files, ("first file", "second", "third one")):
        assert _text_of_psm(rearranged) == [*original.encode()]
    skipping = FimTransform(FimSettings(rate=1.0, no_prefix="#!"), TOKENIZER)
    script = ids("#!/bin/sh\necho hi")
    assert skipping(script, sample_generator(3, 0, 0, 0)).tolist() == script.tolist()


def test_a_missing_sentinel_is_one_line_naming_it(sp_model):
    with pytest.raises(UserError) as error:
        FimTransform(FimSettings(middle_token="<fill_here>"), TOKENIZER)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--fim-middle-token '<fill_here>' is not a token of the tokenizer")
    with pytest.raises(UserError, match="--fim-split-sample needs --fim-fragment-rate"):
        FimTransform(FimSettings(split_sample="|"), TOKENIZER)
    # a real SentencePiece model has no <fim_prefix> piece: its unknown piece's id is no answer
    sentencepiece = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    with pytest.raises(UserError, match=r"^--fim-prefix-token '<fim_prefix>' is not a token"):
        resolve_token_ids(FimSettings(eod_token="</s>"), sentencepiece)
    assert sentencepiece.token_to_id("</s>") == sentencepiece.eod


def test_gpt2_bpe_with_special_tokens_keeps_the_other_ids(tiny_corpus, tmp_path):
    from megatron.training.tokenizer import gpt2_bpe_training

    sentinels = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
    plain, with_fim = str(tmp_path / "plain"), str(tmp_path / "fim")
    common = ["--input", tiny_corpus, "--vocab-size", "300"]
    assert gpt2_bpe_training.main(common + ["--output-dir", plain]) == 0
    assert (
        gpt2_bpe_training.main(common + ["--output-dir", with_fim, "--special-tokens", *sentinels])
        == 0
    )
    vocab = json.load(open(f"{with_fim}/vocab.json"))
    assert {k: v for k, v in vocab.items() if k not in sentinels} == json.load(
        open(f"{plain}/vocab.json")
    )
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=f"{with_fim}/vocab.json",
                                merge_file=f"{with_fim}/merges.txt")  # fmt: skip
    found = resolve_token_ids(FimSettings(), tokenizer)
    after_eod = tuple(range(tokenizer.eod + 1, tokenizer.eod + 5))  # appended, in order
    assert (found.prefix, found.middle, found.suffix, found.pad) == after_eod
    assert found.eod == tokenizer.eod == len(vocab) - 5


@pytest.fixture(scope="module")
def letters_dataset(tmp_path_factory):
    """40 documents of lowercase letters and spaces, each ending with the eod token."""
    rng = numpy.random.default_rng(0)
    alphabet = numpy.array([*b"abcdefghij "])
    documents = [rng.choice(alphabet, int(rng.integers(10, 60))).tolist() + [EOD]
                 for _ in range(40)]  # fmt: skip
    prefix = str(tmp_path_factory.mktemp("letters") / "letters_text_document")
    write_indexed_dataset(prefix, documents)
    return prefix


def _train_samples(prefix, cache, fim, count=24):
    train, _, _ = build_data_iterators(
        data_path=prefix and [prefix], mock_data=prefix is None, split="100,0,0",
        seq_length=32, seed=1234, tokenizer=TOKENIZER, data_cache_path=str(cache),
        micro_batch_size=1,
        data_parallel_rank=0, data_parallel_size=1, train_samples=count, valid_samples=0,
        test_samples=0, sample_options={"fim": fim},
    )  # fmt: skip
    return train.dataset


def test_the_dataset_rearranges_samples_reproducibly(letters_dataset, tmp_path):
    plain = _train_samples(letters_dataset, tmp_path, None)
    unchanged = _train_samples(letters_dataset, tmp_path, FimSettings(rate=0.0))
    fim = FimSettings(rate=0.5, spm_rate=0.5)
    first = _train_samples(letters_dataset, tmp_path, fim)
    indices = range(len(plain))
    tokens = [first[i]["tokens"].tolist() for i in indices]
    assert type(first).__name__ == "GPTFIMDataset"
    # rate 0: megatron-core's samples, the same documents in the same order
    assert all(unchanged[i]["tokens"].tolist() == plain[i]["tokens"].tolist() for i in indices)
    assert all(len(t) == 32 for t in tokens)
    changed = [t != plain[i]["tokens"].tolist() for i, t in enumerate(tokens)]
    assert 0 < sum(changed) < len(tokens)
    assert all(P in t for t, was_changed in zip(tokens, changed) if was_changed)
    # a new build (a resumed run), read backwards: the same samples
    second = _train_samples(letters_dataset, tmp_path, fim)
    assert [second[i]["tokens"].tolist() for i in reversed(indices)] == tokens[::-1]
    assert all(first[i]["labels"][:-1].tolist() == t[1:] for i, t in enumerate(tokens))


def test_the_dataset_rejects_a_tokenizer_without_the_sentinels(letters_dataset, tmp_path):
    with pytest.raises(UserError, match=r"^--fim-suffix-token '<suffix>' is not a token"):
        _train_samples(letters_dataset, tmp_path, FimSettings(suffix_token="<suffix>"))
    with pytest.raises(UserError, match="^--fim-data needs --data-path: it does not take --mock"):
        _train_samples(None, tmp_path, FimSettings())
