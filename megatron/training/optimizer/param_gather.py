"""`--overlap-param-gather`: the distributed optimizer's updated parameters gathered in buckets,
asynchronously, each bucket waited for by the first forward that reads it.

Without the flag `ShardedMainOptimizer._gather_params` all-gathers the whole updated buffer
right after the inner optimizer's step and copies every parameter out of it before the step
returns. With it the step writes this rank's updated range and launches one asynchronous
gather per bucket of the gradient reduction (`ShardedReduceScatter`'s flat ranges: the same
ranges, launched in the same order on every replica) and returns; then

* a forward pre-hook on every module that directly holds parameters waits for the buckets
  holding them and copies those parameters out (`wait_for`), so a layer waits only for its
  own buckets and the gathers of the later layers go on under the earlier layers' forwards;
* everything that reads the parameters outside a forward calls `finish` first (through
  `StageOptimizerStep.finish_param_gather`): the runtime before every backward and W pass
  (PACI may run one right after its step), the next step, the tied embedding's exchange, the
  parameter norm, the replica hash check, every drain (evaluation, checkpoint, health check,
  the end of training), a checkpoint's save or load.

Why broadcasts and not an all-gather: rank r owns the contiguous range [r S, (r + 1) S) of the
whole flat buffer, so a bucket's parts are uneven and a small bucket usually lies in one or
two ranks' ranges. A padded all-gather would make every rank send max-part elements, so every
rank would receive (D - 1) x max-part: (D - 1) times the bucket when one rank owns it all. A
broadcast of each non-empty part from its owner makes each rank receive exactly the part it
lacks (the bucket less its own part), the fewest bytes possible, in one collective per owner
(usually one or two per bucket).

The values are those of `_gather_params` bit for bit: each rank's fp32 main pieces rounded to
the model's dtype once, then copied unchanged into every replica's parameters.

Tests: `MEGATRON_POISON_UNGATHERED_PARAMS=1` fills every parameter with NaN when its bucket is
launched, so a read before the parameter was copied out turns the losses into NaN, which the
bit-identity cases (tests/functional_tests/test_data_parallel_overlap_cases.py) would see.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.distributed.data_parallel import ReductionTimes
from megatron.pipeline.accounting import preserve_versions

POISON_ENV = "MEGATRON_POISON_UNGATHERED_PARAMS"


@dataclass
class BucketGather:
    """One bucket of the flat parameter buffer: its range, what fills it and where its
    parameters lie in it; while in flight, the bucket's values and the collectives' handles."""

    index: int
    start: int  # [start, end) in the flat buffer, the padding left out
    end: int
    # (main piece, first element in the piece, last + 1, where it goes in the bucket): this
    # rank's updated values that fall in the bucket
    own_segments: list
    params: list  # (parameter, its first element in the bucket)
    owners: list  # (group rank, first, last + 1 in the bucket): each non-empty part's owner
    values: torch.Tensor | None = None
    works: list = field(default_factory=list)
    launched_at: float = 0.0
    landed_at: float | None = None


class ShardedParamGather:
    """The gathers of one `ShardedMainOptimizer`'s buckets. `ranges`: the buckets' parameter
    index ranges (`bucket_ranges`, bucket 0 holding the last parameters); `times`: where the
    gathers' time in flight and waits go (the stage's `ReductionTimes`)."""

    def __init__(self, optimizer, ranges: list[tuple[int, int]], times: ReductionTimes):
        self.optimizer, self.times = optimizer, times
        self.group = optimizer.group
        # Launched from the forward's first layers to its last (the highest bucket index holds
        # the first parameters), so the first forward's early layers wait the least.
        self.buckets = [self._bucket(i, a, b) for i, (a, b) in enumerate(ranges)][::-1]
        self.bucket_of = {id(p): g for g in self.buckets for p, _ in g.params}
        self.in_flight: dict[int, BucketGather] = {}  # by bucket index
        self.poison = os.environ.get(POISON_ENV) == "1"
        self._hooks: list = []
        self._spans: list = []

    def _bucket(self, index: int, first: int, last: int) -> BucketGather:
        opt = self.optimizer
        offsets, size = opt.buffer.offsets, opt.shard_numel
        start = offsets[first]
        end = offsets[last - 1] + opt.params[last - 1].numel()  # without the padding
        own = []
        for piece in opt.pieces:
            low = opt.low + piece.shard_offset
            a, b = max(start, low), min(end, low + piece.main.numel())
            if a < b:
                own.append((piece, a - low, b - low, a - start))
        owners = []
        for rank in range(opt.shards):
            a, b = max(start, rank * size), min(end, (rank + 1) * size)
            if a < b:
                owners.append((rank, a - start, b - start))
        params = [(opt.params[i], offsets[i] - start) for i in range(first, last)]
        return BucketGather(index, start, end, own, params, owners)

    # ------------------------------------------------------------------ at the step
    @torch.no_grad()
    def launch(self) -> None:
        """After the inner optimizer's step: every bucket's gather started, none waited for."""
        self.finish()  # never outstanding here in a run (a backward came first): a safeguard
        dtype, device = self.optimizer.dtype, self.optimizer.buffer.flat.device
        for bucket in self.buckets:
            values = torch.empty(bucket.end - bucket.start, dtype=dtype, device=device)
            for piece, a, b, at in bucket.own_segments:
                values[at : at + b - a] = piece.main[a:b]  # rounded to the model's dtype
            bucket.values, bucket.launched_at, bucket.landed_at = values, time.perf_counter(), None
            bucket.works = [
                dist.broadcast(values[a:b], group=self.group, group_src=rank, async_op=True)
                for rank, a, b in bucket.owners
            ]
            self._time_landing(bucket)
            self.in_flight[bucket.index] = bucket
            received = sum(b - a for rank, a, b in bucket.owners if rank != self.optimizer.rank)
            self.times.gather_bytes += received * values.element_size()
        if self.poison:
            self._poison()

    def _time_landing(self, bucket: BucketGather) -> None:
        if not bucket.works:
            return
        try:
            future = bucket.works[-1].get_future()
        except RuntimeError:  # a backend without futures: timed when waited for
            return
        future.then(lambda _, bucket=bucket: setattr(bucket, "landed_at", time.perf_counter()))

    def _poison(self) -> None:
        params = [p for bucket in self.buckets for p, _ in bucket.params]
        with preserve_versions(params):
            for param in params:
                param.fill_(float("nan"))

    # ------------------------------------------------------------------ waiting
    @property
    def outstanding(self) -> bool:
        return bool(self.in_flight)

    def wait_for(self, params) -> None:
        """The buckets holding `params` landed and copied into their parameters."""
        if not self.in_flight:
            return
        start = time.perf_counter()
        for param in params:
            bucket = self.bucket_of.get(id(param))
            if bucket is not None and bucket.index in self.in_flight:
                self._land(bucket)
        self._waited(start)

    def finish(self) -> None:
        """Every bucket still in flight landed and copied out (in launch order)."""
        if not self.in_flight:
            return
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket.index in self.in_flight:
                self._land(bucket)
        self._waited(start)

    def discard(self) -> None:
        """Wait for the gathers in flight and drop their values: the parameters were just
        loaded (a checkpoint), and the step's update must not land over them."""
        for bucket in list(self.in_flight.values()):
            for work in bucket.works:
                work.wait()
            bucket.values, bucket.works = None, []
        self.in_flight.clear()
        self._spans = []

    def check_landed(self, params) -> None:
        """Raise if a parameter's bucket is still in flight: whatever reads or writes it now
        should have called `wait_for` or `finish` first."""
        for param in params:
            bucket = self.bucket_of.get(id(param))
            if bucket is not None and bucket.index in self.in_flight:
                raise RuntimeError(
                    f"a parameter of gathered bucket {bucket.index} was used before its gather "
                    "landed (--overlap-param-gather): call finish_param_gather() first"
                )

    @torch.no_grad()
    def _land(self, bucket: BucketGather) -> None:
        for work in bucket.works:
            work.wait()
        params = [param for param, _ in bucket.params]
        # the step's in-place update, as `_gather_params` makes it: microbatches in flight
        # since before the step run their backward on the new weights (PACI)
        with preserve_versions(params):
            for param, at in bucket.params:
                param.copy_(bucket.values[at : at + param.numel()].view_as(param))
        end = bucket.landed_at or time.perf_counter()
        self._spans.append((bucket.launched_at, max(end, bucket.launched_at)))
        bucket.values, bucket.works = None, []
        del self.in_flight[bucket.index]

    def _waited(self, start: float) -> None:
        self.times.add_gather_wait(time.perf_counter() - start)
        if not self.in_flight:
            self.times.close_gather(self._spans)
            self._spans = []

    # ------------------------------------------------------------------ forward hooks
    def attach_forward_hooks(self, model: torch.nn.Module) -> None:
        """A pre-hook on each module that directly holds gathered parameters: a module's
        forward waits for its own buckets only. Per module rather than per transformer layer:
        it needs no knowledge of the model's structure, covers what lies outside the layers
        (embedding, final norm, output layer, MTP), and waits no earlier than the parameters
        are read; a hook costs one check when nothing is in flight."""
        for module in model.modules():
            direct = [p for p in module.parameters(recurse=False) if id(p) in self.bucket_of]
            if direct:
                hook = module.register_forward_pre_hook(
                    lambda module, args, direct=direct: self.wait_for(direct)
                )
                self._hooks.append(hook)

    def remove_forward_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
