"""--emulated-param-count: emulated stages with parameters whose gradients the backward really
accumulates (megatron/model/emulated_stage.py), so the data-parallel reduction moves what a real
stage's would, in buckets launched from the backward's hooks. In process, no launch."""

import time

import pytest
import torch
from small_run_flags import configured, error_of

from megatron.distributed.data_parallel import BucketedReduction, BucketStrategy, bucket_ranges
from megatron.model.emulated_stage import PARAM_TENSORS, EmulatedStage, param_tensor_sizes
from megatron.pipeline.split_backward import backward_input

EMULATED = ["--emulated-forward-ms", "1", "--emulated-backward-ms", "2"]


def _stage(count, backward_ms=0.0, weight_grad_ms=None, stage=1):
    """Virtual stage `stage` of 2 (given, so no process group is needed): 1 takes an input."""
    return EmulatedStage(0.0, backward_ms, 4, weight_grad_ms=weight_grad_ms, virtual_stage=stage,
                         num_virtual_stages=2, param_count=count)  # fmt: skip


def _forward(stage):
    """A middle stage's forward on an input that needs its gradient (the previous stage's)."""
    hidden = torch.randn(3, 2, 4, requires_grad=True)
    stage.set_input_tensor(hidden)
    output = stage(None, None, None)
    return hidden, output


def test_sizes_split_the_count_evenly():
    assert param_tensor_sizes(1000) == [125] * 8
    assert param_tensor_sizes(10) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert param_tensor_sizes(3) == [1, 1, 1]  # fewer tensors than PARAM_TENSORS
    assert sum(param_tensor_sizes(2_000_003)) == 2_000_003
    assert len(param_tensor_sizes(2_000_003)) == PARAM_TENSORS


def test_without_the_flag_the_stage_has_its_weight_only():
    stage = _stage(None)
    assert [p.numel() for p in stage.parameters()] == [4]


def test_the_backward_accumulates_ones_into_every_parameter():
    stage = _stage(1000)
    params = list(stage.params)
    assert sum(p.numel() for p in params) == 1000 and len(params) == PARAM_TENSORS
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    _, output = _forward(stage)
    assert all(p.grad is None for p in params)
    output.sum().backward()
    for param in params:
        assert param.grad.shape == param.shape and bool((param.grad == 1).all())
    _, output = _forward(stage)
    output.sum().backward()  # a second microbatch adds to .grad, as gradient accumulation does
    assert all(bool((p.grad == 2).all()) for p in params)
    assert stage.weight.grad is not None  # the hidden-size weight still learns as before


def test_an_optimizer_steps_the_parameters():
    stage = _stage(64)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.5)
    _, output = _forward(stage)
    output.sum().backward()
    optimizer.step()
    assert all(bool((p == -0.5).all()) for p in stage.params)


class _Times(BucketStrategy):
    """Records when each bucket is launched."""

    def __init__(self):
        self.started = []

    def start(self, bucket):
        self.started.append((bucket.index, time.perf_counter()))
        return []

    def finish(self, bucket):
        pass


def test_buckets_launch_from_the_hooks_spread_over_the_backward():
    """Bucketed like a real stage: the last tensors' bucket first, each after its part of the
    backward (sleeps only ever last longer, so the spacing is a lower bound)."""
    backward_ms = 90.0  # 9 parts of 10 ms: one before each of the 8 tensors, one before weight
    stage = _stage(8 * 100, backward_ms=backward_ms)
    params = list(stage.parameters())  # the weight (model order: the first layer), then params
    strategy = _Times()
    ranges = bucket_ranges([p.numel() for p in params], 200)
    reduction = BucketedReduction(params, ranges, strategy)
    assert len(reduction.buckets) == 5  # [7 6] [5 4] [3 2] [1 0] [weight]
    reduction.attach_hooks()
    reduction.before_final_pass(0)
    _, output = _forward(stage)
    began = time.perf_counter()
    output.sum().backward()
    ended = time.perf_counter()
    assert [index for index, _ in strategy.started] == [0, 1, 2, 3, 4]
    at = [moment - began for _, moment in strategy.started]
    part = backward_ms / 1000 / (PARAM_TENSORS + 1)
    assert at[0] >= 2 * part  # tensor 6 closes bucket 0 after two parts
    for earlier, later in zip(at, at[1:]):
        assert later - earlier >= 2 * part * 0.999 or later == at[-1]
    assert at[-1] - at[0] >= 7 * part * 0.999  # the weight's bucket after the last part
    assert ended - began >= backward_ms / 1000 * 0.999
    reduction.finish()


def test_a_split_backward_gives_the_gradients_in_the_weight_pass():
    """With --emulated-weight-grad-ms the parameters' gradients (and the waits between them)
    belong to W: B leaves them untouched and takes only the input-gradient time."""
    stage = _stage(800, backward_ms=40.0, weight_grad_ms=30.0)
    hidden, output = _forward(stage)
    began = time.perf_counter()
    pending = backward_input(output, torch.ones_like(output), hidden)
    b_s = time.perf_counter() - began
    assert hidden.grad is not None and all(p.grad is None for p in stage.params)
    began = time.perf_counter()
    pending.run()
    w_s = time.perf_counter() - began
    assert all(bool((p.grad == 1).all()) for p in stage.params)
    assert b_s >= 0.010 * 0.999 and w_s >= 0.030 * 0.999  # B: 40 - 30 ms; W: 30 ms


def test_the_first_stage_gets_its_gradients_too():
    stage = _stage(16, stage=0)
    output = stage(torch.zeros(2, 3, dtype=torch.long), None, None)
    output.sum().backward()
    assert all(bool((p.grad == 1).all()) for p in stage.params)


def test_the_flag_is_typed_and_checked():
    config = configured(EMULATED + ["--emulated-param-count", "1000"])
    assert config.pipeline.emulated_param_count == 1000
    assert configured(EMULATED).pipeline.emulated_param_count is None
    assert error_of(EMULATED + ["--emulated-param-count", "0"]) == (
        "--emulated-param-count must be >= 1, got 0"
    )
    assert error_of(["--emulated-param-count", "10"]) == (
        "--emulated-param-count gives emulated stages parameters: it needs "
        "--emulated-forward-ms and --emulated-backward-ms"
    )


@pytest.mark.parametrize("value", ["1.5", "many"])
def test_a_count_that_is_no_integer_is_a_parse_error(value, capsys):
    from small_run_flags import BASE

    from megatron.training.arguments import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + EMULATED + ["--emulated-param-count", value])
    assert "argument --emulated-param-count: invalid int value" in capsys.readouterr().err
