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

`--paci-accumulation-schedule A1:K1,A2:K2,...` (PACI only) sets the accumulation factor by
iteration instead: a = A1 for the first K1 iterations, A2 for the next K2, ..., then the a of
`--global-batch-size` for the rest of the run. In Megatron's terms an iteration stays one
optimizer step of every stage over `num_microbatches` = a microbatches, so the global batch of
an iteration is a x micro batch x data parallel: a larger a early is a larger global batch
early. Each phase end is a drain point (the pipeline is empty there), so no microbatch is in
flight when a changes and each phase keeps its own drift bound ceil((N - 1 - s) / a). The LR
schedule counts iterations, as without the flag.
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
    """Global batch and microbatch count of each iteration, from the samples consumed (a ramp)
    or from the iteration (an accumulation schedule)."""

    def __init__(self, global_batch_size: int, per_microbatch: int, ramp: BatchRamp | None,
                 phases=()):  # fmt: skip
        self.final, self.per_microbatch = global_batch_size, per_microbatch
        self.ramp, self.phases = ramp, list(phases)

    @classmethod
    def of(cls, config) -> "BatchSchedule":
        """The schedule of a run (`RunConfig`)."""
        training = config.training
        return cls(
            training.global_batch_size,
            training.micro_batch_size * config.parallel.data_parallel_size,
            ramp_of(training.rampup_batch_size, training.global_batch_size),
            config.pipeline.paci_accumulation_schedule,
        )

    def batch_of_iteration(self, iteration: int) -> int | None:
        """The accumulation schedule's global batch of `iteration` (1-based); None past its
        phases or without one."""
        end = 0
        for a, iterations in self.phases:
            end += iterations
            if iteration <= end:
                return a * self.per_microbatch
        return None

    def batch_size(self, consumed_samples: int) -> int:
        return self.final if self.ramp is None else self.ramp.batch_size(consumed_samples)

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.batch_size(consumed_samples) // self.per_microbatch

    def batches(self, consumed_samples: int, iterations: int, first_iteration: int = 1) -> list:
        """The global batch of each of the next `iterations` iterations, the first of which
        is `first_iteration`."""
        sizes = []
        for iteration in range(first_iteration, first_iteration + iterations):
            by_iteration = self.batch_of_iteration(iteration)
            sizes.append(by_iteration or self.batch_size(consumed_samples))
            consumed_samples += sizes[-1]
        return sizes


def ramp_of(rampup_batch_size, global_batch_size: int) -> BatchRamp | None:
    """--rampup-batch-size START INCREMENT SAMPLES (validated) as a ramp; None without one."""
    if rampup_batch_size is None:
        return None
    start, increment, samples = rampup_batch_size
    return BatchRamp(start, increment, samples, global_batch_size)


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
    args.train_iters = train_iterations(
        ramp_of(args.rampup_batch_size, args.global_batch_size), args.train_samples
    )


def parse_accumulation_schedule(text: str) -> list[tuple[int, int]]:
    """'A1:K1,A2:K2' as [(A1, K1), (A2, K2)]: integers >= 1."""
    phases = []
    for part in text.split(","):
        a, colon, iterations = part.strip().partition(":")
        try:
            phase = (int(a), int(iterations)) if colon else None
        except ValueError:
            phase = None
        if phase is None or min(phase) < 1:
            raise UserError(
                f"--paci-accumulation-schedule: expected A:ITERATIONS[,A:ITERATIONS...] with "
                f"integers >= 1, got {text!r}"
            )
        phases.append(phase)
    return phases


def validate_accumulation_schedule(args: argparse.Namespace) -> None:
    """Check --paci-accumulation-schedule; set ``args.paci_accumulation_schedule`` to its
    [(a, iterations)] phases. Call after the global batch and --train-iters are known."""
    text = getattr(args, "paci_accumulation_schedule", None)
    if text is None or isinstance(text, list):
        return
    if args.pipeline_schedule != "paci":
        raise UserError("--paci-accumulation-schedule applies to --pipeline-schedule paci only")
    if args.rampup_batch_size is not None or args.train_samples is not None:
        raise UserError(
            "--paci-accumulation-schedule counts iterations: it excludes --rampup-batch-size "
            "and --train-samples (use --train-iters)"
        )
    for flag in ("async_sync_warmup_iters", "async_sync_cooldown_iters"):
        if getattr(args, flag, 0):
            raise UserError(
                f"--paci-accumulation-schedule with --{flag.replace('_', '-')} is not supported "
                "yet"
            )
    phases = parse_accumulation_schedule(text)
    if sum(iterations for _, iterations in phases) >= args.train_iters:
        raise UserError(
            f"--paci-accumulation-schedule: its phases ({sum(k for _, k in phases)} iterations) "
            f"must end before --train-iters {args.train_iters}, which runs the a of "
            "--global-batch-size last"
        )
    args.paci_accumulation_schedule = phases


def accumulation_phases(config) -> list[tuple[int, int]]:
    """(a, iterations) of every phase of the run (`RunConfig`), the configured a's last."""
    phases = list(config.pipeline.paci_accumulation_schedule)
    rest = config.training.train_iters - sum(iterations for _, iterations in phases)
    return phases + [(config.training.num_microbatches, rest)]


def accumulation_phase_ends(config) -> list[int]:
    """Iterations after which a changes: drain points."""
    ends, end = [], 0
    for _, iterations in config.pipeline.paci_accumulation_schedule:
        end += iterations
        ends.append(end)
    return ends


def total_train_samples(config) -> int:
    """Samples the whole run reads."""
    return sum(BatchSchedule.of(config).batches(0, config.training.train_iters))
