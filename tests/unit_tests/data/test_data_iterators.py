import itertools
import os
import socket

import pytest
import torch
from datatests_support import random_documents, write_indexed_dataset

from megatron.common.errors import UserError
from megatron.training.data.datasets import build_data_iterators
from megatron.training.tokenizer.tokenizer import build_tokenizer

SEQ = 32
KEYS = {"tokens", "labels", "loss_mask", "position_ids"}


@pytest.fixture(scope="module")
def null_tokenizer():
    return build_tokenizer("NullTokenizer", vocab_size=99)


def _build(prefix_or_none, tokenizer, cache, mbs=2, rank=0, dp=1, samples=(64, 16, 8), **kw):
    args = dict(
        data_path=None if prefix_or_none is None else [prefix_or_none],
        mock_data=prefix_or_none is None,
        split="90,8,2",
        seq_length=SEQ,
        seed=1234,
        tokenizer=tokenizer,
        data_cache_path=cache,
        micro_batch_size=mbs,
        data_parallel_rank=rank,
        data_parallel_size=dp,
        train_samples=samples[0],
        valid_samples=samples[1],
        test_samples=samples[2],
    )
    args.update(kw)
    return build_data_iterators(**args)


def _check_batch(batch, mbs):
    assert set(batch) == KEYS
    for key, value in batch.items():
        assert value.shape == (mbs, SEQ), key
        assert value.dtype == (torch.float32 if key == "loss_mask" else torch.int64), key
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(mbs, SEQ))
    assert torch.all(batch["loss_mask"] == 1)


def test_real_dataset_batches(small_dataset, null_tokenizer, tmp_path):
    prefix, docs = small_dataset
    train, valid, test = _build(prefix, null_tokenizer, str(tmp_path))
    all_ids = {i for doc in docs for i in doc}
    for it in (train, valid, test):
        batch = next(it)
        _check_batch(batch, 2)
        assert set(batch["tokens"].flatten().tolist()) <= all_ids
    assert len(train.dataset) >= 64 and len(valid.dataset) >= 16


def test_mock_dataset_batches(null_tokenizer):
    train, valid, test = _build(None, null_tokenizer, None, mbs=3, samples=(30, 6, 0))
    assert test is None
    for batch in itertools.islice(train, 3):
        _check_batch(batch, 3)
    _check_batch(next(valid), 3)


@pytest.mark.parametrize("source", ["mock", "file"])
def test_a_split_without_samples_is_not_built_and_changes_no_other(source, small_dataset,
                                                                   null_tokenizer, tmp_path):  # fmt: skip
    """A split asked for 0 samples is skipped (megatron-core would shuffle a whole epoch of it);
    the other splits give the same batches as when it is built."""
    prefix = None if source == "mock" else small_dataset[0]
    built = _build(prefix, null_tokenizer, str(tmp_path / "a"), samples=(64, 16, 8))
    skipped = _build(prefix, null_tokenizer, str(tmp_path / "b"), samples=(64, 16, 0))
    assert built[2] is not None and skipped[2] is None
    for with_test, without_test in zip(built[:2], skipped[:2]):
        for _ in range(4):
            assert _rows(next(with_test)) == _rows(next(without_test))
    # megatron-core's index cache holds no index of the skipped split
    assert any("-test-" in name for name in os.listdir(tmp_path / "a"))
    assert not any("-test-" in name for name in os.listdir(tmp_path / "b"))


def _rows(batch):
    return [tuple(row) for row in batch["tokens"].tolist()]


def test_data_parallel_ranks_share_global_batches(small_dataset, null_tokenizer, tmp_path):
    """Global batch 8: DP=1 x 4 microbatches of 2 == DP=2 x 2 microbatches of 2 per rank."""
    prefix, _ = small_dataset
    cache = str(tmp_path)
    single, _, _ = _build(prefix, null_tokenizer, cache, mbs=2, dp=1)
    rank0, _, _ = _build(prefix, null_tokenizer, cache, mbs=2, rank=0, dp=2)
    rank1, _, _ = _build(prefix, null_tokenizer, cache, mbs=2, rank=1, dp=2)
    for _ in range(3):
        dp1 = [row for _ in range(4) for row in _rows(next(single))]
        dp2 = [row for _ in range(2) for it in (rank0, rank1) for row in _rows(next(it))]
        assert sorted(dp1) == sorted(dp2)
        assert dp1 == dp2  # same order too: microbatch j covers samples [2j, 2j + 2)

    resumed, _, _ = _build(prefix, null_tokenizer, cache, consumed_train_samples=8)
    fresh, _, _ = _build(prefix, null_tokenizer, cache)
    for _ in range(4):
        next(fresh)
    assert _rows(next(resumed)) == _rows(next(fresh))


def test_train_stops_and_valid_cycles(small_dataset, null_tokenizer, tmp_path):
    prefix, _ = small_dataset
    train, valid, _ = _build(prefix, null_tokenizer, str(tmp_path), mbs=4)
    assert sum(1 for _ in train) == len(train.dataset) // 4
    rows = len(valid.dataset) // 4
    first = [_rows(next(valid)) for _ in range(rows)]
    again = [_rows(next(valid)) for _ in range(rows)]
    assert first == again


def test_validation_resumes_where_the_evaluations_stopped(small_dataset, null_tokenizer,
                                                          tmp_path):  # fmt: skip
    """A resumed run's validation iterator reads on from the samples its evaluations read,
    across the split's end too (whole rows, then from sample 0), as the uninterrupted one."""
    prefix, _ = small_dataset
    cache = str(tmp_path)
    _, whole, _ = _build(prefix, null_tokenizer, cache, mbs=3)
    rows = len(whole.dataset) // 3
    assert rows > 2
    read = [_rows(next(whole)) for _ in range(3 * rows)]
    for consumed_rows in (1, rows - 1, rows + 2, 2 * rows + 1):
        _, resumed, _ = _build(prefix, null_tokenizer, cache, mbs=3,
                               consumed_valid_samples=3 * consumed_rows)  # fmt: skip
        assert [_rows(next(resumed)) for _ in range(2)] == read[consumed_rows : consumed_rows + 2]


def test_sentencepiece_tokenizer_in_dataset_config(sp_model, tmp_path):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    prefix = str(tmp_path / "sp_text_document")
    write_indexed_dataset(prefix, random_documents(30, vocab=tokenizer.vocab_size, eod=2))
    train, _, _ = _build(prefix, tokenizer, str(tmp_path / "cache"), samples=(8, 0, 0))
    _check_batch(next(train), 2)


def test_user_errors(small_dataset, null_tokenizer, tmp_path):
    prefix, _ = small_dataset
    with pytest.raises(UserError, match="mutually exclusive"):
        _build(prefix, null_tokenizer, None, mock_data=True)
    with pytest.raises(UserError, match="--mock-data"):
        _build(prefix, null_tokenizer, None, data_path=None, mock_data=False)
    with pytest.raises(UserError, match="dataset file not found"):
        _build(str(tmp_path / "nothing"), null_tokenizer, None)
    with pytest.raises(UserError, match="data-parallel rank 2"):
        _build(prefix, null_tokenizer, None, rank=2, dp=2)
    with pytest.raises(UserError, match="--split"):
        _build(prefix, null_tokenizer, None, split="90,x")


def test_empty_split_is_an_error_not_a_hang(null_tokenizer, tmp_path):
    """megatron-core loops forever on a split without tokens; we refuse it up front."""
    prefix = str(tmp_path / "two_docs")
    write_indexed_dataset(prefix, random_documents(2, vocab=100))
    with pytest.raises(UserError, match="leaves the valid split of .*two_docs without tokens"):
        _build(prefix, null_tokenizer, str(tmp_path), split="98,2,0")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_with_single_process_gloo_group_and_blend(small_dataset, null_tokenizer, tmp_path):
    """The builder's barriers and cache paths under torch.distributed, with a weighted blend."""
    import torch.distributed as dist

    prefix, _ = small_dataset
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        cache = str(tmp_path / "cache")
        blend = ["0.3", prefix, "0.7", prefix]
        train, valid, _ = _build(None, null_tokenizer, cache, data_path=blend, mock_data=False)
        _check_batch(next(train), 2)
        _check_batch(next(valid), 2)
        again, _, _ = _build(None, null_tokenizer, cache, data_path=blend, mock_data=False)
        train, _, _ = _build(None, null_tokenizer, cache, data_path=blend, mock_data=False)
        assert _rows(next(again)) == _rows(next(train))  # second build: cache hit
    finally:
        dist.destroy_process_group()
