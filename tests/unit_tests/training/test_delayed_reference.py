"""The single-process delayed-update reference on megatron-core's GPT (mock data, 1 process).

Independent references: the golden losses of the 1-process pretraining run (functional case
gpt_pp1_1f1b, produced by pretrain_gpt.py's runtime) for delay 0, and a run with learning
rate 0 (frozen weights) for what the first steps of a delayed run see.
"""

import pytest
import run_cases

from megatron.studies.delayed_reference import parse_reference_args, run_delayed

SMALL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 1e-2 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 200 --attention-dropout 0 --hidden-dropout 0 "
    "--eval-iters 0"
).split()


def relative_difference(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_delay_zero_is_the_synchronous_pretraining_run():
    flags = run_cases.flags(run_cases.discover_cases()["gpt_pp1_1f1b"]["MODEL_ARGS"], "unused")
    losses = run_delayed(parse_reference_args(flags), delay=0, evaluate=False).losses
    assert relative_difference(losses, run_cases.golden_losses("gpt_pp1_1f1b")) <= 1e-6


@pytest.mark.parametrize("delay", [1, 2])
def test_the_first_steps_of_a_delayed_run_see_the_initial_weights(delay):
    """Step t's gradient is taken at x(max(t - delay, 0)): the first delay + 1 losses are the
    frozen model's, the next one is not."""
    frozen = run_delayed(parse_reference_args(SMALL + ["--lr", "0"]), delay=0).losses
    delayed = run_delayed(parse_reference_args(SMALL), delay=delay).losses
    synchronous = run_delayed(parse_reference_args(SMALL), delay=0).losses
    assert delayed[: delay + 1] == frozen[: delay + 1]
    assert synchronous[1] != frozen[1]
    assert delayed[delay + 1] != frozen[delay + 1]


@pytest.mark.parametrize("extra", [[], ["--optimizer", "muon"]])
def test_a_synchronous_start_and_cooldown_over_the_whole_run_is_synchronous(extra):
    args = parse_reference_args(SMALL + extra)
    whole = run_delayed(args, delay=1, sync_warmup_iters=3, sync_cooldown_iters=2).losses
    assert whole == run_delayed(parse_reference_args(SMALL + extra), delay=0).losses


def test_error_feedback_is_the_plain_update_in_the_synchronous_phases():
    """Error feedback over a run that is synchronous throughout steps the plain optimizer
    (equal within rounding: it applies AdamW's decay apart), where applied to fresh gradients
    outside a phase it extrapolates and gives other losses."""
    feedback = parse_reference_args(SMALL + ["--async-error-feedback"])
    phased = run_delayed(feedback, delay=1, sync_warmup_iters=3, sync_cooldown_iters=2).losses
    plain = run_delayed(parse_reference_args(SMALL), delay=0).losses
    extrapolated = run_delayed(feedback, delay=0).losses
    assert relative_difference(phased, plain) <= 1e-6
    assert relative_difference(extrapolated, plain) > 1e-4


def test_a_synchronous_start_switches_to_the_delayed_rule_after_it():
    """Steps 0 and 1 synchronous; step 2's gradient is taken at x(1), not x(2)."""
    synchronous = run_delayed(parse_reference_args(SMALL), delay=0).losses
    warm = run_delayed(parse_reference_args(SMALL), delay=1, sync_warmup_iters=2).losses
    assert warm[:2] == synchronous[:2] and warm[2] != synchronous[2]
