"""--rampup-batch-size: the batch of each iteration against megatron-core's ramp-up calculator,
the iteration count against Megatron's loop driven by that calculator, and the flag's checks;
--step-batch-size-schedule against Megatron-LM's definition (its parsing, units, the batch at
each threshold, the iteration count, the LR schedule's unit and its errors)."""

import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.batch_schedule import (
    BatchSchedule,
    lr_in_samples,
    parse_step_schedule,
    train_iterations,
)
from megatron.training.config import RunConfig
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


# ---------------------------------------------------------------------------- step schedule
# --step-batch-size-schedule. megatron-core 0.16.1 has no step calculator, so the references
# are written here from Megatron-LM's definition: thresholds in tokens (floored to samples by
# --seq-length), the batch of the largest threshold reached by the samples consumed.
def step_args(schedule: str, train: list[str] = ("--train-samples", "200"), micro=2, dp=1):
    return validated(["--micro-batch-size", str(micro), *train,
                      "--step-batch-size-schedule", schedule], world_size=dp)  # fmt: skip


def reference_batch(token_steps: list[tuple[int, int]], seq_length: int, consumed: int) -> int:
    """The batch Megatron's step calculator gives after `consumed` samples."""
    reached = [(tokens // seq_length, batch) for tokens, batch in token_steps
               if tokens // seq_length <= consumed]  # fmt: skip
    return max(reached)[1]


def reference_iterations(token_steps, seq_length: int, train_samples: int) -> int:
    """Megatron's update_train_iters with a step schedule: one iteration at a time."""
    iterations, consumed = 0, 0
    while consumed < train_samples:
        consumed += reference_batch(token_steps, seq_length, consumed)
        iterations += 1
    return iterations


# (schedule, the same in (tokens, batch)) at --seq-length 32 (BASE)
STEP_SCHEDULES = [
    ("0:4 256:8 640:16", [(0, 4), (256, 8), (640, 16)]),  # samples 0, 8, 20
    ("0:8 32:4 64:2", [(0, 8), (32, 4), (64, 2)]),  # the first batch jumps past two thresholds
    ("0:6 1k:2 2K:10", [(0, 6), (1000, 2), (2000, 10)]),  # samples 0, 31, 62
    ("0:2", [(0, 2)]),
]


def test_step_batches_at_the_thresholds():
    args = step_args("0:4 256:8 640:16")
    assert args.step_batch_size_schedule == [[0, 4], [8, 8], [20, 16]]  # 256 // 32, 640 // 32
    assert (args.global_batch_size, args.num_microbatches) == (16, 8)  # the last batch
    schedule = BatchSchedule.of(RunConfig.from_args(args))
    expected = {0: 4, 7: 4, 8: 8, 19: 8, 20: 16, 10**9: 16}
    assert {consumed: schedule.batch_size(consumed) for consumed in expected} == expected
    assert [schedule.num_microbatches(c) for c in (7, 8, 20)] == [2, 4, 8]
    assert schedule.fewest_microbatches() == 2


@pytest.mark.parametrize("schedule, token_steps", STEP_SCHEDULES)
def test_step_batch_of_every_sample_count_is_megatrons(schedule, token_steps):
    steps = BatchSchedule.of(RunConfig.from_args(step_args(schedule)))
    for consumed in range(0, 120):
        assert steps.batch_size(consumed) == reference_batch(token_steps, 32, consumed), consumed


@pytest.mark.parametrize("schedule, token_steps", STEP_SCHEDULES)
@pytest.mark.parametrize("train_samples", [1, 7, 8, 9, 20, 21, 62, 63, 200, 201])
def test_step_iteration_count_is_megatrons(schedule, token_steps, train_samples):
    """Until --train-samples are consumed, the last batch whole (not the constant batch's
    floor): 9 samples of 4 then 8 are 2 iterations."""
    args = step_args(schedule, ["--train-samples", str(train_samples)])
    assert args.train_iters == reference_iterations(token_steps, 32, train_samples)
    schedule = BatchSchedule.of(RunConfig.from_args(args))
    assert sum(schedule.batches(0, args.train_iters - 1)) < train_samples
    assert sum(schedule.batches(0, args.train_iters)) >= train_samples


def test_step_schedule_units_separators_and_order():
    """K/M/B/T suffixes in any case, decimals, commas or spaces; entries sorted (Megatron)."""
    same = ["0:4 256:8 640:16", "0:4,256:8,640:16", "640:16 0:4 256:8", "0:4 0.256k:8 0.64K:16",
            "0:4 2.56e2:8 6.4E2:16", "0:4, 256:8 ,640:16"]  # fmt: skip
    for text in same:
        assert [s[:2] for s in parse_step_schedule(text, 32)] == [(0, 4), (8, 8), (20, 16)], text
    assert parse_step_schedule("0:1 1t:2 2.5M:3 1b:4", 1)[1:] == [
        (2_500_000, 3, "2.5M:3"), (10**9, 4, "1b:4"), (10**12, 2, "1t:2")]  # fmt: skip
    # tokens under one sequence are sample 0; Megatron truncates a fractional token count
    assert parse_step_schedule("31:4 32:8", 32)[:2] == [(0, 4, "31:4"), (1, 8, "32:8")]
    assert parse_step_schedule("0:4 63.9:8", 32)[1][0] == 1


def test_megatrons_release_schedule_at_sequence_4096():
    """gpt3_15b_8t_release_sm: 200B and 400B tokens are 48,828,125 and 97,656,250 samples, both
    past its 4,882,812 samples, so every iteration runs 384: ceil(4882812 / 384) of them."""
    args = validated(["--micro-batch-size", "4", "--seq-length", "4096",
                      "--max-position-embeddings", "4096", "--train-samples", "4882812",
                      "--step-batch-size-schedule", "0:384 200B:768 400B:1152"])  # fmt: skip
    assert args.step_batch_size_schedule == [[0, 384], [48828125, 768], [97656250, 1152]]
    assert args.global_batch_size == 1152 and args.num_microbatches == 288
    assert args.train_iters == 12716 and 384 * 12715 < 4882812 <= 384 * 12716
    steps = BatchSchedule.of(RunConfig.from_args(args))
    assert [steps.batch_size(c) for c in (48828124, 48828125, 97656249, 97656250)] == [
        384, 768, 768, 1152]  # fmt: skip


def test_several_words_equal_one_quoted_value():
    quoted = step_args("0:4 256:8 640:16")
    words = build_parser().parse_args(BASE + ["--micro-batch-size", "2", "--train-samples",
                                              "200", "--step-batch-size-schedule", "0:4",
                                              "256:8", "640:16"])  # fmt: skip
    validate_args(words, world_size=1)
    assert words.step_batch_size_schedule == quoted.step_batch_size_schedule
    # 2 batches of 4 (to 8), 2 of 8 (to 24, past 20), then (200 - 24) / 16 = 11 of 16
    assert words.train_iters == quoted.train_iters == 15


def test_global_batch_size_is_the_schedules_last_or_refused():
    same = step_args("0:4 256:8 640:16", ["--train-samples", "200", "--global-batch-size", "16"])
    assert same.global_batch_size == 16
    with pytest.raises(UserError) as caught:
        step_args("0:4 256:8 640:16", ["--train-samples", "200", "--global-batch-size", "8"])
    assert str(caught.value) == (
        "cannot specify both --step-batch-size-schedule and --global-batch-size 8: the "
        "schedule sets the global batch (its last is 16)"
    )


def test_step_schedule_batches_resume_from_consumed_samples():
    args = step_args("0:4 256:8 640:16", ["--train-samples", "100"])
    schedule = BatchSchedule.of(RunConfig.from_args(args))
    sizes = schedule.batches(0, args.train_iters)
    assert sizes == [4, 4, 8, 8, 16, 16, 16, 16, 16]  # 100 samples: 2 + 2 + 5 iterations
    for done in range(1, len(sizes)):  # a run resumed after `done` iterations
        assert schedule.batches(sum(sizes[:done]), len(sizes) - done) == sizes[done:]


def test_step_schedule_by_train_iters_runs_its_batches():
    """Megatron's 175B example: --train-iters with the schedule (and the same last batch as
    --global-batch-size): the batches follow the samples consumed."""
    args = step_args("0:4 256:8 640:16", ["--train-iters", "6", "--global-batch-size", "16"])
    assert args.train_iters == 6
    schedule = BatchSchedule.of(RunConfig.from_args(args))
    assert schedule.batches(0, 6) == [4, 4, 8, 8, 16, 16]


def test_learning_rate_schedule_with_steps():
    """In samples by --train-samples (each step advances it by its batch, as a ramp); in
    iterations by --train-iters."""
    by_samples = step_args("0:4 256:8 640:16", ["--train-samples", "100",
                                                "--lr-warmup-samples", "20"])  # fmt: skip
    assert schedule_lengths(by_samples) == (20, 100)
    assert lr_in_samples(RunConfig.from_args(by_samples).training)
    by_iterations = step_args("0:4 256:8 640:16", ["--train-iters", "30",
                                                   "--lr-warmup-iters", "3"])  # fmt: skip
    assert schedule_lengths(by_iterations) == (3, 30)
    assert not lr_in_samples(RunConfig.from_args(by_iterations).training)


def test_typed_config_holds_the_steps_in_samples():
    training = RunConfig.from_args(step_args("0:4 256:8 640:16")).training
    assert training.step_batch_size_schedule == ((0, 4), (8, 8), (20, 16))
    assert training.global_batch_size == 16 and training.num_microbatches == 8


STEP = "--step-batch-size-schedule"
PP2 = ["--pipeline-model-parallel-size", "2"]
PACI = [*PP2, "--pipeline-schedule", "paci"]


@pytest.mark.parametrize(
    "schedule, extra, world_size, message",
    [
        ("0:4 256", [], 1, f"{STEP}: entry '256' is not THRESHOLD:BATCH"),
        ("0:4 2x:8", [], 1, f"{STEP}: '2x' is not a number (K, M, B, T suffixes allowed)"),
        ("0:4 nan:8", [], 1, f"{STEP}: 'nan' is not a number (K, M, B, T suffixes allowed)"),
        ("0:4 256:0", [], 1, f"{STEP}: the batch of '256:0' must be a whole number >= 1"),
        ("0:4 256:7.5", [], 1, f"{STEP}: the batch of '256:7.5' must be a whole number >= 1"),
        (" , ", [], 1, f"{STEP} needs at least one THRESHOLD:BATCH entry"),
        ("32:4 256:8", [], 1, f"{STEP}: the smallest threshold must be 0 (under one sequence of "
         "32 tokens), got '32:4'"),
        ("0:4 256:8 270:16", [], 1, f"{STEP}: thresholds must rise from entry to entry in "
         "samples (tokens // --seq-length 32): '256:8' and '270:16' are both sample 8"),
        ("0:4 256:6", [], 2, f"{STEP}: the batch of '256:6' is not divisible by "
         "--micro-batch-size x data-parallel size = 2 x 2"),
        ("0:4 256:8", ["--rampup-batch-size", "4", "4", "8"], 1, f"{STEP} and "
         "--rampup-batch-size cannot both be given"),
        ("0:4 256:8", [*PP2, "--num-virtual-stages-per-pipeline-rank", "2"], 2, f"{STEP} with "
         "virtual pipeline stages is not supported yet"),
        ("0:4 256:8", [*PP2, "--pipeline-schedule", "zb-v"], 2, f"{STEP} with "
         "--pipeline-schedule zb-v is not supported yet"),
        ("0:4 256:8", [*PACI, "--paci-stage-lr-scale", "0.5"], 2, f"--paci-stage-lr-scale with "
         f"{STEP} is not supported yet"),
        ("0:4 256:8", [*PACI, "--paci-accumulation-schedule", "2:2", "--train-iters", "8"], 2,
         f"--paci-accumulation-schedule with {STEP} is not supported yet"),
    ],
)  # fmt: skip
def test_bad_step_schedule_is_one_error_line(schedule, extra, world_size, message):
    run_length = [] if "--train-iters" in extra else ["--train-samples", "200"]
    with pytest.raises(UserError) as caught:
        step_args(schedule, [*run_length, *extra], dp=world_size)
    assert str(caught.value) == message


def test_train_samples_must_be_at_least_one_with_steps():
    with pytest.raises(UserError) as caught:
        step_args("0:4", ["--train-samples", "0"])
    assert str(caught.value) == "--step-batch-size-schedule: --train-samples must be >= 1"
