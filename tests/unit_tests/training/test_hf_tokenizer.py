"""--tokenizer-type HuggingFaceTokenizer: a local tokenizer.json, trained here (no download)."""

import json
import re

import pytest

from megatron.common.errors import UserError
from megatron.training.tokenizer.tokenizer import build_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n"] * 20


def train_tokenizer_json(directory, eos: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", eos])
    tokenizer.train_from_iterator(TEXTS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


def test_local_tokenizer_json_round_trips_with_its_eos(tmp_path):
    train_tokenizer_json(tmp_path, eos="<|end_of_text|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    ids = tokenizer.tokenize(TEXTS[0])
    assert 1 < len(ids) < len(TEXTS[0]) and tokenizer.detokenize(ids) == TEXTS[0]
    assert tokenizer.eod == 1  # the second special token
    stored = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tokenizer.vocab_size == len(stored["model"]["vocab"]) > 2


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: None, "no tokenizer.json there (local files only"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "is not a tokenizer.json"),
        (lambda d: train_tokenizer_json(d, eos="<sep>"), "no end-of-document token"),
    ],
)
def test_bad_tokenizer_files_fail_with_one_line(tmp_path, make, needle):
    make(tmp_path)
    with pytest.raises(UserError, match=re.escape(needle)):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
