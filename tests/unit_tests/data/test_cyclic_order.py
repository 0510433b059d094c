"""--dataloader-type cyclic (data/cyclic_order.py) against Megatron's random sampler as its
docstring and code describe it, written here as an epoch-at-a-time generator (the reference).
The flags: test_megatron_flags.py."""

import itertools

import pytest
import torch

from megatron.common.errors import UserError
from megatron.training.data.cyclic_order import CyclicOrder
from megatron.training.data.datasets import MicrobatchIterator


def reference_microbatches(num_samples, mbs, rank, ranks, sharding):
    """Megatron's MegatronPretrainingRandomSampler fed back its consumed samples epoch after
    epoch (its cyclic data loader): one rank's microbatches, without end."""
    row = mbs * ranks
    active = num_samples - num_samples % row
    consumed = 0
    while True:
        epoch, within = divmod(consumed, active)
        generator = torch.Generator().manual_seed(epoch)
        if sharding:
            bucket = num_samples // row * mbs
            order = torch.randperm(bucket, generator=generator).tolist()
            indices = [rank * bucket + i for i in order[within // ranks :]]
        else:
            order = torch.randperm(num_samples // mbs * mbs, generator=generator).tolist()
            indices = order[within:][rank::ranks]
        batch = []
        for index in indices:
            batch.append(index)
            if len(batch) == mbs:
                consumed += row
                yield batch
                batch = []
                if consumed % active == 0:
                    break  # the epoch is over: the loader starts the sampler again


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("num_samples, mbs, ranks", [(20, 2, 2), (23, 2, 3), (9, 1, 4), (16, 4, 1)])
def test_the_order_is_megatrons_random_sampler_over_several_epochs(
    num_samples, mbs, ranks, sharding
):
    rows = 4 * (num_samples // (mbs * ranks))  # four epochs
    for rank in range(ranks):
        order = CyclicOrder(num_samples, mbs, rank, ranks, data_sharding=sharding)
        mine = [order.microbatch(j * mbs * ranks) for j in range(rows)]
        expected = list(itertools.islice(reference_microbatches(num_samples, mbs, rank, ranks,
                                                                sharding), rows))  # fmt: skip
        assert mine == expected


@pytest.mark.parametrize("sharding", [True, False])
def test_an_epoch_reads_each_sample_at_most_once_and_epochs_differ(sharding):
    num_samples, mbs, ranks = 30, 2, 3
    orders = [CyclicOrder(num_samples, mbs, r, ranks, data_sharding=sharding) for r in range(3)]
    rows = num_samples // (mbs * ranks)
    epochs = []
    for epoch in range(2):
        seen = [i for j in range(rows) for order in orders
                for i in order.microbatch((epoch * rows + j) * mbs * ranks)]  # fmt: skip
        assert len(seen) == len(set(seen)) == rows * mbs * ranks
        epochs.append(seen)
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    if sharding:  # each rank stays in its bucket of 10 samples
        for rank, order in enumerate(orders):
            assert all(rank * 10 <= i < rank * 10 + 10 for j in range(rows)
                       for i in order.microbatch(j * mbs * ranks))  # fmt: skip


def test_the_iterator_reads_on_without_end_and_resumes_where_it_stopped():
    dataset = [{"tokens": torch.tensor([i])} for i in range(10)]

    def rows(iterator, count):
        return [next(iterator)["tokens"].flatten().tolist() for _ in range(count)]

    def iterator(start):
        order = CyclicOrder(len(dataset), 2, 1, 2)
        it = MicrobatchIterator(dataset, 2, 1, 2, start_sample=start, order=order)
        it.collate = lambda samples: {"tokens": torch.stack([s["tokens"] for s in samples])}
        return it

    whole = rows(iterator(0), 7)  # 2 rows an epoch: three and a half epochs
    assert rows(iterator(3 * 4), 4) == whole[3:]
    assert all(4 <= i < 8 for batch in whole for i in batch)  # rank 1: the bucket 4..7


def test_fewer_samples_than_a_row_is_one_line():
    with pytest.raises(UserError, match="^3 samples are fewer than one micro-batch on every "):
        CyclicOrder(3, 2, 0, 2)
