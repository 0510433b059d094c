"""--rerun-mode validate_results: the flags, the error injector, the comparisons and every
verdict of the validation on one rank (the collective agreement is one all-reduce; the 2-stage
runs are in tests/functional_tests/test_rerun.py)."""

import math
import random

import pytest
import torch
from small_run_flags import validated

from megatron.common.errors import UserError
from megatron.training.config import TrainingConfig
from megatron.training.rerun import (
    EXIT_FAILED_ON_RESULT_VALIDATION,
    EXIT_RESUME_TO_DISAMBIGUATE,
    LARGE_SAMPLES,
    MATCH,
    MISMATCH,
    ErrorInjector,
    LargeValues,
    Phase,
    ReplayableIterator,
    ResultValidation,
    relative_difference,
)

VALIDATE = ["--rerun-mode", "validate_results"]


def error_of(extra: list[str]) -> str:
    with pytest.raises(UserError) as caught:
        validated(extra)
    return str(caught.value)


# ---------------------------------------------------------------------------- flags
def test_flags_reach_the_configuration():
    args = validated(VALIDATE + ["--error-injection-rate", "5", "--error-injection-type",
                                 "persistent_error", "--check-for-spiky-loss",
                                 "--check-for-large-grads", "--no-check-for-nan-in-loss-and-grad"])  # fmt: skip
    training = TrainingConfig.from_flags(args)
    assert (training.rerun_mode, training.error_injection_rate) == ("validate_results", 5)
    assert training.error_injection_type == "persistent_error"
    assert training.check_for_spiky_loss and training.check_for_large_grads
    assert not training.check_for_nan_in_loss_and_grad


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rerun-mode", "report_stats"], "--rerun-mode report_stats is not supported yet"),
        (VALIDATE + ["--error-injection-rate", "-1"], "--error-injection-rate must be >= 0, got -1"),
        (["--error-injection-rate", "3"],
         "--error-injection-rate acts only with --rerun-mode validate_results"),
        (["--check-for-spiky-loss"],
         "--check-for-spiky-loss acts only with --rerun-mode validate_results"),
        (VALIDATE + ["--result-rejected-tracker-filename", "/proc/no/such/file"],
         "--result-rejected-tracker-filename: cannot append to /proc/no/such/file "
         "(No such file or directory)"),
    ],
)  # fmt: skip
def test_bad_flags_fail_in_one_line(extra, message):
    assert error_of(extra) == message


@pytest.mark.parametrize("schedule", ["paci", "2bw", "pipedream"])
def test_asynchronous_schedules_refuse_it(schedule):
    message = error_of(VALIDATE + ["--pipeline-schedule", schedule])
    assert message.startswith(f"--rerun-mode validate_results with --pipeline-schedule "
                              f"{schedule} is not supported yet: ")  # fmt: skip


# ---------------------------------------------------------------------------- parts
def test_relative_difference():
    assert relative_difference(2.0, 2.0) == MATCH
    assert relative_difference(math.nan, math.nan) == MATCH
    assert relative_difference(1.0, math.nan) == MISMATCH
    assert relative_difference(math.inf, 1.0) == MISMATCH
    assert relative_difference(1.0, 1.002) == pytest.approx(0.002 / 1.001)


def test_injection_rate_and_at_most_one_per_iteration():
    injector = ErrorInjector(rate=10, kind="transient_error", seed=1, rank=0)
    hits = 0
    for _ in range(20000):
        if injector.maybe_inject():
            hits += 1
            assert not injector.maybe_inject()  # one pending injection at a time
            injector.injected = None  # compared: the next iteration may inject again
    assert 1800 < hits < 2200
    assert not any(ErrorInjector(0, "transient_error", 1, 0).maybe_inject() for _ in range(100))


@pytest.mark.parametrize(
    "kind, first, second",
    [("transient_error", MISMATCH, None), ("persistent_error", MATCH, MISMATCH),
     ("correct_result", MATCH, MATCH)],
)  # fmt: skip
def test_injected_errors_compare_as_their_kind(kind, first, second):
    injector = ErrorInjector(rate=1, kind=kind, seed=1, rank=0)
    assert injector.maybe_inject()
    assert injector.compared(0.5, Phase.IN_PLACE) == first
    if second is None:  # settled on the first rerun
        assert injector.injected is None and injector.compared(0.5, Phase.IN_PLACE) == 0.5
        return
    assert injector.compared(0.5, Phase.FROM_CHECKPOINT) == second
    assert injector.injected is None


def test_injector_state_round_trips():
    injector = ErrorInjector(rate=7, kind="transient_error", seed=3, rank=1)
    [injector.maybe_inject() for _ in range(5)]
    copy = ErrorInjector(rate=7, kind="transient_error", seed=99, rank=0)
    copy.load_state_dict(injector.state_dict())
    draws = [[i.random.random() for _ in range(5)] for i in (injector, copy)]
    assert draws[0] == draws[1] and copy.injected == injector.injected


def test_large_values_against_the_first_samples():
    large = LargeValues()
    assert not any(large.is_large(float(v), "loss") for v in range(1, LARGE_SAMPLES + 1))
    assert not large.is_large(LARGE_SAMPLES * 9.9, "loss")
    assert large.is_large(LARGE_SAMPLES * 10.0, "loss")
    assert not large.is_large(math.nan, "loss")  # NaN has its own check


def test_replayable_iterator_hands_out_the_iteration_again():
    data = ReplayableIterator(iter(range(100)))
    data.mark()
    first = [next(data) for _ in range(3)]
    data.rewind()
    assert [next(data) for _ in range(3)] == first
    assert next(data) == 3
    data.mark()
    assert next(data) == 4


# ---------------------------------------------------------------------------- verdicts
def validation(**flags) -> ResultValidation:
    training = TrainingConfig(rerun_mode="validate_results", seed=1, **flags)
    result = ResultValidation(training, device=torch.device("cpu"), rank=0)
    result.data = ReplayableIterator(iter(range(1000)))
    return result


def run_iteration(check, iteration: int, losses: list[float]) -> bool:
    """One run of an iteration: the microbatches' losses, then the step; whether it stepped."""
    for loss in losses:
        check.check_loss(torch.tensor(loss))
    return check.at_step(lambda p: p.grad, [])


def first_iteration(check) -> None:
    check.begin(1)
    assert run_iteration(check, 1, [math.nan])  # not checked: the process's first iteration
    assert not check.again(4)


def test_a_clean_iteration_steps_once():
    check = validation()
    first_iteration(check)
    check.begin(2)
    assert run_iteration(check, 2, [2.0, 2.1])
    assert not check.again(2) and check.exit is None


def test_a_reproducible_nan_asks_for_a_resume_elsewhere():
    check = validation()
    first_iteration(check)
    check.begin(2)
    assert not run_iteration(check, 2, [2.0, math.nan])
    assert check.again(2)
    assert not run_iteration(check, 2, [2.0, math.nan])
    assert not check.again(2)
    assert check.exit[0] == EXIT_RESUME_TO_DISAMBIGUATE and check.exit[2]  # save first
    assert check.phase is Phase.SAVE_TO_RESUME and check.suspect == check.identity


def test_the_rerun_restores_the_rng_and_the_data():
    check = validation()
    first_iteration(check)
    check.begin(2)
    drawn = (torch.rand(4), random.random(), [next(check.data) for _ in range(3)])
    check.check_loss(torch.tensor(math.inf))
    assert not check.at_step(lambda p: p.grad, [])
    assert check.again(3)
    again = (torch.rand(4), random.random(), [next(check.data) for _ in range(3)])
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
    assert check.replayed_microbatches == 3


def test_a_nan_that_does_not_reproduce_is_a_transient_error():
    check = validation()
    first_iteration(check)
    check.begin(2)
    assert not run_iteration(check, 2, [math.nan])
    assert check.again(1)
    assert not run_iteration(check, 2, [2.0])
    assert check.exit[0] == EXIT_FAILED_ON_RESULT_VALIDATION and check.exit[2]


def test_a_spiky_loss_is_rerun_and_training_goes_on():
    check = validation(check_for_spiky_loss=True, check_for_nan_in_loss_and_grad=False)
    first_iteration(check)
    for iteration in range(2, 2 + LARGE_SAMPLES):
        check.begin(iteration)
        assert run_iteration(check, iteration, [3.0])
    check.begin(200)
    assert not run_iteration(check, 200, [40.0])
    assert check.again(1)
    assert run_iteration(check, 200, [40.0])  # reproducible but not fatal: step
    assert check.exit is None and check.phase is Phase.IDLE


def test_grad_norm_checks_see_the_local_gradients():
    check = validation(check_for_large_grads=True)
    first_iteration(check)
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([math.nan, 1.0])
    check.begin(2)
    assert not check.at_step(lambda p: p.grad, [param])
    assert check.rejection.message.startswith("found NaN in local grad norm")


@pytest.mark.parametrize(
    "elsewhere, second_loss, code",
    [(False, math.nan, EXIT_RESUME_TO_DISAMBIGUATE),  # same device: cannot tell
     (True, math.nan, EXIT_FAILED_ON_RESULT_VALIDATION),  # reproducible elsewhere: correct
     (True, 2.0, EXIT_FAILED_ON_RESULT_VALIDATION)],  # differs elsewhere: persistent error
)  # fmt: skip
def test_the_resumed_rerun(tmp_path, capsys, elsewhere, second_loss, code):
    check = validation()
    first_iteration(check)
    check.begin(2)
    run_iteration(check, 2, [math.nan])
    check.again(1)
    run_iteration(check, 2, [math.nan])
    check.save(str(tmp_path), 1)
    resumed = validation()
    if elsewhere:
        resumed.identity = "another-host:cuda:3"
    resumed.load(str(tmp_path), 1)
    resumed.begin(2)
    assert resumed.phase is Phase.FROM_CHECKPOINT
    assert not run_iteration(resumed, 2, [second_loss])
    assert resumed.exit[0] == code and not resumed.exit[2]  # the checkpoint is there already
    said = capsys.readouterr().out
    if not elsewhere:
        assert "resumed on the same device" in said
    elif math.isnan(second_loss):
        assert "correct result" in said
    else:
        assert "possible persistent error" in said


def test_a_checkpoint_without_rerun_state_resumes_plainly(tmp_path):
    check = validation()
    check.load(str(tmp_path), 3)
    check.begin(4)
    assert check.phase is Phase.INITIAL
