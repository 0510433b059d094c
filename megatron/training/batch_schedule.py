"""The global batch of each iteration: constant, or Megatron's `--rampup-batch-size`.

`--rampup-batch-size START INCREMENT SAMPLES` with `--global-batch-size G` starts at START
samples per iteration and grows by INCREMENT, in `(G - START) / INCREMENT` equal slices of
SAMPLES consumed samples, up to G: the batch of an iteration is a function of the samples
consumed before it, `START + INCREMENT * int(consumed / (SAMPLES / increments))`, and G once
more than SAMPLES were consumed. That is megatron-core's ramp-up calculator (0.16), which the
tests use as the reference. Like Megatron, a ramp needs a sample-based run (`--train-samples`),
and the number of iterations counts the ramp's iterations one by one (`train_iterations`).

The number of microbatches of an iteration is its batch / (micro batch x data parallel), so a
ramp changes the schedules' `num_microbatches` (PACI's accumulation factor `a`) between
iterations; resuming from a checkpoint picks the ramp up from its consumed samples.
"""

import argparse
from dataclasses import dataclass

from megatron.training.errors import UserError


@dataclass(frozen=True)
class BatchRamp:
    """Megatron's linear batch-size ramp-up, in samples."""

    start: int
    increment: int
    ramp_samples: int
    final: int  # --global-batch-size

    @property
    def samples_per_increment(self) -> float:
        return self.ramp_samples / ((self.final - self.start) // self.increment)

    def batch_size(self, consumed_samples: int) -> int:
        if consumed_samples > self.ramp_samples:
            return self.final
        steps = int(consumed_samples / self.samples_per_increment)
        return self.start + steps * self.increment


class BatchSchedule:
    """Global batch and microbatch count of each iteration, from the samples consumed."""

    def __init__(self, args: argparse.Namespace):
        self.final = args.global_batch_size
        self.per_microbatch = args.micro_batch_size * args.data_parallel_size
        self.ramp = ramp_of(args)

    def batch_size(self, consumed_samples: int) -> int:
        return self.final if self.ramp is None else self.ramp.batch_size(consumed_samples)

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.batch_size(consumed_samples) // self.per_microbatch

    def batches(self, consumed_samples: int, iterations: int) -> list[int]:
        """The global batch of each of the next `iterations` iterations."""
        sizes = []
        for _ in range(iterations):
            sizes.append(self.batch_size(consumed_samples))
            consumed_samples += sizes[-1]
        return sizes


def ramp_of(args: argparse.Namespace) -> BatchRamp | None:
    values = getattr(args, "rampup_batch_size", None)
    if values is None:
        return None
    start, increment, samples = values
    return BatchRamp(start, increment, samples, args.global_batch_size)


def train_iterations(ramp: BatchRamp, train_samples: int) -> int:
    """Megatron's iteration count of a sample-based run with a ramp: the ramp's iterations one
    by one (while no more than its samples and --train-samples were consumed), then whole
    global batches of what is left (a partial last batch is dropped)."""
    iterations, consumed = 0, 0
    while consumed <= ramp.ramp_samples and consumed <= train_samples:
        consumed += ramp.batch_size(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // ramp.final
    return iterations


def parse_rampup(values: list[str]) -> tuple[int, int, int]:
    """START INCREMENT SAMPLES as integers (Megatron passes them as three words)."""
    if len(values) != 3:
        raise UserError(
            f"--rampup-batch-size takes 3 values (start batch, increment, ramp-up samples), "
            f"got {len(values)}"
        )
    try:
        start, increment, samples = (int(value) for value in values)
    except ValueError:
        raise UserError(f"--rampup-batch-size: expected 3 integers, got {' '.join(values)}")
    return start, increment, samples


def validate_rampup(args: argparse.Namespace) -> None:
    """Check --rampup-batch-size against the batch flags; set ``args.rampup_batch_size`` to
    integers and ``args.train_iters`` to Megatron's count. Call after the global batch and the
    data-parallel size are known."""
    if args.rampup_batch_size is None:
        return
    start, increment, samples = parse_rampup(args.rampup_batch_size)
    if args.train_samples is None:
        raise UserError("--rampup-batch-size needs a sample-based run: use --train-samples")
    final, per_microbatch = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    if min(start, increment, samples) < 1:
        raise UserError("--rampup-batch-size: start, increment and samples must be >= 1")
    if start >= final or (final - start) % increment:
        raise UserError(
            f"--rampup-batch-size: --global-batch-size {final} minus the start batch {start} "
            f"must be a positive multiple of the increment {increment}"
        )
    if start % per_microbatch or increment % per_microbatch:
        raise UserError(
            f"--rampup-batch-size: the start batch {start} and the increment {increment} must be "
            f"multiples of --micro-batch-size x data-parallel size = {per_microbatch}"
        )
    args.rampup_batch_size = [start, increment, samples]
    args.train_iters = train_iterations(ramp_of(args), args.train_samples)
