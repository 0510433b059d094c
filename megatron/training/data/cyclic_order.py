"""`--dataloader-type cyclic`: Megatron's random pretraining sampler, as an order of samples.

The training data is read epoch after epoch without end, each epoch in a new random order
(a permutation drawn from a generator seeded by the epoch number, as Megatron's sampler does:
the run's `--seed` does not enter). An epoch is `num_samples // (mbs * dp)` rows of `mbs * dp`
samples; the samples of a last, partial row are left out. Two ways to deal a row to the
data-parallel ranks:

* sharded (the default): the dataset is cut into one contiguous bucket per rank, and each rank
  reads its own bucket in the epoch's order: a rank sees only its bucket, ever;
* `--no-data-sharding`: one permutation of the whole dataset, dealt round-robin, so row `j`
  is permutation entries `[j * mbs * dp, (j + 1) * mbs * dp)` and rank `r` takes every dp-th
  of them from `r`.

Microbatch positions are counted in consumed samples, so a resumed run (consumed samples from
its checkpoint) reads on exactly where the interrupted one would have.
"""

from megatron.common.errors import UserError


class CyclicOrder:
    """The dataset indices of one data-parallel rank's microbatches."""

    def __init__(self, num_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, data_sharding: bool = True) -> None:  # fmt: skip
        self.micro_batch_size = micro_batch_size
        self.rank, self.ranks = data_parallel_rank, data_parallel_size
        self.row = micro_batch_size * data_parallel_size
        self.rows_per_epoch = num_samples // self.row
        if self.rows_per_epoch == 0:
            raise UserError(
                f"{num_samples} samples are fewer than one micro-batch on every data-parallel "
                f"rank ({micro_batch_size} x {data_parallel_size})"
            )
        self.data_sharding = data_sharding
        # sharded: a permutation of one rank's bucket; else of the whole (mbs-rounded) dataset
        self.permuted = (
            self.rows_per_epoch * micro_batch_size
            if data_sharding
            else num_samples // micro_batch_size * micro_batch_size
        )
        self._epoch, self._permutation = None, None

    def permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            import torch

            generator = torch.Generator().manual_seed(epoch)
            self._permutation = torch.randperm(self.permuted, generator=generator).tolist()
            self._epoch = epoch
        return self._permutation

    def microbatch(self, consumed_samples: int) -> list[int]:
        """This rank's samples of the row that starts after `consumed_samples` (a whole number
        of rows) have been read by all ranks."""
        if consumed_samples % self.row:
            raise ValueError(f"{consumed_samples} consumed samples is not a whole row ({self.row})")
        epoch, row = divmod(consumed_samples // self.row, self.rows_per_epoch)
        order = self.permutation(epoch)
        mbs = self.micro_batch_size
        if self.data_sharding:
            bucket_start = self.rank * self.rows_per_epoch * mbs
            return [bucket_start + i for i in order[row * mbs : (row + 1) * mbs]]
        return order[row * self.row + self.rank : (row + 1) * self.row : self.ranks]
