"""--rampup-batch-size: the batch of each iteration against megatron-core's ramp-up calculator,
the iteration count against Megatron's loop driven by that calculator, and the flag's checks."""

import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from megatron.training.arguments import build_parser, validate_args
from megatron.training.batch_schedule import BatchSchedule, train_iterations
from megatron.training.config import RunConfig
from megatron.training.errors import UserError
from megatron.training.optimizer.config import LRScheduleConfig

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip
# (start, increment, ramp samples, global batch, micro batch, data parallel)
RAMPS = [(4, 4, 24, 16, 2, 1), (8, 8, 300, 64, 2, 2), (2, 2, 7, 10, 1, 2), (16, 8, 1, 32, 4, 1)]


def validated(extra: list[str], world_size: int = 1):
    args = build_parser().parse_args(BASE + extra)
    validate_args(args, world_size=world_size)
    return args


def ramp_args(start, increment, samples, batch, micro, dp, train_samples=400):
    flags = ["--micro-batch-size", str(micro), "--global-batch-size", str(batch),
             "--train-samples", str(train_samples),
             "--rampup-batch-size", str(start), str(increment), str(samples)]  # fmt: skip
    return validated(flags, world_size=dp)


def reference(start, increment, samples, batch, micro, dp):
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=batch, micro_batch_size=micro, data_parallel_size=dp,
        decrease_batch_size_if_needed=False, rank=1, start_global_batch_size=start,
        batch_size_increment=increment, ramup_samples=samples,
    )  # fmt: skip


@pytest.mark.parametrize("ramp", RAMPS)
def test_batch_and_microbatches_follow_megatron_core(ramp):
    schedule = BatchSchedule.of(RunConfig.from_args(ramp_args(*ramp)))
    calculator = reference(*ramp)
    for consumed in range(0, 2 * ramp[2] + 40):
        calculator.update(consumed, consistency_check=True)
        assert schedule.batch_size(consumed) == calculator.get_current_global_batch_size()
        assert schedule.num_microbatches(consumed) == calculator.get(), consumed


@pytest.mark.parametrize("ramp", RAMPS)
@pytest.mark.parametrize("train_samples", [1, 50, 400])
def test_iteration_count_is_megatrons(ramp, train_samples):
    """Megatron's update_train_iters, with megatron-core's calculator giving each batch."""
    calculator, iterations, consumed = reference(*ramp), 0, 0
    while consumed <= ramp[2] and consumed <= train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // ramp[3]
    args = ramp_args(*ramp, train_samples=train_samples)
    assert (
        args.train_iters
        == iterations
        == train_iterations(BatchSchedule.of(RunConfig.from_args(args)).ramp, train_samples)
    )


def test_batches_of_a_run_and_resume_from_consumed_samples():
    args = ramp_args(4, 4, 24, 16, 2, 1, train_samples=100)
    schedule = BatchSchedule.of(RunConfig.from_args(args))
    sizes = schedule.batches(0, args.train_iters)
    assert sizes[:6] == [4, 4, 8, 12, 16, 16]  # slices of 24 / 3 = 8 samples
    # resuming after 3 iterations (16 samples) continues the same sequence
    assert schedule.batches(sum(sizes[:3]), 3) == sizes[3:6]


def test_learning_rate_schedule_is_in_samples_with_a_ramp():
    args = ramp_args(4, 4, 24, 16, 2, 1, train_samples=100)
    args.lr_warmup_samples, args.lr_decay_samples = 20, 80
    assert schedule_lengths(args) == (20, 80)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--global-batch-size", "16", "--train-iters", "4", "--rampup-batch-size", "4", "4", "8"],
         "--rampup-batch-size needs a sample-based run: use --train-samples"),
        (["--global-batch-size", "16", "--train-samples", "64", "--rampup-batch-size", "4", "4"],
         "--rampup-batch-size takes 3 values (start batch, increment, ramp-up samples), got 2"),
        (["--global-batch-size", "16", "--train-samples", "64", "--rampup-batch-size", "4", "x", "8"],
         "--rampup-batch-size: expected 3 integers, got 4 x 8"),
        (["--global-batch-size", "16", "--train-samples", "64", "--rampup-batch-size", "4", "8", "8"],
         "--rampup-batch-size: --global-batch-size 16 minus the start batch 4 must be a positive "
         "multiple of the increment 8"),
        (["--global-batch-size", "16", "--train-samples", "64", "--rampup-batch-size", "3", "1", "8"],
         "--rampup-batch-size: the start batch 3 and the increment 1 must be multiples of "
         "--micro-batch-size x data-parallel size = 2"),
    ],
)  # fmt: skip
def test_bad_ramp_is_one_error_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value) == message


def schedule_lengths(args) -> tuple[float, float]:
    config = LRScheduleConfig.from_args(args)
    return config.warmup_steps, config.decay_steps
