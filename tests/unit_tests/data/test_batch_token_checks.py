"""Every microbatch's token ids are checked against the padded vocabulary, and a bad one is
traced back to its dataset and document."""

import numpy
import pytest
import torch
from datatests_support import random_documents, write_indexed_dataset

from megatron.common.errors import UserError
from megatron.training.data.datasets import (
    build_data_iterators,
    check_batch_token_ids,
    locate_bad_tokens,
)
from megatron.training.tokenizer.tokenizer import build_tokenizer

SEQ = 32
LIMIT = 128  # NullTokenizer(99): 100 ids, padded to a multiple of 128
ROTTEN = 1000  # document d of a rotted dataset holds the id ROTTEN + d


def _batch(tokens):
    tokens = torch.tensor(tokens, dtype=torch.int64)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def test_check_passes_in_range_and_names_the_sample_without_a_dataset():
    check_batch_token_ids(_batch([[0, 5, LIMIT - 1], [3, 4, 5]]), LIMIT)
    with pytest.raises(UserError, match=rf"^sample 8 holds token id {LIMIT}, outside the padded "
                       rf"vocabulary of {LIMIT} tokens \(the file is damaged"):  # fmt: skip
        check_batch_token_ids(_batch([[0, 1, 2], [3, LIMIT, 5]]), LIMIT, None, samples=[7, 8])
    with pytest.raises(UserError, match="sample 0 holds token id -3,"):
        check_batch_token_ids(_batch([[0, -3, 2], [3, 4, 5]]), LIMIT)


def test_check_covers_the_last_token_of_each_sample():
    """A sample's last token is only in its labels."""
    with pytest.raises(UserError, match="sample 1 holds token id 60000"):
        check_batch_token_ids(_batch([[0, 1, 2], [3, 4, 60000]]), LIMIT)


def _write_rotted(prefix, docs, sequences_per_document=1):
    """Documents with one id in the middle of document d set to ROTTEN + d; each document
    cut into `sequences_per_document` sequences of the .idx."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for d, doc in enumerate(docs):
        doc = numpy.asarray(doc, dtype=numpy.uint16)
        doc[len(doc) // 2] = ROTTEN + d
        n, cut = sequences_per_document, len(doc) // sequences_per_document
        lengths = [cut] * (n - 1) + [len(doc) - cut * (n - 1)]
        builder.add_document(doc, lengths)
    builder.finalize(prefix + ".idx")


def _train_dataset(data_path, tmp_path, vocab_limit=None, samples=64):
    train, _, _ = build_data_iterators(
        data_path=data_path, mock_data=False, split="100,0,0", seq_length=SEQ, seed=1234,
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=99),
        data_cache_path=str(tmp_path / "cache"), micro_batch_size=2, data_parallel_rank=0,
        data_parallel_size=1, train_samples=samples, valid_samples=0, test_samples=0,
        vocab_limit=vocab_limit,
    )  # fmt: skip
    return train


def _assert_located_exactly(dataset, prefix):
    """For every sample: its bad ids, if any, are found in the document named."""
    with_bad = 0
    for sample in range(len(dataset)):
        item = dataset[sample]
        text = torch.cat([item["tokens"], item["labels"][-1:]])
        bad = set(text[text >= LIMIT].tolist())
        found = locate_bad_tokens(dataset, sample, LIMIT)
        if not bad:
            assert found is None, (sample, found)
            continue
        with_bad += 1
        found_prefix, document, token_id = found
        assert found_prefix == prefix
        assert token_id in bad and token_id == ROTTEN + document, (sample, found, bad)
    assert 0 < with_bad < len(dataset)  # samples with and without the rotted ids


@pytest.mark.parametrize("sequences_per_document", [1, 2])
def test_samples_are_traced_to_their_document(tmp_path, sequences_per_document):
    prefix = str(tmp_path / "rotted_text_document")
    _write_rotted(prefix, random_documents(60, vocab=100), sequences_per_document)
    _assert_located_exactly(_train_dataset([prefix], tmp_path).dataset, prefix)


def test_blended_samples_are_traced_to_their_dataset(tmp_path):
    good, rotted = str(tmp_path / "good_text_document"), str(tmp_path / "rotted_text_document")
    write_indexed_dataset(good, random_documents(60, vocab=100, seed=1))
    _write_rotted(rotted, random_documents(60, vocab=100, seed=2))
    train = _train_dataset(["0.5", good, "0.5", rotted], tmp_path)
    assert type(train.dataset).__name__ == "BlendedDataset"
    _assert_located_exactly(train.dataset, rotted)


def test_iterator_stops_at_the_first_bad_microbatch_naming_file_and_document(tmp_path):
    prefix = str(tmp_path / "rotted_text_document")
    _write_rotted(prefix, random_documents(60, vocab=100))
    unchecked = _train_dataset([prefix], tmp_path)
    checked = _train_dataset([prefix], tmp_path, vocab_limit=LIMIT)
    while True:  # the batches before the first bad one pass
        plain = next(unchecked)
        if max(int(plain["tokens"].max()), int(plain["labels"].max())) >= LIMIT:
            break
        assert torch.equal(next(checked)["tokens"], plain["tokens"])
    with pytest.raises(UserError) as caught:
        next(checked)
    message = str(caught.value)
    assert message.startswith(f"{prefix}.bin: document ")
    document, token_id = message.split("document ")[1].split(" holds token id ")
    token_id = int(token_id.split(",")[0])
    assert token_id == ROTTEN + int(document)
    assert token_id in set(plain["tokens"].flatten().tolist() + plain["labels"].flatten().tolist())
    assert message.endswith(f", outside the padded vocabulary of {LIMIT} tokens (the file is "
                            "damaged or was tokenized with another tokenizer)")  # fmt: skip
