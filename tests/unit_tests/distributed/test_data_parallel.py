"""The bucketed data-parallel reduction (megatron/distributed/data_parallel.py) in one process:
the buckets' shape and order, when the backward's hooks launch them, the late buckets, the
guard against a gradient accumulated into a bucket in flight, the timing, and the flags."""

import pytest
import torch
from small_run_flags import error_of, validated

from megatron.distributed.data_parallel import (
    BucketedReduction,
    BucketStrategy,
    CopiedAllReduce,
    ReductionFailed,
    ReductionTimes,
    bucket_ranges,
    default_bucket_size,
    named_reduction,
    resolve_bucket_size,
)


def test_buckets_fill_from_the_last_parameter():
    assert bucket_ranges([4, 4, 4, 4], None) == [(0, 4)]
    assert bucket_ranges([4, 4, 4, 4], 8) == [(2, 4), (0, 2)]
    assert bucket_ranges([4, 4, 4, 4], 5) == [(2, 4), (0, 2)]  # closes once it holds >= 5
    assert bucket_ranges([4, 4, 4], 8) == [(1, 3), (0, 1)]  # the first parameters: what is left
    assert bucket_ranges([100, 1, 1], 2) == [(1, 3), (0, 1)]  # a parameter is never split
    assert bucket_ranges([], 8) == []
    ranges = bucket_ranges([3, 5, 7, 11, 13], 10)
    covered = sorted(i for a, b in ranges for i in range(a, b))
    assert covered == list(range(5))


def test_bucket_size_as_megatron_resolves_it():
    assert default_bucket_size(4) == 40_000_000 and default_bucket_size(64) == 64_000_000
    common = dict(num_parameters=1000, data_parallel_size=2)
    assert resolve_bucket_size(overlap=False, bucket_size=None, num_buckets=None, **common) is None
    assert resolve_bucket_size(overlap=True, bucket_size=None, num_buckets=None, **common) == (
        40_000_000
    )
    assert resolve_bucket_size(overlap=False, bucket_size=300, num_buckets=None, **common) == 300
    assert resolve_bucket_size(overlap=True, bucket_size=None, num_buckets=4, **common) == 250


class Recording(BucketStrategy):
    def __init__(self):
        self.started, self.finished = [], []

    def start(self, bucket):
        self.started.append(bucket.index)
        return []

    def finish(self, bucket):
        self.finished.append(bucket.index)


def _model_and_reduction(bucket_size, late=(), overlap=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    params = list(model.parameters())  # 8 tensors of 16 and 4 elements
    strategy = Recording()
    reduction = BucketedReduction(params, bucket_ranges([p.numel() for p in params], bucket_size),
                                  strategy)  # fmt: skip
    reduction.mark_late([params[i] for i in late])
    if overlap:
        reduction.attach_hooks()
    return model, reduction, strategy


def _backward(model):
    model(torch.randn(2, 4)).sum().backward()


def test_the_final_pass_launches_every_bucket_in_order():
    model, reduction, strategy = _model_and_reduction(20)
    assert len(reduction.buckets) == 4
    _backward(model)  # not the final pass: nothing launches
    assert strategy.started == []
    reduction.before_final_pass(0)
    _backward(model)
    assert strategy.started == [0, 1, 2, 3]  # from the hooks, in bucket order
    reduction.finish()
    assert strategy.finished == [0, 1, 2, 3]
    assert reduction.times.buckets_in_backward == 4 and reduction.times.buckets_at_step == 0
    assert not reduction.in_flight and reduction.armed_chunks == set()


def test_a_late_bucket_waits_for_the_step_and_the_others_do_not_wait_for_it():
    model, reduction, strategy = _model_and_reduction(20, late=[7])  # the last bias: bucket 0
    reduction.before_final_pass(0)
    _backward(model)
    assert strategy.started == [1, 2, 3]
    reduction.finish()
    assert strategy.started == [1, 2, 3, 0]
    assert reduction.times.buckets_at_step == 1


def test_without_overlap_every_bucket_launches_at_the_step():
    model, reduction, strategy = _model_and_reduction(20, overlap=False)
    reduction.before_final_pass(0)
    _backward(model)
    assert strategy.started == []
    reduction.finish()
    assert strategy.started == strategy.finished == [0, 1, 2, 3]


def test_a_gradient_into_a_bucket_in_flight_is_refused():
    model, reduction, strategy = _model_and_reduction(20)
    reduction.before_final_pass(0)
    _backward(model)
    with pytest.raises(RuntimeError, match="whose reduction is in flight"):
        _backward(model)


def test_dropped_gradients_forget_the_step():
    model, reduction, strategy = _model_and_reduction(20)
    reduction.before_final_pass(0)
    _backward(model)
    reduction.reset()
    _backward(model)  # the next step's first pass: nothing in flight any more
    assert strategy.started == [0, 1, 2, 3] and strategy.finished == []


def test_copied_all_reduce_writes_the_mean_back(one_rank_group):
    """One rank: the mean is the gradient itself, through the copy and back; the gradients
    keep their values until the bucket lands."""
    model, _, _ = _model_and_reduction(20, overlap=False)
    params = list(model.parameters())
    strategy = CopiedAllReduce(lambda p: p.grad, None)
    reduction = BucketedReduction(params, bucket_ranges([p.numel() for p in params], 20),
                                  strategy)  # fmt: skip
    reduction.attach_hooks()
    reduction.before_final_pass(0)
    _backward(model)
    expected = [p.grad.clone() for p in params]
    assert reduction.in_flight
    reduction.finish()
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    assert reduction.times.bytes == 4 * sum(p.numel() for p in params)


GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv"


def test_a_stuck_replica_during_the_loss_average_is_named(one_rank_group, monkeypatch):
    """The training loop's average of the loss over the data-parallel ranks, when a replica
    never joins: one line naming the rank, the collective and the group, which the entry
    point reports as a lost replica (a raw gloo traceback before)."""
    import torch.distributed as dist

    from megatron.training import training

    def stuck(tensor, group=None):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(dist, "all_reduce", stuck)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for loss in (torch.tensor(3.0), torch.tensor([6.0, 2.0])):  # mean; (sum, tokens) pair
        with pytest.raises(ReductionFailed) as failure:
            training._average_loss([{"lm loss": loss}])
        assert str(failure.value) == (
            "rank 0: the data-parallel average of the loss over ranks [0] failed: got nothing "
            "within --distributed-timeout-minutes: a replica is stuck"
        )
        assert failure.value.timed_out


class StuckReplica(Recording):
    """Each bucket's reduction is in flight and times out when waited for, as gloo's does
    when a replica never joins."""

    group = None

    def start(self, bucket):
        super().start(bucket)

        class Work:
            def wait(self):
                raise RuntimeError(GLOO_TIMEOUT)

            def get_future(self):
                raise RuntimeError("no future")  # timed when waited for, as gloo's lists

        return [Work()]


def test_a_stuck_replica_during_a_bucket_reduction_is_named(one_rank_group):
    """A bucket in flight whose replica never joins: the step's wait raises one line naming
    the rank, the bucket and the group, which the entry point reports as a lost replica."""
    model, _, _ = _model_and_reduction(20)
    params = list(model.parameters())
    reduction = BucketedReduction(params, bucket_ranges([p.numel() for p in params], 20),
                                  StuckReplica())  # fmt: skip
    reduction.attach_hooks()
    reduction.before_final_pass(0)
    _backward(model)
    with pytest.raises(ReductionFailed) as failure:
        reduction.finish()
    assert str(failure.value) == (
        f"rank 0: the data-parallel reduction of {reduction.buckets[0]} over ranks all failed: "
        "got nothing within --distributed-timeout-minutes: a replica is stuck"
    )
    assert failure.value.timed_out


def test_a_lost_replica_keeps_what_gloo_said(one_rank_group):
    with pytest.raises(ReductionFailed) as failure:
        with named_reduction("the data-parallel reduction of bucket 0", None):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    assert not failure.value.timed_out
    assert str(failure.value).endswith("over ranks all failed: Connection closed by peer")


def test_reduction_time_counts_overlapping_buckets_once():
    times = ReductionTimes()
    for span in [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]:
        times.add_span(*span)
    times.add_exposed(0.5)
    times.close_step()
    assert times.reduce_s == pytest.approx(4.0) and times.exposed_s == 0.5
    assert times.report()["dp_hidden_fraction"] == pytest.approx(1 - 0.5 / 4.0)
    assert times.take() == pytest.approx((4.0, 0.5)) and times.take() == (0.0, 0.0)


def test_bucket_flags():
    args = validated(["--overlap-grad-reduce", "--ddp-bucket-size", "1000"])
    assert args.overlap_grad_reduce and args.ddp_bucket_size == 1000
    assert error_of(["--ddp-bucket-size", "0"]) == "--ddp-bucket-size must be > 0 parameters, got 0"
    assert "must be > 0" in error_of(["--ddp-bucket-size", "-5"])
    assert "must be > 0" in error_of(["--ddp-num-buckets", "0"])
    assert "exclude each other" in error_of(["--ddp-num-buckets", "2", "--ddp-bucket-size", "9"])


def test_no_bucket_spans_two_chunks():
    assert bucket_ranges([4, 4, 4, 4], 100, chunk_starts=[2]) == [(2, 4), (0, 2)]
    assert bucket_ranges([4, 4, 4, 4], None, chunk_starts=[2]) == [(2, 4), (0, 2)]
    assert bucket_ranges([4, 4, 4, 4, 4], 8, chunk_starts=[3]) == [(3, 5), (1, 3), (0, 1)]


def test_a_chunk_done_before_the_last_pass_launches_then():
    """Two chunks (the two halves of the model): the rank's last pass runs on chunk 0, chunk 1
    finished earlier. Chunk 1's buckets come first in order, so they launch as soon as the
    chunk is known complete, before chunk 0's hooks fire."""
    model, _, _ = _model_and_reduction(20, overlap=False)
    params = list(model.parameters())
    chunk_of = {id(p): (0 if i < 4 else 1) for i, p in enumerate(params)}.get
    strategy = Recording()
    ranges = bucket_ranges([p.numel() for p in params], 20, chunk_starts=[4])
    reduction = BucketedReduction(params, ranges, strategy, chunk_of=lambda p: chunk_of(id(p)))
    reduction.attach_hooks()
    _backward(model)  # chunk 1's last pass (and chunk 0's first): nothing is armed
    assert strategy.started == []
    reduction.chunk_complete(1)
    assert strategy.started == [0, 1]
    reduction.before_final_pass(0)
    model[0](torch.randn(2, 4)).sum().backward()  # chunk 0's last pass: its first layer only
    model[1](torch.randn(2, 4)).sum().backward()
    assert strategy.started == [0, 1, 2, 3]
