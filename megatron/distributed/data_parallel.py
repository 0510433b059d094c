"""Data-parallel gradient reduction in buckets, overlapped with the backward when asked.

Megatron's DDP shape, written for gloo and NCCL alike (megatron-core's is CUDA-only):

* The stage's trainable parameters are cut into **buckets** of about `--ddp-bucket-size`
  parameters (`bucket_ranges`), filled from the last parameter backwards, since a backward
  finishes the last layers' gradients first. Bucket 0 holds the last parameters.
* With `--overlap-grad-reduce` the runtime tells the reduction when the pass that completes a
  chunk's gradients for the coming step begins (`before_final_pass`: the last accumulated
  backward under 1F1B-flush, the a-th under PACI, the W pass of a split backward). From then
  on, a post-accumulate-grad hook marks each parameter ready; a bucket whose parameters are
  all ready is launched asynchronously (`async_op=True`), and buckets launch strictly in their
  order so that every replica issues the same collectives in the same order. The step waits
  for them (`finish`) just before it needs the averaged gradients.
* Without overlap the same buckets are reduced one after another at the step. Both ways reduce
  the same bytes in the same buckets with the same operation, so a run's numbers are the same
  bit for bit with overlap on or off (a sum over 4 replicas rounds the same way). Without
  `--ddp-bucket-size` and without overlap there is one bucket: the whole stage, as before.
* A parameter whose gradient is changed between the backward and the reduction (the tied
  embedding's exchange, the tensor-parallel sum of layernorm gradients) makes its bucket
  *late*: it is launched at the step, after those changes, never from a hook.

The reduction works on a copy of each bucket's gradients (the communication buffer) and copies
the result back when it lands, so what reads the gradients before the step (the NaN check,
`--log-num-zeros-in-grad`, result validation) sees them as without overlap.

`ReductionTimes` records, per step, the time a reduction was in flight and the time the step
waited for one (`dp_reduce_s`, `dp_exposed_s` in the log and summary.json), and with
`--overlap-param-gather` (training/optimizer/param_gather.py) the same for the gathers of the
updated parameters (`dp_param_gather_s`, `dp_param_gather_exposed_s` in summary.json).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.common.errors import UserError

# Megatron's default bucket size with overlap: max(40M, 1M x data-parallel size) parameters
DEFAULT_BUCKET_PARAMS = 40_000_000
DEFAULT_BUCKET_PARAMS_PER_RANK = 1_000_000


def default_bucket_size(data_parallel_size: int) -> int:
    return max(DEFAULT_BUCKET_PARAMS, DEFAULT_BUCKET_PARAMS_PER_RANK * data_parallel_size)


def resolve_bucket_size(
    *,
    overlap: bool,
    bucket_size: int | None,
    num_buckets: int | None,
    num_parameters: int,
    data_parallel_size: int,
) -> int | None:
    """Parameters per bucket (None: one bucket). `--ddp-num-buckets N` gives the stage's
    parameters // N (as Megatron); `--ddp-bucket-size` is taken as given, with or without
    overlap (Megatron drops it without overlap; here the same buckets then reduce at the step,
    so overlap can be switched without changing a bit); with overlap and neither, Megatron's
    default."""
    if num_buckets is not None:
        return max(1, num_parameters // num_buckets)
    if bucket_size is not None:
        return bucket_size
    return default_bucket_size(data_parallel_size) if overlap else None


def bucket_ranges(
    numels: Sequence[int], bucket_size: int | None, *, chunk_starts: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """Parameter index ranges [first, last) in model order, bucket 0 first: filled from the last
    parameter backwards, a bucket closing once it holds `bucket_size` elements or more (a
    parameter is never split). None: one bucket of everything. `chunk_starts`: the indices
    where a model chunk begins (virtual stages): no bucket spans two chunks, whose gradients
    are final at different passes."""
    edges = sorted({0, len(numels), *chunk_starts})
    ranges: list[tuple[int, int]] = []
    for low, high in reversed(list(zip(edges, edges[1:]))):
        ranges += _fill_backwards(numels, low, high, bucket_size)
    return ranges


def _fill_backwards(numels, low: int, high: int, bucket_size: int | None):
    if bucket_size is None:
        return [(low, high)]
    ranges, last, filled = [], high, 0
    for index in range(high - 1, low - 1, -1):
        filled += numels[index]
        if filled >= bucket_size:
            ranges.append((index, last))
            last, filled = index, 0
    if last > low:
        ranges.append((low, last))
    return ranges


def add_data_parallel_args(parser) -> None:
    add = parser.add_argument_group("data-parallel reduction").add_argument
    add("--overlap-grad-reduce", action="store_true",
        help="launch each bucket's data-parallel reduction as soon as its gradients of the step "
        "are final, during the pass that completes them; the step waits for the rest")  # fmt: skip
    add("--ddp-bucket-size", type=int, default=None,
        help="parameters per data-parallel reduction bucket (default with --overlap-grad-reduce: "
        "max(40M, 1M x data-parallel size); without it one bucket, unless given)")  # fmt: skip
    add("--ddp-num-buckets", type=int, default=None,
        help="the stage's parameters in this many buckets instead (excludes --ddp-bucket-size)")  # fmt: skip


def validate_data_parallel_args(args) -> None:
    """--ddp-bucket-size / --ddp-num-buckets, as Megatron checks them."""
    if args.ddp_num_buckets is not None and args.ddp_bucket_size is not None:
        raise UserError("--ddp-num-buckets and --ddp-bucket-size exclude each other")
    if args.ddp_num_buckets is not None and args.ddp_num_buckets <= 0:
        raise UserError(f"--ddp-num-buckets must be > 0, got {args.ddp_num_buckets}")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise UserError(f"--ddp-bucket-size must be > 0 parameters, got {args.ddp_bucket_size}")


# ---------------------------------------------------------------------------- timing
@dataclass
class ReductionTimes:
    """The stage's data-parallel reduction, timed: seconds with a reduction in flight (the
    union of its buckets' intervals: `reduce_s`), seconds the step waited with one still in
    flight (`exposed_s`: what the overlap did not hide; at most `reduce_s`), bytes handed to
    the collectives, and buckets launched from the backward's hooks or at the step. Totals over the run, and since the last `take()`.
    The `gather_` fields: the distributed optimizer's overlapped parameter gathers, alike
    (the waits are those of the forward's hooks and of whatever must see every parameter)."""

    reduce_s: float = 0.0
    exposed_s: float = 0.0
    bytes: int = 0
    buckets_in_backward: int = 0
    buckets_at_step: int = 0
    gather_s: float = 0.0
    gather_exposed_s: float = 0.0
    gather_bytes: int = 0  # what this rank received: the other ranks' parts of its buckets
    gathers: int = 0  # steps whose parameters were gathered in overlapped buckets
    _interval: list = field(default_factory=lambda: [0.0, 0.0])
    _spans: list = field(default_factory=list)
    # (name, start, end) of each bucket's reduction and each wait for one, for the timeline
    # (--timeline-file); None: not recorded
    events: list | None = None

    def add_span(self, start: float, end: float, name: str = "reduce") -> None:
        self._spans.append((start, end))
        if self.events is not None:
            self.events.append((name, start, end))

    def add_exposed(self, seconds: float, end: float | None = None) -> None:
        self.exposed_s += seconds
        self._interval[1] += seconds
        if self.events is not None and end is not None and seconds > 0:
            self.events.append(("wait", end - seconds, end))

    def close_step(self) -> None:
        """Count this step's bucket spans once where they overlap."""
        covered = _covered(self._spans)
        self.reduce_s += covered
        self._interval[0] += covered
        self._spans.clear()

    def add_gather_wait(self, seconds: float) -> None:
        self.gather_exposed_s += seconds

    def close_gather(self, spans: list) -> None:
        """A step's parameter gathers all landed: `spans`, (launch, landing) per bucket."""
        self.gather_s += _covered(spans)
        self.gathers += 1

    def take(self) -> tuple[float, float]:
        """(reduce_s, exposed_s) since the last call."""
        taken = tuple(self._interval)
        self._interval = [0.0, 0.0]
        return taken

    def report(self) -> dict:
        hidden = 1.0 - self.exposed_s / self.reduce_s if self.reduce_s > 0 else 0.0
        report = {
            "dp_reduce_s": self.reduce_s,
            "dp_exposed_s": self.exposed_s,
            "dp_hidden_fraction": max(0.0, hidden),
            "dp_reduced_bytes": self.bytes,
            "dp_buckets_in_backward": self.buckets_in_backward,
            "dp_buckets_at_step": self.buckets_at_step,
        }
        if self.gathers:  # --overlap-param-gather
            hidden = 1.0 - self.gather_exposed_s / self.gather_s if self.gather_s > 0 else 0.0
            report.update(
                dp_param_gather_s=self.gather_s,
                dp_param_gather_exposed_s=self.gather_exposed_s,
                dp_param_gather_hidden_fraction=max(0.0, hidden),
                dp_param_gather_bytes=self.gather_bytes,
                dp_param_gathers=self.gathers,
            )
        return report


def _covered(spans) -> float:
    """Seconds covered by the (start, end) spans, counted once where they overlap."""
    covered, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            covered, reach = covered + end - start, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    return covered


class ReductionFailed(RuntimeError):
    """A data-parallel collective failed: it timed out (a replica is stuck) or a replica is
    gone. The message names this rank, what was reduced (`what`: a bucket's gradients, the
    loss) and the group's ranks."""

    def __init__(self, what: str, group, cause: BaseException):
        text = str(cause).strip()
        self.timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        if self.timed_out:
            problem = "got nothing within --distributed-timeout-minutes: a replica is stuck"
        else:  # gloo's message starts with its source location: keep what follows
            problem = (re.sub(r"^\[[^\]]*\]\s*", "", text) or type(cause).__name__).splitlines()[0]
        ranks = dist.get_process_group_ranks(group) if group is not None else "all"
        super().__init__(f"rank {dist.get_rank()}: {what} over ranks {ranks} failed: {problem}")


@contextlib.contextmanager
def named_reduction(what: str, group):
    """A data-parallel collective run inside that fails raises a `ReductionFailed` naming
    `what`, which the entry point reports in one line (a raw gloo or NCCL traceback before)."""
    try:
        yield
    except RuntimeError as error:
        raise ReductionFailed(what, group, error) from error


# ---------------------------------------------------------------------------- buckets
class Bucket:
    """Some parameters whose gradients reduce in one collective. `launch` starts it (returns
    the work handles), `land` waits and writes the averaged gradients back."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], late: bool):
        self.index, self.params, self.late = index, params, late
        self.ready: set[int] = set()
        self.works: list = []
        self.launched = False
        self.launched_at = 0.0
        self.landed_at: float | None = None

    def __repr__(self) -> str:
        return f"bucket {self.index} ({len(self.params)} parameters)"


class BucketStrategy:
    """How a gradient holder's buckets reduce: start the collective(s) of a bucket, then finish
    it once they landed. Subclasses: `CopiedAllReduce` (gradients anywhere), the holders'
    own (main_params.py, distributed_optimizer.py)."""

    def start(self, bucket: Bucket) -> list:
        raise NotImplementedError

    def finish(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def discard(self, bucket: Bucket) -> None:
        """Forget a launched bucket whose result is not wanted (the step's gradients dropped)."""

    def bytes_of(self, bucket: Bucket) -> int:
        return sum(p.numel() for p in bucket.params) * 4


class CopiedAllReduce(BucketStrategy):
    """The bucket's gradients laid end to end in a buffer of their own, all-reduced there and
    copied back: the mean over `group` (a sum and a division, or the collective's own average
    with `in_collective`)."""

    def __init__(self, gradient_of: Callable, group, *, in_collective: bool = False):
        self.gradient_of, self.group, self.in_collective = gradient_of, group, in_collective
        self.buffers: dict[int, torch.Tensor] = {}

    def start(self, bucket: Bucket) -> list:
        flat = torch.cat([self.gradient_of(p).reshape(-1) for p in bucket.params])
        self.buffers[bucket.index] = flat
        op = dist.ReduceOp.AVG if self.in_collective else dist.ReduceOp.SUM
        return [dist.all_reduce(flat, op=op, group=self.group, async_op=True)]

    def finish(self, bucket: Bucket) -> None:
        flat = self.buffers.pop(bucket.index)
        if not self.in_collective:
            flat.div_(dist.get_world_size(self.group))
        offset = 0
        for param in bucket.params:
            grad = self.gradient_of(param)
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def discard(self, bucket: Bucket) -> None:
        self.buffers.pop(bucket.index, None)

    def bytes_of(self, bucket: Bucket) -> int:
        return sum(self.gradient_of(p).numel() * self.gradient_of(p).element_size()
                   for p in bucket.params)  # fmt: skip


class BucketedReduction:
    """The stage's data-parallel gradient reduction: its buckets, launched from hooks during
    the final pass of a step (with overlap) or at the step, and waited for at the step.

    `params` in model order, `ranges` from `bucket_ranges`, `strategy` how a bucket reduces.
    `chunk_of(param)` names the model chunk a parameter belongs to (virtual stages: each chunk
    arms on its own final pass). Call `mark_late(params)` for parameters changed between the
    backward and the reduction, `attach_hooks()` to overlap, `finish()` at the step."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        ranges: list[tuple[int, int]],
        strategy: BucketStrategy,
        *,
        chunk_of: Callable[[torch.nn.Parameter], int] = lambda param: 0,
        times: ReductionTimes | None = None,
    ):
        self.params, self.strategy, self.chunk_of = params, strategy, chunk_of
        self.buckets = [Bucket(i, params[a:b], late=False) for i, (a, b) in enumerate(ranges)]
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.armed_chunks: set[int] = set()
        self.next_to_launch = 0  # buckets launch in index order, late ones skipped
        self.held = False  # launched and left in flight while the next step accumulates
        self.overlaps = False
        self.times = times or ReductionTimes()
        self._hooks: list = []

    # ------------------------------------------------------------------ set-up
    def mark_late(self, params) -> None:
        for param in params:
            bucket = self.bucket_of.get(id(param))
            if bucket is not None:
                bucket.late = True

    def attach_hooks(self) -> None:
        """Overlap: each parameter's post-accumulate-grad hook marks it ready while its chunk's
        final pass runs. Registered after the gradient holder's own hook (fp32 accumulation),
        which must have run before the bucket reads the gradient."""
        self.overlaps = True
        for param in self.params:
            self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.overlaps = False

    # ------------------------------------------------------------------ during the backward
    def before_final_pass(self, chunk: int) -> None:
        """The pass about to run completes `chunk`'s gradients for the coming step."""
        if self.overlaps:
            self.armed_chunks.add(chunk)

    def chunk_complete(self, chunk: int) -> None:
        """`chunk`'s gradients for the coming step are all in (an asynchronous schedule with
        several chunks learns it at the rank's last pass before the step): its buckets may go."""
        if not self.overlaps:
            return
        for param in self.params:
            if self.chunk_of(param) == chunk:
                self.bucket_of[id(param)].ready.add(id(param))
        self._launch_ready()

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        bucket = self.bucket_of.get(id(param))
        if bucket is None:
            return
        if bucket.launched:
            if self.held:  # PACI's deferred step: the next step's gradients, beside the copy
                return
            raise RuntimeError(
                f"a gradient was accumulated into {bucket}, whose reduction is in flight: the "
                "pass that completes the step's gradients was announced too early"
            )
        if self.chunk_of(param) not in self.armed_chunks:
            return
        bucket.ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if bucket.late:
                self.next_to_launch += 1
                continue
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self.times.buckets_in_backward += 1
            self.next_to_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched, bucket.launched_at, bucket.landed_at = True, time.perf_counter(), None
        bucket.works = self.strategy.start(bucket)
        self.times.bytes += self.strategy.bytes_of(bucket)
        if bucket.works:
            try:
                future = bucket.works[-1].get_future()
            except RuntimeError:  # gloo's list reduce-scatter has none: timed when waited for
                return
            future.then(lambda _, bucket=bucket: self._landed(bucket))

    @staticmethod
    def _landed(bucket: Bucket) -> None:
        bucket.landed_at = time.perf_counter()

    # ------------------------------------------------------------------ at the step
    def launch_rest(self) -> None:
        """Launch every bucket not launched yet (in bucket order, then the late ones), without
        waiting: PACI's deferred step waits later, in `finish`."""
        for late in (False, True):
            for bucket in self.buckets:
                if not bucket.launched and bucket.late == late:
                    self._launch(bucket)
                    self.times.buckets_at_step += 1
        self.armed_chunks.clear()

    def hold(self) -> None:
        """Leave the launched buckets in flight while the next step's passes accumulate into
        the gradients (their copies are what is reduced); `finish` lands them."""
        self.launch_rest()
        self.held = True

    def finish(self) -> None:
        """Launch what is left (in bucket order, then the late buckets), wait for every bucket
        and write the averaged gradients back. The exposed time: the part of this wait with a
        reduction still in flight."""
        start = time.perf_counter()
        self.launch_rest()
        spans = []
        for bucket in self.buckets:
            for work in bucket.works:
                try:
                    work.wait()
                except RuntimeError as error:
                    what = f"the data-parallel reduction of {bucket}"
                    raise ReductionFailed(what, self.strategy.group, error) from error
            bucket.works = []
            self.strategy.finish(bucket)
            end = bucket.landed_at or time.perf_counter()
            spans.append((bucket.launched_at, max(end, bucket.launched_at)))
            self.times.add_span(*spans[-1], f"reduce bucket {bucket.index}")
        now = time.perf_counter()
        # the launches and the write-backs of the averaged gradients are the step's own work
        waited = [(max(first, start), min(last, now)) for first, last in spans]
        exposed = _covered([(first, last) for first, last in waited if last > first])
        self.times.add_exposed(exposed, now)
        self.times.close_step()
        self.reset()

    def reset(self) -> None:
        """Forget this step's progress (after `finish`, or when a step's gradients are dropped
        before any was launched)."""
        for bucket in self.buckets:
            for work in bucket.works:  # still in flight: let it land, then drop its result
                work.wait()
            if bucket.works:
                self.strategy.discard(bucket)
            bucket.ready.clear()
            bucket.works, bucket.launched = [], False
        self.armed_chunks.clear()
        self.next_to_launch = 0
        self.held = False

    @property
    def in_flight(self) -> bool:
        return any(bucket.launched for bucket in self.buckets)
