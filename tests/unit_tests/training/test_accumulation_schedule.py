"""--paci-accumulation-schedule: the global batch of each iteration, the drain points where a
changes, and the flag's one-line mistakes."""

import pytest
from small_run_flags import validated

from megatron.common.errors import UserError
from megatron.training.batch_schedule import (
    BatchSchedule,
    accumulation_phases,
    total_train_samples,
)
from megatron.training.config import RunConfig
from megatron.training.training import drain_points

PACI = ["--pipeline-schedule", "paci", "--pipeline-model-parallel-size", "2", "--eval-iters", "0",
        "--untie-embeddings-and-output-weights"]  # fmt: skip


def schedule_args(text: str, iterations: int = 10, world_size: int = 2):
    flags = PACI + ["--train-iters", str(iterations), "--paci-accumulation-schedule", text]
    return RunConfig.from_args(validated(flags, world_size=world_size))


def test_each_iterations_batch_is_its_phases_a_times_the_micro_batch():
    config = schedule_args("8:2,1:3")  # micro batch 2, global batch 8: a = 4 afterwards
    assert config.pipeline.paci_accumulation_schedule == ((8, 2), (1, 3))
    assert accumulation_phases(config) == [(8, 2), (1, 3), (4, 5)]
    assert BatchSchedule.of(config).batches(0, 10) == [16, 16, 2, 2, 2, 8, 8, 8, 8, 8]
    assert BatchSchedule.of(config).batches(18, 3, first_iteration=3) == [2, 2, 2]  # a resume
    assert total_train_samples(config) == 16 * 2 + 2 * 3 + 8 * 5


def test_data_parallel_ranks_each_take_a_microbatches():
    config = schedule_args("3:4", world_size=4)  # 2 stages x 2 replicas
    assert BatchSchedule.of(config).batches(0, 5) == [12, 12, 12, 12, 8]


def test_a_changes_only_at_drain_points():
    config = schedule_args("8:2,1:3")
    assert drain_points(config, 0) == [2, 5, 10]
    assert drain_points(config, 3) == [5, 10]


@pytest.mark.parametrize(
    "extra, message",
    [
        (PACI + ["--paci-accumulation-schedule", "8"], "expected A:ITERATIONS"),
        (PACI + ["--paci-accumulation-schedule", "0:3"], "integers >= 1"),
        (PACI + ["--paci-accumulation-schedule", "8:4"], "must end before --train-iters 4"),
        (["--paci-accumulation-schedule", "8:2"], "applies to --pipeline-schedule paci only"),
        (PACI + ["--paci-accumulation-schedule", "8:2", "--async-sync-warmup-iters", "1"],
         "--async-sync-warmup-iters is not supported yet"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line(extra, message):
    with pytest.raises(UserError, match=message) as raised:
        validated(extra, world_size=2)
    assert "\n" not in str(raised.value)


def test_the_engine_refuses_what_it_does_not_reproduce():
    from small_run_flags import BASE

    from megatron.studies.single_process_engine import parse_engine_args

    with pytest.raises(UserError, match="^--use-distributed-optimizer is not supported yet by "
                       "the single-process engine$"):  # fmt: skip
        parse_engine_args(BASE + PACI + ["--use-distributed-optimizer"])
    with pytest.raises(UserError, match="^the single-process engine runs --pipeline-schedule "
                       "1f1b, paci, 2bw or pipedream, not zb-h1$"):  # fmt: skip
        parse_engine_args(
            BASE + ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2"]
        )
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
    with pytest.raises(UserError, match="^the single-process engine runs "
                       "--expert-model-parallel-size 1 only$"):  # fmt: skip
        parse_engine_args(BASE + PACI + moe + ["--expert-model-parallel-size", "2"])
    assert parse_engine_args(BASE + PACI + moe).num_experts == 4  # MoE at EP=1 runs
    reactive = ["--paci-arrival-rule", "backward-first"]
    with pytest.raises(UserError, match="^--paci-arrival-rule backward-first orders passes by "
                       "arrival times, which the single-process engine does not have"):  # fmt: skip
        parse_engine_args(BASE + PACI + reactive)
    assert parse_engine_args(BASE + PACI + reactive + ["--deterministic-mode"]).deterministic_mode
