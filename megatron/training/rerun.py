"""Megatron's result validation (`--rerun-mode validate_results`): an iteration whose loss or
gradient looks wrong is run again before its optimizer step, to tell a transient fault from a
reproducible result.

Every rank checks what it computed: the last stage each microbatch's loss (NaN and Inf, and
with `--check-for-spiky-loss` a loss 10 times the largest of the first 100), every stage its
local gradient norm before the data-parallel reduction (NaN and Inf, and with
`--check-for-large-grads` 10 times the largest of the first 100). The first iteration a
process trains is not checked, as Megatron's (a checkpoint needs one step taken).

At the step every rank learns whether any rank rejected a result (one all-reduce of a few
flags over the world). If one did, no rank steps: the gradients are discarded, the RNG states
and the data go back to the start of the iteration, and the iteration runs again on the same
ranks. The rank that rejected compares its new result with the first:

* different (beyond the check's tolerance): a transient fault. A fatal check (NaN, Inf) saves
  a checkpoint of the iteration before and exits with code 17; a non-fatal one (spiky loss,
  large gradients) steps with the rerun's gradients and goes on.
* the same: the result is reproducible here. A fatal check saves a checkpoint, with the
  validation's state beside it, and exits with code 16: resumed on another device, the run
  repeats the iteration and compares again (the same device again: exits with 16 once more;
  different: "persistent error", the same: "correct result", both exit with 17). A non-fatal
  one goes on.

`--error-injection-rate N` rejects about one validated result in N (never two in one
iteration) and makes the reruns compare as `--error-injection-type` says: a transient error
differs on the first rerun, a persistent error matches there and differs after the resume,
a correct result matches both times. `--result-rejected-tracker-filename` gets a line per
event. Only synchronous schedules have an iteration to run again: an asynchronous stage steps
while other stages still hold its microbatches, so the flag check refuses the mode there.
"""

import argparse
import datetime
import json
import math
import os
import random
import socket
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np
import torch
import torch.distributed as dist

from megatron.common.errors import UserError

EXIT_RESUME_TO_DISAMBIGUATE = 16  # Megatron's codes
EXIT_FAILED_ON_RESULT_VALIDATION = 17
LARGE_FACTOR = 10.0  # "unexpectedly large": this many times the largest of the first samples
LARGE_SAMPLES = 100
MATCH, MISMATCH = 0.0, math.inf  # relative differences
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
STATE_DIR = "rerun_state"
MODES = ("disabled", "validate_results", "report_stats")


def add_rerun_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("result validation (Megatron's rerun engine)").add_argument
    add("--rerun-mode", choices=MODES, default="disabled",
        help="validate_results: run an iteration whose loss or gradient norm is rejected again "
        "before its step, to tell transient faults from reproducible results (synchronous "
        "schedules). Megatron's default is validate_results; ours is disabled")  # fmt: skip
    add("--error-injection-rate", type=int, default=0,
        help="reject about one validated result in N (testing the validation; 0: never)")  # fmt: skip
    add("--error-injection-type", choices=INJECTION_TYPES, default="transient_error",
        help="how the reruns of an injected rejection compare")  # fmt: skip
    add("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
        action="store_false", help="do not validate losses and gradient norms for NaN and Inf")  # fmt: skip
    add("--check-for-spiky-loss", action="store_true",
        help="reject a loss 10 times the largest of the first 100 (not fatal)")  # fmt: skip
    add("--check-for-large-grads", action="store_true",
        help="reject a gradient norm 10 times the largest of the first 100 (not fatal)")  # fmt: skip
    add("--result-rejected-tracker-filename", default=None,
        help="append a line per rejected result and per rerun's verdict to this file")  # fmt: skip


def validate_rerun_args(args: argparse.Namespace, *, synchronous: bool) -> None:
    """One line per problem. `synchronous`: the schedule empties the pipeline every iteration."""
    if args.rerun_mode == "report_stats":
        raise UserError("--rerun-mode report_stats is not supported yet")
    if args.error_injection_rate < 0:
        raise UserError(f"--error-injection-rate must be >= 0, got {args.error_injection_rate}")
    if args.rerun_mode == "disabled":
        given = [flag for flag, on in (("--error-injection-rate", args.error_injection_rate),
                                       ("--check-for-spiky-loss", args.check_for_spiky_loss),
                                       ("--check-for-large-grads", args.check_for_large_grads),
                                       ("--result-rejected-tracker-filename",
                                        args.result_rejected_tracker_filename)) if on]  # fmt: skip
        if given:
            raise UserError(f"{given[0]} acts only with --rerun-mode validate_results")
        return
    if not synchronous:
        raise UserError(
            f"--rerun-mode validate_results with --pipeline-schedule {args.pipeline_schedule} is "
            "not supported yet: a stage of an asynchronous schedule steps while others still "
            "hold its microbatches, so there is no iteration to run again"
        )
    if args.result_rejected_tracker_filename is not None:
        try:
            with open(args.result_rejected_tracker_filename, "a"):
                pass
        except OSError as error:
            raise UserError(f"--result-rejected-tracker-filename: cannot append to "
                            f"{args.result_rejected_tracker_filename} ({error.strerror})") from None  # fmt: skip


class Phase(str, Enum):
    IDLE = "idle"  # between iterations
    INITIAL = "initial"  # the iteration's first run
    IN_PLACE = "in_place"  # the first rerun, on the same ranks
    SAVE_TO_RESUME = "save_to_resume"  # reproducible: save, resume elsewhere and compare again
    FROM_CHECKPOINT = "from_checkpoint"  # the rerun after such a resume


@dataclass
class Rejection:
    """This rank's first rejected result of the iteration."""

    message: str
    sequence: int  # the how-many-th validation with this message in the iteration
    value: float
    tolerance: float
    fatal: bool


@dataclass
class Flags:
    """What ranks ask for; agreed by an all-reduce (any rank asking is enough)."""

    rerun: bool = False
    resume_elsewhere: bool = False
    same_device: bool = False
    go_on: bool = False


def relative_difference(first: float, second: float) -> float:
    if first == second or (math.isnan(first) and math.isnan(second)):
        return MATCH
    if not (math.isfinite(first) and math.isfinite(second)):
        return MISMATCH
    return abs(first - second) / max(abs(first + second) / 2, 1e-30)


class ErrorInjector:
    """--error-injection-rate / --error-injection-type: its own random stream (the training's
    is left alone), one rejection at most per iteration."""

    def __init__(self, rate: int, kind: str, seed: int, rank: int):
        self.rate, self.kind = rate, kind
        self.random = random.Random(seed * 1_000_003 + rank)
        self.injected: str | None = None  # the kind injected and not yet compared

    def maybe_inject(self) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if self.random.randrange(self.rate) != 0:
            return False
        self.injected = self.kind
        return True

    def compared(self, measured: float, phase: Phase) -> float:
        """The relative difference the rerun reports: the measured one, or the injected
        error's."""
        if self.injected is None:
            return measured
        kind = self.injected
        if phase is Phase.IN_PLACE:
            if kind == "transient_error":
                self.injected = None
                return MISMATCH
            return MATCH  # persistent or correct: reproducible on the same device
        self.injected = None
        return MISMATCH if kind == "persistent_error" else MATCH

    def state_dict(self) -> dict:
        return {"injected": self.injected, "random": list(self.random.getstate()[1])}

    def load_state_dict(self, state: dict) -> None:
        self.injected = state["injected"]
        self.random.setstate((3, tuple(state["random"]), None))


@dataclass
class LargeValues:
    """The largest of the first `LARGE_SAMPLES` finite values of each quantity."""

    counts: dict = field(default_factory=dict)
    maxima: dict = field(default_factory=dict)

    def is_large(self, value: float, what: str) -> bool:
        if not math.isfinite(value):
            return False  # NaN and Inf have their own checks
        value = abs(value)
        if self.counts.get(what, 0) < LARGE_SAMPLES:
            self.counts[what] = self.counts.get(what, 0) + 1
            self.maxima[what] = max(self.maxima.get(what, 0.0), value)
            return False
        return value >= self.maxima[what] * LARGE_FACTOR


class ReplayableIterator:
    """The training data, able to hand out an iteration's microbatches again."""

    def __init__(self, iterator):
        self.iterator, self.read, self.pending = iterator, [], []

    def __iter__(self):
        return self

    def __next__(self):
        if self.pending:
            return self.pending.pop(0)
        item = next(self.iterator)
        self.read.append(item)
        return item

    def mark(self) -> None:
        """An iteration starts: forget the previous one's microbatches."""
        self.read, self.pending = [], []

    def rewind(self) -> None:
        self.pending = list(self.read)


def _rng_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["tracker"]:
        get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def device_identity(device: torch.device) -> str:
    """Where this rank computes: the host and the device (the local rank's on CPU)."""
    index = device.index if device.index is not None else os.environ.get("LOCAL_RANK", "0")
    return f"{socket.gethostname()}:{device.type}:{index}"


class ResultValidation:
    """This rank's side of `--rerun-mode validate_results` (see the module's docstring).

    Per iteration: `begin`, then one or more runs of the iteration, each calling `check_loss`
    / `check_grad_norm` as results appear and `agree_to_step` once at the step, then `again`
    (whether to run it once more). `exit` is set when the run must end: (code, why, whether
    to save a checkpoint first)."""

    def __init__(self, training, *, device: torch.device, rank: int):
        self.nan_checks = training.check_for_nan_in_loss_and_grad
        self.spiky_loss = training.check_for_spiky_loss
        self.large_grads = training.check_for_large_grads
        self.tracker_file = training.result_rejected_tracker_filename
        self.injector = ErrorInjector(training.error_injection_rate,
                                      training.error_injection_type, training.seed, rank)  # fmt: skip
        self.device, self.rank, self.identity = device, rank, device_identity(device)
        self.large = LargeValues()
        self.phase, self.iteration, self.first_iteration_done = Phase.IDLE, 0, False
        self.rejection: Rejection | None = None
        self.suspect: str | None = None  # the device that reproduced a rejected result
        self.asks, self.agreed, self.counts = Flags(), Flags(), {}
        self.rng, self.rerun_next = None, False
        self.data: ReplayableIterator | None = None  # the training data, on ranks reading it
        self.exit: tuple[int, str, bool] | None = None
        self.replayed_microbatches = 0  # forwards of reruns, beyond the iterations' own

    # ------------------------------------------------------------------ the iteration
    def begin(self, iteration: int) -> None:
        resumed = self.phase is Phase.SAVE_TO_RESUME
        self.phase = Phase.FROM_CHECKPOINT if resumed else Phase.INITIAL
        self.rejection = self.rejection if resumed else None
        self.iteration, self.rerun_next = iteration, False
        self.asks, self.counts, self.rng = Flags(), {}, _rng_states()
        if self.data is not None:
            self.data.mark()

    def again(self, microbatches: int) -> bool:
        """After a run of the iteration: whether to run it again (the state is rewound)."""
        if not self.rerun_next:
            self.first_iteration_done = True
            return False
        self.rerun_next, self.asks, self.counts = False, Flags(), {}
        self.replayed_microbatches += microbatches
        _set_rng_states(self.rng)
        if self.data is not None:
            self.data.rewind()
        return True

    def at_step(self, gradient_of, params) -> bool:
        """At the step, on every rank: check the local gradient norm, then agree whether to
        take the step (else the gradients are dropped)."""
        if self.nan_checks or self.large_grads:
            grads = [g for g in map(gradient_of, params) if g is not None]
            squares = torch.stack([g.float().pow(2).sum() for g in grads]) if grads else None
            self.check_grad_norm(0.0 if squares is None else float(squares.sum().sqrt()))
        return self._agree_to_step()

    def _agree_to_step(self) -> bool:
        self.agreed = self._any_rank(self.asks)
        if self.phase is Phase.INITIAL:
            if self.agreed.rerun:
                self.phase, self.rerun_next = Phase.IN_PLACE, True
                self._say("a result was rejected: the iteration runs again", everywhere=False)
            return not self.agreed.rerun
        if self.agreed.go_on:  # a non-fatal check: step with the rerun's gradients
            self.phase = Phase.IDLE
            self._say("the failed validation was not fatal: training goes on", everywhere=False)
            return True
        if self.phase is Phase.IN_PLACE and self.agreed.resume_elsewhere:
            self.phase = Phase.SAVE_TO_RESUME
            self.exit = (EXIT_RESUME_TO_DISAMBIGUATE, "a rejected result is reproducible: "
                         "resume from the checkpoint on another device to compare", True)  # fmt: skip
        elif self.phase is Phase.IN_PLACE:
            self.exit = (EXIT_FAILED_ON_RESULT_VALIDATION,
                         "a rejected result did not reproduce: possible transient error", True)  # fmt: skip
        elif self.agreed.same_device:
            self.exit = (EXIT_RESUME_TO_DISAMBIGUATE, "resumed on the device that reproduced the "
                         "rejected result: resume from the same checkpoint elsewhere", False)  # fmt: skip
        else:
            self.exit = (EXIT_FAILED_ON_RESULT_VALIDATION,
                         "the rerun on another device settled the rejected result", False)  # fmt: skip
        return False

    # ------------------------------------------------------------------ the checks
    def check_loss(self, loss: torch.Tensor) -> None:
        value = float(loss.detach().float().sum())
        if self.nan_checks:
            self._check(value, "found NaN in local forward loss calculation",
                        lambda: math.isnan(value), tolerance=0.0, fatal=True)  # fmt: skip
            self._check(value, "found Inf in local forward loss calculation",
                        lambda: math.isinf(value), tolerance=0.0, fatal=True)  # fmt: skip
        if self.spiky_loss:
            self._check(value, "Spiky loss", lambda: self.large.is_large(value, "loss"),
                        tolerance=0.0, fatal=False)  # fmt: skip

    def check_grad_norm(self, norm: float) -> None:
        where = "in local grad norm before the data-parallel reduction"
        if self.nan_checks:  # 0.1%: a backward pass need not be deterministic (Megatron's)
            self._check(norm, f"found NaN {where}", lambda: math.isnan(norm),
                        tolerance=1e-3, fatal=True)  # fmt: skip
            self._check(norm, f"found Inf {where}", lambda: math.isinf(norm),
                        tolerance=1e-3, fatal=True)  # fmt: skip
        if self.large_grads:
            self._check(norm, f"found unexpected large grads {where}",
                        lambda: self.large.is_large(norm, "grads"), tolerance=1e-3, fatal=False)  # fmt: skip

    def _check(self, value: float, message: str, rejects, *, tolerance: float, fatal: bool):
        sequence = self.counts[message] = self.counts.get(message, 0) + 1
        if self.phase is Phase.INITIAL:
            # Megatron's rule: the first iteration of a process steps unchecked
            if self.rejection is not None or not self.first_iteration_done:
                return
            injected = self.injector.maybe_inject()
            if injected or rejects():
                self.rejection = Rejection(message, sequence, value, tolerance, fatal)
                self.asks.rerun = True
                self._record("INITIAL_RUN", value, message)
                how = " (an injected error)" if injected else ""
                self._say(f"unexpected result {value} (message='{message}'){how}")
        elif self.rejection is not None and (message, sequence) == (
            self.rejection.message,
            self.rejection.sequence,
        ):
            self._compare(value)

    def _compare(self, value: float) -> None:
        first = self.rejection
        if self.phase is Phase.FROM_CHECKPOINT and self.identity == self.suspect:
            self.asks.same_device = True
            self._say(f"resumed on the same device {self.identity}: cannot compare here")
            return
        difference = self.injector.compared(relative_difference(first.value, value), self.phase)
        same = difference <= first.tolerance
        self.asks.go_on = not first.fatal
        if self.phase is Phase.IN_PLACE:
            status = "FIRST_RERUN_REPRODUCIBLE" if same else "FIRST_RERUN_NOT_REPRODUCIBLE"
            verdict = ("reproducible: rerun on another device to tell" if same
                       else "not reproducible: possible transient error")  # fmt: skip
            self.asks.resume_elsewhere = same and first.fatal
            self.suspect = self.identity if same else None
        else:
            status = "SECOND_RERUN_REPRODUCIBLE" if same else "SECOND_RERUN_NOT_REPRODUCIBLE"
            verdict = ("reproducible on another device: correct result (possibly an "
                       "application error)" if same else "not reproducible on another device: "
                       "possible persistent error")  # fmt: skip
        self._record(status, value, first.message)
        self._say(f"rerun: {value} vs {first.value} first: {verdict}")

    # ------------------------------------------------------------------ agreement, reports
    def _any_rank(self, asks: Flags) -> Flags:
        names = list(asdict(asks))
        flags = torch.tensor([int(getattr(asks, n)) for n in names], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return Flags(**{n: bool(v) for n, v in zip(names, flags.tolist())})

    def _say(self, text: str, everywhere: bool = True) -> None:
        if everywhere or self.rank == 0:
            print(f"> rerun [rank {self.rank}, iteration {self.iteration}]: {text}", flush=True)

    def _record(self, status: str, value: float, message: str) -> None:
        """--result-rejected-tracker-filename: one line per event, in Megatron's fields."""
        if self.tracker_file is None:
            return
        line = (f"ts={datetime.datetime.now()} node={socket.gethostname()} "
                f"device={self.identity} jobID={os.environ.get('SLURM_JOBID', 'N/A')} "
                f"rank={self.rank} iteration={self.iteration} status={status} result={value} "
                f"message='{message}'\n")  # fmt: skip
        with open(self.tracker_file, "a") as tracker:
            tracker.write(line)

    # ------------------------------------------------------------------ checkpoints
    def state_file(self, root: str, iteration: int) -> str:
        return os.path.join(root, f"iter_{iteration:07d}", STATE_DIR, f"rank_{self.rank:05d}.json")

    def save(self, root: str, iteration: int) -> None:
        """Beside the checkpoint of `iteration`: what the resumed run needs to compare."""
        from megatron.training.checkpointing.save_load import atomic_write_text

        state = {"phase": self.phase.value, "suspect": self.suspect,
                 "rejection": None if self.rejection is None else asdict(self.rejection),
                 "injector": self.injector.state_dict(), "large": asdict(self.large)}  # fmt: skip
        path = self.state_file(root, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(state))

    def load(self, root: str, iteration: int) -> None:
        """After a checkpoint of `iteration` is loaded: its rerun state, if it has one."""
        path = self.state_file(root, iteration)
        if not os.path.exists(path):
            return
        with open(path) as file:
            state = json.load(file)
        self.phase, self.suspect = Phase(state["phase"]), state["suspect"]
        self.rejection = state["rejection"] and Rejection(**state["rejection"])
        self.injector.load_state_dict(state["injector"])
        self.large = LargeValues(**state["large"])
        self._say(f"resuming to rerun iteration {iteration + 1} on {self.identity}")
