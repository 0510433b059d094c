"""Fixtures for the data tests: a tiny corpus, a tokenizer trained on it, and a small indexed
dataset. Everything is generated here; nothing is downloaded."""

import json

import pytest

# The helpers module sits beside this file (on pytest's pythonpath: see pyproject.toml).
from datatests_support import (
    TINY_VOCAB_SIZE,
    random_documents,
    tiny_documents,
    write_indexed_dataset,
)

from megatron.training.tokenizer import sentencepiece_training


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in tiny_documents():
            f.write(json.dumps({"text": doc}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def sp_model(tiny_corpus, tmp_path_factory):
    """A sentencepiece model trained on the tiny corpus by megatron.training.tokenizer.sentencepiece_training."""
    prefix = str(tmp_path_factory.mktemp("tokenizer") / "tiny")
    rc = sentencepiece_training.main(
        ["--input", tiny_corpus, "--output-prefix", prefix, "--vocab-size", str(TINY_VOCAB_SIZE)]
    )
    assert rc == 0
    return prefix + ".model"


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """(prefix, documents): 120 documents over a NullTokenizer(99) vocabulary (eod = 99)."""
    prefix = str(tmp_path_factory.mktemp("dataset") / "small_text_document")
    docs = random_documents(120, vocab=100)
    write_indexed_dataset(prefix, docs)
    return prefix, docs
