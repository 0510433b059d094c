"""Stopping early on request, in one process: the SIGTERM flag, the elapsed-time reason, and
the stop agreement of asynchronous schedules through a key-value store (the real runs, with
torchrun and SIGTERM, are in tests/functional_tests/test_run_control.py)."""

import math
import os
import signal
import time

import pytest
import torch.distributed as dist

from megatron.training.config import TrainingConfig
from megatron.training.run_control import (
    SignalFlag,
    StopRequests,
    StoreAgreement,
    iterations_ahead,
)


def run_args(signal_handler=False, minutes=None):
    return TrainingConfig(exit_signal_handler=signal_handler, exit_duration_in_mins=minutes)


def test_sigterm_is_caught_and_the_previous_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    flag = SignalFlag()
    try:
        assert not flag.received
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the flag
        time.sleep(0.05)
        assert flag.received
    finally:
        flag.release()
    assert signal.getsignal(signal.SIGTERM) == before


def test_reasons_of_a_rank():
    requests = StopRequests(run_args(signal_handler=True), start_time=time.perf_counter())
    try:
        assert requests.reason() is None
        requests.flag.received = True
        assert requests.reason() == "--exit-signal-handler: SIGTERM received"
    finally:
        requests.release()
    started_long_ago = time.perf_counter() - 120.0
    assert (
        StopRequests(run_args(minutes=1.0), started_long_ago)
        .reason()
        .startswith("--exit-duration-in-mins: 2.00 minutes elapsed")
    )
    assert StopRequests(run_args(minutes=5.0), started_long_ago).reason() is None


class Reason:
    def __init__(self, text=None):
        self.text = text

    def reason(self):
        return self.text


def agreements(store, reasons, num_stages=4, m=4):
    """One StoreAgreement per 'rank', as each process of a run builds one (same run count)."""
    import megatron.training.run_control as run_control

    runs = run_control._runs
    made = []
    for reason in reasons:
        run_control._runs = runs  # every process counts its runs alike
        made.append(StoreAgreement(Reason(reason), num_stages, m, store))
    return made


@pytest.mark.parametrize("num_stages, m", [(4, 4), (4, 1), (8, 8), (8, 2), (1, 4)])
def test_first_proposal_wins_and_is_far_enough_ahead(num_stages, m):
    store = dist.HashStore()
    quiet, asking, late = agreements(store, [None, "sig", "time"], num_stages, m)
    cumulative = lambda iteration: iteration * m  # noqa: E731 - a constant batch
    assert quiet.stop_before(5, cumulative) is None  # nothing asked: no decision
    agreed = asking.stop_before(5, cumulative)
    assert agreed == 5 + iterations_ahead(num_stages, m) == 5 + math.ceil((2 * num_stages - 1) / m)
    # the margin: B(agreed) >= B(4) + 2N - 1 + m, and the iteration before falls short
    assert cumulative(agreed) >= cumulative(4) + 2 * num_stages - 1 + m
    assert agreed == 5 or cumulative(agreed - 1) < cumulative(4) + 2 * num_stages - 1 + m
    assert late.stop_before(6, cumulative) == agreed and late.reason == "sig"  # adopted
    assert quiet.stop_before(6, cumulative) == agreed and quiet.reason == "sig"
    assert quiet.stop_after(agreed) and not quiet.stop_after(agreed - 1)


def test_margin_counts_microbatches_when_the_batch_ramps():
    sizes = [1, 1, 2, 2, 4, 4, 4, 4]
    cumulative = lambda iteration: sum(sizes[:iteration])  # noqa: E731
    (asking,) = agreements(dist.HashStore(), ["sig"], num_stages=4, m=4)
    # at the start of iteration 2: B(1) = 1, needs B(k) >= 1 + 7 + 4 = 12: B(5) = 10, B(6) = 14
    assert asking.stop_before(2, cumulative) == 6
