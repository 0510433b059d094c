"""Stopping early on request: `--exit-signal-handler` and `--exit-duration-in-mins`.

Megatron, after every iteration, asks whether any rank caught SIGTERM (an all-gather over the
world) or has run longer than `--exit-duration-in-mins` (an all-reduce MAX); if so every rank
saves a checkpoint (with `--save`) and the program exits with status 0. Every rank must take
the decision at the same iteration, with the pipeline empty.

* **1F1B-flush** does exactly that: its pipeline is empty after every iteration and its step
  already takes a model-wide gradient norm, so one more small all-reduce changes nothing in
  kind. The run stops after the iteration at which the request is first seen.
* **PACI** has no point where stages wait for each other, and a per-iteration all-reduce would
  be exactly that. Instead the ranks agree through torch.distributed's key-value store (the
  launcher's rendezvous store; a store request is not a collective, and no rank waits for
  another): at the start of every iteration each rank looks up one key (one round trip to the
  store, about 0.1 ms on loopback). A rank with a reason of its own proposes to stop after an
  iteration `k` (compare-and-set: the first proposal wins, every rank adopts the winner).
  `k` becomes a drain point, so every stage ends `k` with the pipeline empty and the same
  number of steps; the checkpoint is then an ordinary drained one.

  `k` must be seen by every rank before it forwards, or posts a receive for, a microbatch
  past the end of `k`. A rank that starts iteration `j` has already run `B(j-1)` backwards
  (`B(i)`: microbatches in iterations 1..i) and at most `N` more forwards (admission), so a
  proposal made at the start of its iteration `j` takes the first `k >= j` with
  `B(k) >= B(j-1) + 2N - 1 + m` (`m` the largest microbatch count of an iteration): any rank
  that could go past `B(k)` has by then run a backward (or forward) that causally follows the
  proposer's, and it reads the store at the start of every iteration. With a = m, that is
  `ceil((2N - 1) / a)` iterations after the current one: 2 more with 4 stages and a = 4.
"""

import math
import signal
import time
from typing import Callable

import torch
import torch.distributed as dist

_SIGNAL_EXIT, _DURATION_EXIT = "--exit-signal-handler", "--exit-duration-in-mins"
_runs = 0  # pretrain() calls in this process: every rank counts alike, so keys match


class SignalFlag:
    """Catches `sig` (SIGTERM) and remembers it, instead of dying; restored by `release`."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM):
        self.sig, self.received, self.released = sig, False, False
        self._previous = signal.getsignal(sig)
        signal.signal(sig, self._catch)

    def _catch(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        if not self.released:
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(self.sig, previous)
            self.released = True


class StopRequests:
    """This rank's own reasons to stop: a caught signal, or time since the run started."""

    def __init__(self, training, start_time: float):
        """`training`: the run's `TrainingConfig` (--exit-signal-handler,
        --exit-duration-in-mins)."""
        self.flag = SignalFlag() if training.exit_signal_handler else None
        minutes = training.exit_duration_in_mins
        self.limit_s = 60.0 * minutes if minutes else None
        self.start_time = start_time

    def reason(self) -> str | None:
        if self.flag is not None and self.flag.received:
            return f"{_SIGNAL_EXIT}: SIGTERM received"
        elapsed = time.perf_counter() - self.start_time
        if self.limit_s is not None and elapsed > self.limit_s:
            return f"{_DURATION_EXIT}: {elapsed / 60:.2f} minutes elapsed"
        return None

    def release(self) -> None:
        if self.flag is not None:
            self.flag.release()


def requested(training) -> bool:
    return bool(training.exit_signal_handler or training.exit_duration_in_mins)


class FlushAgreement:
    """1F1B-flush: after every iteration, an all-reduce MAX over the world (as Megatron)."""

    def __init__(self, requests: StopRequests, device: torch.device):
        self.requests, self.device = requests, device
        self.reason: str | None = None

    def stop_before(self, iteration: int, cumulative: Callable[[int], int]) -> int | None:
        return None  # decided after each iteration instead

    def stop_after(self, iteration: int) -> bool:
        local = self.requests.reason()
        code = 0 if local is None else (2 if local.startswith(_SIGNAL_EXIT) else 1)
        flag = torch.tensor([code], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed:
            elsewhere = (f"{_SIGNAL_EXIT}: SIGTERM received by another rank" if agreed == 2
                         else f"{_DURATION_EXIT}: another rank's time is up")  # fmt: skip
            self.reason = local or elsewhere
        return bool(agreed)


class StoreAgreement:
    """Asynchronous schedules: the stop iteration agreed through the key-value store."""

    def __init__(self, requests: StopRequests, num_stages: int, max_microbatches: int, store):
        global _runs
        _runs += 1
        self.requests, self.store = requests, store
        self.key = f"megatron_run_control/{_runs}/stop_after"
        self.margin = 2 * num_stages - 1 + max_microbatches  # microbatches, see the module
        self.stop, self.reason = None, None

    def stop_before(self, iteration: int, cumulative: Callable[[int], int]) -> int | None:
        """At the start of `iteration`: the agreed last iteration, if any (one store lookup;
        a proposal when this rank has a reason of its own). `cumulative(i)` is B(i)."""
        if self.stop is not None:
            return self.stop
        if self.store.check([self.key]):
            value = self.store.get(self.key).decode()
        else:
            local = self.requests.reason()
            if local is None:
                return None
            proposal = f"{self._proposal(iteration, cumulative)}|{local}"
            value = self.store.compare_set(self.key, "", proposal).decode()
        stop, reason = value.split("|", 1)
        self.stop, self.reason = int(stop), reason
        return self.stop

    def _proposal(self, iteration: int, cumulative: Callable[[int], int]) -> int:
        needed, k = cumulative(iteration - 1) + self.margin, iteration
        while cumulative(k) < needed:
            k += 1
        return k

    def stop_after(self, iteration: int) -> bool:
        return self.stop is not None and iteration >= self.stop


def build_agreement(config, requests: StopRequests, device: torch.device):
    """The agreement the run's schedule allows (None without either flag)."""
    if not requested(config.training):
        return None
    plan = config.pipeline.plan
    if plan.flushes:
        return FlushAgreement(requests, device)
    store = dist.distributed_c10d._get_default_store()
    return StoreAgreement(requests, plan.num_stages, config.training.num_microbatches, store)


def iterations_ahead(num_stages: int, microbatches: int) -> int:
    """How many iterations after the current one a PACI stop is agreed for (constant m)."""
    return math.ceil((2 * num_stages - 1) / microbatches)
