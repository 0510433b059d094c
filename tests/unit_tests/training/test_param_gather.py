"""--overlap-param-gather (megatron/training/optimizer/param_gather.py) on three gloo processes
(uneven parts: a bucket often lies in one or two ranks' ranges): the gathered parameters equal
the blocking all-gather's bit for bit, in fp32 and bf16; a forward waits only for the buckets
it reads; a backward after the step reads the update once the gathers finished (and NaN
without: what the poison shows); a read before the gather landed is refused; a load drops the
gathers in flight."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from conftest import optimizer_config
from rank_processes import start_ranks

from megatron.pipeline.accounting import preserve_versions
from megatron.training.optimizer.build import (
    StageOptimizerStep,
    attach_reduction,
    build_optimizer,
)
from megatron.training.optimizer.param_gather import POISON_ENV

WORLD = 3


class _NoSchedule:
    def step(self, increment: int) -> None:
        pass


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
              torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)]  # fmt: skip
    return torch.nn.Sequential(*layers).to(dtype)


def _stage(dtype: torch.dtype, gather: bool):
    model = _model(dtype)
    config = optimizer_config("adam", bf16=dtype == torch.bfloat16, weight_decay=0.1,
                              use_distributed_optimizer=True)  # fmt: skip
    optimizer = build_optimizer(model, config)
    step = StageOptimizerStep(model, optimizer, _NoSchedule(), data_parallel_group=dist.group.WORLD,
                              grad_norm_group=None, tensor_parallel_rank=0, clip_grad=1.0)  # fmt: skip
    assert attach_reduction(step, bucket_size=100, overlap=False, gather_params=gather) is None
    return model, step


def _train(model, step, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(4, 8, generator=generator).to(next(model.parameters()).dtype)
    output = model(inputs)
    output.float().pow(2).sum().backward()
    with preserve_versions(model.parameters()):  # as the runtime steps (PACI: graphs held)
        step()
    return inputs


def _compare(rank: int, dtype: torch.dtype) -> None:
    plain_model, plain = _stage(dtype, gather=False)
    model, step = _stage(dtype, gather=True)
    gather = step.param_gather
    assert len(gather.buckets) >= 3 and any(len(b.owners) == 1 for b in gather.buckets)
    for iteration in range(3):
        _train(plain_model, plain, 10 * iteration + rank)
        inputs = _train(model, step, 10 * iteration + rank)
        assert gather.outstanding
        assert all(torch.isnan(p).all() for p in model.parameters())  # poisoned until landed
        with pytest.raises(RuntimeError, match="before its gather landed"):
            gather.check_landed([model[4].weight])
        with torch.no_grad():
            assert torch.equal(model(inputs), plain_model(inputs))  # the hooks waited
        step.finish_param_gather()
        for a, b in zip(model.parameters(), plain_model.parameters()):
            assert torch.equal(a, b)
    report = step.reduction_times.report()
    assert report["dp_param_gathers"] == 3 and report["dp_param_gather_bytes"] > 0


def _first_layer_waits_only_for_its_buckets(rank: int) -> None:
    model, step = _stage(torch.float32, gather=True)
    _train(model, step, rank)
    first = [model[0].weight, model[0].bias]
    step.finish_param_gather(only=first)
    assert not any(torch.isnan(p).any() for p in first)
    assert torch.isnan(model[4].weight).all() and step.param_gather.outstanding
    model.load_state_dict(_model(torch.float32).state_dict())  # the load wins over the update
    assert not step.param_gather.outstanding
    for a, b in zip(model.parameters(), _model(torch.float32).parameters()):
        assert torch.equal(a, b)


def _backward_after_the_step_waits(rank: int) -> None:
    """PACI's case: a microbatch forwarded before the step runs its backward after it, on the
    updated weights. Without `finish_param_gather` it would read the poisoned ones."""
    plain_model, plain = _stage(torch.float32, gather=False)
    model, step = _stage(torch.float32, gather=True)
    for stage_model, stage_step in ((plain_model, plain), (model, step)):
        inputs = _train(stage_model, stage_step, rank)
        held = stage_model(inputs).float().pow(2).sum()  # forwarded before the next step
        _train(stage_model, stage_step, rank + 5)
        stage_step.finish_param_gather()  # what the runtime does before every backward
        with preserve_versions(stage_model.parameters()):
            held.backward()
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a.main_grad, b.main_grad) and not torch.isnan(a.main_grad).any()
    model.zero_grad()
    _, unwaited = _stage(torch.float32, gather=True)
    inputs = _train(unwaited.model, unwaited, rank)
    held = unwaited.model(inputs).float().pow(2).sum()
    _train(unwaited.model, unwaited, rank + 5)
    with preserve_versions(unwaited.model.parameters()):
        held.backward()  # on the poisoned weights: the check would see it
    assert torch.isnan(unwaited.model[0].weight.main_grad).any()
    unwaited.finish_param_gather()  # no broadcast may be in flight when the group goes


def _worker(rank: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[POISON_ENV] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for dtype in (torch.float32, torch.bfloat16):
            _compare(rank, dtype)
        _first_layer_waits_only_for_its_buckets(rank)
        _backward_after_the_step_waits(rank)
    finally:
        dist.destroy_process_group()


def test_overlapped_gather_equals_the_blocking_one_over_three_ranks():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start_ranks(_worker, (port,), nprocs=WORLD)
