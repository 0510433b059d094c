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

`--step-batch-size-schedule "THRESHOLD:BATCH ..."` (Megatron-LM's replacement of the ramp)
gives the global batch by steps: an iteration that starts after THRESHOLD tokens were consumed
runs BATCH samples, the last threshold reached deciding. Thresholds are tokens (Megatron's
training passes --seq-length to its calculator), floored to samples (tokens // seq length),
and may carry a K, M, B or T suffix (10^3 ... 10^12, any case, decimals allowed: 2.4B);
entries are separated by spaces or commas and sorted by threshold, the first at 0 samples.
The global batch of the run (`--global-batch-size`) is the last entry's. With --train-samples
the run counts iterations as Megatron's `update_train_iters` does (until the samples are
reached, the last batch whole) and its LR schedule is in samples, as a ramp's; with
--train-iters the LR schedule counts iterations (`lr_in_samples`).
"""

import argparse
import bisect
import math
from dataclasses import dataclass

from megatron.common.errors import UserError


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


@dataclass(frozen=True)
class BatchSteps:
    """Megatron's step-wise global batch: (first consumed sample, batch) pairs, the first at 0
    and the thresholds strictly rising."""

    steps: tuple[tuple[int, int], ...]

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    def batch_size(self, consumed_samples: int) -> int:
        thresholds = [threshold for threshold, _ in self.steps]
        return self.steps[bisect.bisect_right(thresholds, consumed_samples) - 1][1]


class BatchSchedule:
    """Global batch and microbatch count of each iteration, from the samples consumed (a ramp
    or a step schedule) or from the iteration (an accumulation schedule)."""

    def __init__(self, global_batch_size: int, per_microbatch: int, ramp: BatchRamp | None,
                 phases=(), steps: BatchSteps | None = None):  # fmt: skip
        self.final, self.per_microbatch = global_batch_size, per_microbatch
        self.ramp, self.phases, self.steps = ramp, list(phases), steps

    @classmethod
    def of(cls, config) -> "BatchSchedule":
        """The schedule of a run (`RunConfig`)."""
        training = config.training
        return cls(
            training.global_batch_size,
            training.micro_batch_size * config.parallel.data_parallel_size,
            ramp_of(training.rampup_batch_size, training.global_batch_size),
            config.pipeline.paci_accumulation_schedule,
            steps_of(training.step_batch_size_schedule),
        )

    @property
    def by_samples(self) -> BatchRamp | BatchSteps | None:
        """The ramp or step schedule that sets the batch from the samples consumed."""
        return self.ramp or self.steps

    def fewest_microbatches(self) -> int:
        """The fewest microbatches an iteration of the run can have."""
        batches = [self.final, *(a * self.per_microbatch for a, _ in self.phases)]
        batches += [self.ramp.start] if self.ramp else []
        batches += [batch for _, batch in self.steps.steps] if self.steps else []
        return min(batches) // self.per_microbatch

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
        by_samples = self.by_samples
        return self.final if by_samples is None else by_samples.batch_size(consumed_samples)

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


# --step-batch-size-schedule's threshold suffixes, as Megatron's
COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
STEP_FLAG = "--step-batch-size-schedule"


def steps_of(step_batch_size_schedule) -> BatchSteps | None:
    """The validated [[first sample, batch], ...] as a step schedule; None without one."""
    if step_batch_size_schedule is None:
        return None
    return BatchSteps(
        tuple((int(samples), int(batch)) for samples, batch in step_batch_size_schedule)
    )


def parse_count(text: str) -> float:
    """A number with an optional K, M, B or T suffix, in any case: '2.4B' is 2.4e9."""
    number, multiplier = text.strip().upper(), 1
    if number[-1:] in COUNT_SUFFIXES:
        number, multiplier = number[:-1], COUNT_SUFFIXES[number[-1]]
    try:
        value = float(number) * multiplier
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UserError(f"{STEP_FLAG}: {text!r} is not a number (K, M, B, T suffixes allowed)")
    return value


def _batch_of(text: str, entry: str) -> int:
    batch = parse_count(text)
    if batch < 1 or batch != int(batch):
        raise UserError(f"{STEP_FLAG}: the batch of {entry!r} must be a whole number >= 1")
    return int(batch)


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int, str]]:
    """'THRESHOLD:BATCH ...' (entries apart by spaces or commas, thresholds in tokens) as
    (first sample, batch, entry) sorted by threshold, which must start at 0 and rise."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise UserError(f"{STEP_FLAG}: entry {entry!r} is not THRESHOLD:BATCH")
        # Megatron truncates the token count to an integer, then floors it to samples
        samples = int(parse_count(threshold)) // seq_length
        steps.append((samples, _batch_of(batch, entry), entry))
    if not steps:
        raise UserError(f"{STEP_FLAG} needs at least one THRESHOLD:BATCH entry")
    steps.sort(key=lambda step: step[0])  # Megatron sorts the entries too
    if steps[0][0] != 0:
        raise UserError(
            f"{STEP_FLAG}: the smallest threshold must be 0 (under one sequence of {seq_length} "
            f"tokens), got {steps[0][2]!r}"
        )
    for (before, _, first), (after, _, second) in zip(steps, steps[1:]):
        if after == before:
            raise UserError(
                f"{STEP_FLAG}: thresholds must rise from entry to entry in samples (tokens // "
                f"--seq-length {seq_length}): {first!r} and {second!r} are both sample {after}"
            )
    return steps


def _is_parsed(step_batch_size_schedule) -> bool:
    return all(isinstance(step, (list, tuple)) for step in step_batch_size_schedule)


def validate_step_schedule(args: argparse.Namespace) -> None:
    """Check --step-batch-size-schedule; set ``args.step_batch_size_schedule`` to its
    [[first sample, batch], ...] and ``args.global_batch_size`` to its last batch. Call with
    --seq-length checked and the data-parallel size known, before the global batch defaults."""
    given = args.step_batch_size_schedule
    if given is None or _is_parsed(given):
        return
    if args.rampup_batch_size is not None:
        raise UserError(f"{STEP_FLAG} and --rampup-batch-size cannot both be given")
    text = " ".join(given) if isinstance(given, list) else given
    steps = parse_step_schedule(text, args.seq_length)
    final = steps[-1][1]
    # Megatron refuses both flags; its own 175B example passes both, the same final batch
    if args.global_batch_size not in (None, final):
        raise UserError(
            f"cannot specify both {STEP_FLAG} and --global-batch-size {args.global_batch_size}: "
            f"the schedule sets the global batch (its last is {final})"
        )
    per_microbatch = args.micro_batch_size * args.data_parallel_size
    for _, batch, entry in steps:
        if batch % per_microbatch:
            raise UserError(
                f"{STEP_FLAG}: the batch of {entry!r} is not divisible by --micro-batch-size x "
                f"data-parallel size = {args.micro_batch_size} x {args.data_parallel_size}"
            )
    args.step_batch_size_schedule = [[samples, batch] for samples, batch, _ in steps]
    args.global_batch_size = final


def step_train_iterations(steps: BatchSteps, train_samples: int) -> int:
    """Megatron's iteration count of a sample-based run with a step schedule: iterations until
    --train-samples were consumed, each of the batch of the samples consumed before it (so the
    last one is whole and may go past --train-samples)."""
    iterations, consumed = 0, 0
    ends = [threshold for threshold, _ in steps.steps[1:]] + [train_samples]
    for (_, batch), end in zip(steps.steps, ends):
        end = min(end, train_samples)
        if consumed < end:  # the iterations that start inside this step
            count = -(-(end - consumed) // batch)
            iterations, consumed = iterations + count, consumed + count * batch
    return iterations


def set_step_schedule_iterations(args: argparse.Namespace) -> None:
    """``args.train_iters`` of a sample-based run with a step schedule (after
    `validate_step_schedule` and the run length's checks)."""
    if args.step_batch_size_schedule is None or args.train_samples is None:
        return
    if args.train_samples < 1:
        raise UserError(f"{STEP_FLAG}: --train-samples must be >= 1")
    steps = steps_of(args.step_batch_size_schedule)
    args.train_iters = step_train_iterations(steps, args.train_samples)


def lr_in_samples(flags) -> bool:
    """Whether the LR schedule counts samples, each step advancing it by its iteration's batch
    (Megatron's sample-based schedule): with a ramp, or a step schedule by --train-samples.
    `flags`: the parsed flags or a `TrainingConfig`."""
    if getattr(flags, "rampup_batch_size", None) is not None:
        return True
    by_steps = getattr(flags, "step_batch_size_schedule", None) is not None
    return by_steps and getattr(flags, "train_samples", None) is not None


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
    if getattr(args, "step_batch_size_schedule", None) is not None:
        raise UserError(f"--paci-accumulation-schedule with {STEP_FLAG} is not supported yet")
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
