"""Flags of the optimizer suite and the delay mitigations: a wrong name or an unsupported
combination is one line, `error: ...`, exit code 2."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args

GOOD = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --pipeline-model-parallel-size 4 "
    "--untie-embeddings-and-output-weights"
).split()


def validated(extra: list[str]):
    args = build_parser().parse_args(GOOD + extra)
    validate_args(args, world_size=4)
    return args


def test_megatron_defaults_for_muon():
    args = validated(["--optimizer", "muon"])
    assert (args.muon_momentum, args.muon_nesterov, args.muon_split_qkv) == (0.9, False, True)
    assert (args.muon_scale_mode, args.muon_tp_mode, args.muon_num_ns_steps) == (
        "spectral",
        "duplicated",
        5,
    )
    assert (args.muon_coefficient_type, args.muon_scalar_optimizer) == ("quintic", "adam")
    assert (args.lion_beta1, args.lion_beta2) == (0.95, 0.98)
    assert validated(["--muon-use-nesterov"]).muon_nesterov  # the older spelling
    assert args.muon_fp32_matmul_prec == "medium" and args.muon_extra_scale_factor == 1.0
    assert validated(["--muon-no-split-qkv"]).muon_split_qkv is False


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--optimizer", "adamw"], "unknown --optimizer 'adamw'"),
        (["--muon-scale-mode", "rms"], "unknown --muon-scale-mode 'rms'"),
        (["--muon-tp-mode", "distributed"], "--muon-tp-mode distributed is not supported yet"),
        (["--muon-tp-mode", "sharded"], "unknown --muon-tp-mode 'sharded'"),
        (["--muon-coefficient-type", "cubic"], "--muon-coefficient-type cubic is not supported"),
        (["--muon-num-ns-steps", "6"], "quintic: quintic needs a multiple of 5 steps, got 6"),
        (["--muon-coefficient-type", "polar_express"], "polar_express needs at least 8 steps"),
        (["--lion-beta1", "1"], "--lion-beta1 must be a number >= 0 and < 1, got 1.0"),
        (["--muon-fp32-matmul-prec", "high"], "--muon-fp32-matmul-prec high is not supported"),
        (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be >= 1"),
        (["--delay-compensation-lambda", "-1"], "--delay-compensation-lambda must be >= 0"),
        (["--delay-compensation-lambda", "0.1"], "under 1f1b no gradient is stale"),
        (["--async-sync-warmup-iters", "5"], "--async-sync-warmup-iters needs an asynchronous"),
        (["--async-sync-cooldown-iters", "-1"], "--async-sync-cooldown-iters must be >= 0"),
        (
            [
                "--pipeline-schedule",
                "paci",
                "--async-sync-cooldown-iters",
                "2",
                "--async-nesterov-lookahead",
            ],
            "--async-sync-cooldown-iters with --async-nesterov-lookahead is not supported yet",
        ),
        (
            [
                "--pipeline-schedule",
                "paci",
                "--async-sync-warmup-iters",
                "2",
                "--async-delay-momentum",
                "0.95",
            ],
            "--async-sync-warmup-iters with --async-delay-momentum is not supported yet",
        ),
        (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--decoupled-lr", "-1"], "--decoupled-lr must be a number >= 0"),
        (
            ["--decoupled-lr", "1e-4", "--decoupled-min-lr", "2e-4"],
            "--decoupled-min-lr 0.0002 is above --decoupled-lr 0.0001",
        ),
        (["--decoupled-lr", "1e-5", "--min-lr", "1e-4"], "--min-lr 0.0001 is above --decoupled-lr"),
    ],
)
def test_unsupported_settings_are_rejected(extra, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        validated(extra)


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_decoupled_lr_reaches_the_optimizer_config(schedule):
    from megatron.training.optimizer.config import OptimizerConfig

    args = validated(["--decoupled-lr", "2e-3", "--decoupled-min-lr", "1e-5",
                      "--pipeline-schedule", schedule])  # fmt: skip
    config = OptimizerConfig.from_args(args)
    assert (config.decoupled_lr, config.decoupled_min_lr) == (2e-3, 1e-5)
    assert OptimizerConfig.from_args(validated([])).decoupled_lr is None


def test_mitigations_are_accepted_where_they_apply():
    args = validated(["--pipeline-schedule", "paci", "--async-error-feedback",
                      "--delay-compensation-lambda", "0.1"])  # fmt: skip
    assert args.async_error_feedback and args.delay_compensation_lambda == 0.1
    assert validated(["--async-error-feedback"]).async_error_feedback  # the synchronous control
    phased = validated(["--pipeline-schedule", "paci", "--async-sync-warmup-iters", "2",
                        "--async-sync-cooldown-iters", "3"])  # fmt: skip
    assert (phased.async_sync_warmup_iters, phased.async_sync_cooldown_iters) == (2, 3)


def test_schedule_of_each_iteration_with_synchronous_phases():
    from megatron.training.config import RunConfig
    from megatron.training.optimizer.delay_mitigation import (
        plan_of_iteration,
        synchronous_phase_ends,
    )

    args = validated(["--pipeline-schedule", "paci", "--train-iters", "10",
                      "--async-sync-warmup-iters", "2", "--async-sync-cooldown-iters", "3"])  # fmt: skip
    pipeline = RunConfig.from_args(args).pipeline
    schedules = [plan_of_iteration(pipeline, 10, i).name for i in range(1, 11)]
    assert schedules == ["1f1b"] * 2 + ["paci"] * 5 + ["1f1b"] * 3
    assert synchronous_phase_ends(pipeline, 10) == [2, 7]


def test_a_wrong_optimizer_name_is_one_line_and_exit_code_2():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *GOOD, "--optimizer", "lamb"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 2
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert lines == [
        "error: unknown --optimizer 'lamb' (known: adam, sgd, muon, lion, adan, soap, mars) "
        "(rank 0)"  # every rank's error names the rank (WORLD_SIZE 4 here)
    ]
