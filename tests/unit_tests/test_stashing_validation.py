"""2bw and pipedream: what their stashed weight versions do not support ends in one line."""

import pytest
from test_validation import validation_error, with_flags

from megatron.training.arguments import build_parser, validate_args
from megatron.training.config import pipeline_plan
from megatron.training.optimizer.lr_per_iteration import SchedulerPerIteration, per_iteration

CASES = {
    "2bw_too_few_microbatches": (
        ["--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights", None,
         "--global-batch-size", "4"],
        "--pipeline-schedule 2bw on 4 stages needs at least 3 microbatches per step",
    ),
    "2bw_sync_warmup": (
        ["--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights", None,
         "--async-sync-warmup-iters", "2"],
        "--async-sync-warmup-iters is not supported yet with --pipeline-schedule 2bw",
    ),
    "pipedream_sync_cooldown": (
        ["--pipeline-schedule", "pipedream", "--untie-embeddings-and-output-weights", None,
         "--async-sync-cooldown-iters", "2"],
        "--async-sync-cooldown-iters is not supported yet with --pipeline-schedule pipedream",
    ),
    "2bw_save": (
        ["--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights", None,
         "--save", "/tmp/never_written"],
        "--save is not supported yet with --pipeline-schedule 2bw (checkpointing the stashed",
    ),
    "pipedream_load": (
        ["--pipeline-schedule", "pipedream", "--untie-embeddings-and-output-weights", None,
         "--load", "/tmp/never_read"],
        "--load is not supported yet with --pipeline-schedule pipedream",
    ),
    "pipedream_arrival_rule": (
        ["--pipeline-schedule", "pipedream", "--untie-embeddings-and-output-weights", None,
         "--paci-arrival-rule", "forward-first"],
        "--paci-arrival-rule applies to --pipeline-schedule paci only",
    ),
    "flush_inflight_limit": (
        ["--pipeline-schedule", "1f1b", "--paci-inflight-limit", "flush"],
        "--paci-inflight-limit applies to --pipeline-schedule paci only",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_unsupported_combinations_fail_in_one_line(name):
    flags, message = CASES[name]
    assert message in validation_error(with_flags(*flags))


def parsed(*flags: str):
    args = build_parser().parse_args(with_flags(*flags))
    validate_args(args, world_size=4)
    return args


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_supported_settings_validate(schedule):
    args = parsed("--pipeline-schedule", schedule, "--untie-embeddings-and-output-weights", None,
                  "--async-error-feedback", None, "--delay-compensation-lambda", "0.1",
                  "--optimizer", "muon")  # fmt: skip
    assert args.num_microbatches == 4 and args.pipeline_schedule == schedule
    tied_one_stage = build_parser().parse_args(
        with_flags("--pipeline-schedule", schedule, "--pipeline-model-parallel-size", "1")
    )
    validate_args(tied_one_stage, world_size=1)  # one stage holds both copies: allowed


class CountingScheduler:
    def __init__(self):
        self.num_steps = 0

    def step(self, increment):
        self.num_steps += increment


def test_pipedream_advances_the_lr_schedule_once_per_iteration():
    """m = 4 steps per iteration: the LR schedule (in iterations) moves on every 4th step."""
    args = parsed("--pipeline-schedule", "pipedream", "--untie-embeddings-and-output-weights",
                  None)  # fmt: skip
    inner = CountingScheduler()
    scheduler = per_iteration(inner, pipeline_plan(args), args.num_microbatches)
    assert isinstance(scheduler, SchedulerPerIteration)
    counts = []
    for _ in range(8):
        scheduler.step(increment=1)
        counts.append(scheduler.num_steps)
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2]
    scheduler.num_steps = 0  # attributes are the wrapped scheduler's (a rollback sets this)
    assert inner.num_steps == 0
    for schedule in ("2bw", "paci", "1f1b"):
        untied = "--untie-embeddings-and-output-weights"
        args = parsed("--pipeline-schedule", schedule, untied, None)
        assert per_iteration(inner, pipeline_plan(args), args.num_microbatches) is inner
