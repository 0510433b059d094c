"""--use-distributed-optimizer with --optimizer muon: the layer-wise distributed optimizer
(optimizer/layer_wise.py) against the replicated Muon, over two gloo processes."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
from conftest import TinyGPT, backward_with, optimizer_config
from rank_processes import start_ranks

from megatron.common.errors import UserError
from megatron.training.optimizer.build import ExpertGroups, StageOptimizerStep, build_optimizer
from megatron.training.optimizer.layer_wise import LayerWiseMainOptimizer, deal_owners
from megatron.training.reporting import _optimizer_state_bytes


def test_parameters_are_dealt_back_and_forth_by_size():
    sizes = [5, 1, 4, 2, 3, 6]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    # by size: 1, 2, 3, 4, 5, 6 go to ranks 0, 1, 1, 0, 0, 1
    assert deal_owners(params, 2) == [0, 0, 0, 1, 1, 1]
    assert deal_owners(params, 1) == [0] * 6


class _NoSchedule:
    def step(self, increment: int) -> None:
        pass


def _close(a, b, tolerance: float) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tolerance) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tolerance,
                                                     atol=tolerance)  # fmt: skip
    return a == b


def _model(dtype, rank: int, experts: bool):
    model = TinyGPT().to(dtype)
    if experts:  # the rank's own expert: other values on each rank, reduced over itself
        weight = model.decoder.layers[0].self_attention.linear_proj.weight
        weight.moe_expert = True
        with torch.no_grad():
            weight.mul_(1.0 + rank)
    return model


def _step(model, optimizer, expert_groups) -> StageOptimizerStep:
    return StageOptimizerStep(model, optimizer, _NoSchedule(), data_parallel_group=dist.group.WORLD,
                              grad_norm_group=None, tensor_parallel_rank=0, clip_grad=0.5,
                              experts=expert_groups)  # fmt: skip


def _compare(rank: int, dtype: torch.dtype, expert_group) -> None:
    """Same norms, weights and (gathered) state as the replicated Muon; about half the state
    on each rank; a fresh optimizer loading that state continues as the replicated one."""
    overrides = dict(weight_decay=0.1, bf16=dtype == torch.bfloat16)
    experts = expert_group is not None
    # as EP = 2 on two ranks: the experts' norm over the expert-parallel ranks (both)
    groups = ExpertGroups(expert_group, dist.group.WORLD, 2) if experts else None
    models = [_model(dtype, rank, experts) for _ in range(3)]
    plain = build_optimizer(models[0], optimizer_config("muon", **overrides))
    config = optimizer_config("muon", use_distributed_optimizer=True, **overrides)
    layer_wise = build_optimizer(models[1], config, expert_group=expert_group)
    assert isinstance(layer_wise, LayerWiseMainOptimizer)
    steps = [_step(models[0], plain, groups), _step(models[1], layer_wise, groups)]
    for iteration in range(3):
        for model in models[:2]:
            backward_with(model, 10 * iteration + rank)
        norms = [step().grad_norm for step in steps]
        assert abs(norms[0] - norms[1]) <= 1e-5 * norms[0]
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    saved = plain.state_dict()
    assert _close(layer_wise.state_dict(), saved, 1e-5)
    if not experts:
        whole, mine = _optimizer_state_bytes(plain), _optimizer_state_bytes(layer_wise)
        assert 0.25 * whole < mine < 0.75 * whole
    models[2].load_state_dict(models[0].state_dict())
    fresh = build_optimizer(models[2], config, expert_group=expert_group)
    fresh.load_state_dict(copy.deepcopy(saved))  # as from a file: no tensor shared with plain
    assert _close(fresh.state_dict(), saved, 1e-6)
    steps[1] = _step(models[2], fresh, groups)
    for model in (models[0], models[2]):
        backward_with(model, 99 + rank)
    assert abs(steps[0]().grad_norm - steps[1]().grad_norm) <= 1e-5 * steps[0].last.grad_norm
    for a, b in zip(models[0].parameters(), models[2].parameters()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def _worker(rank: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        own = [dist.new_group([r]) for r in range(2)][rank]  # expert data parallel size 1
        for dtype in (torch.float32, torch.bfloat16):
            _compare(rank, dtype, None)
            _compare(rank, dtype, own)
    finally:
        dist.destroy_process_group()


def test_layer_wise_muon_equals_the_replicated_one_over_two_ranks():
    """fp32 and bf16, with and without a routed expert of each rank's own (expert data
    parallel size 1, as EP = DP = 2)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start_ranks(_worker, (port,), nprocs=2)


# ---------------------------------------------------------------------------- flags
def _validated(extra: list[str]):
    from megatron.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(
        ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
         "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--optimizer", "muon",
         "--use-distributed-optimizer", *extra]  # fmt: skip
    )
    validate_args(args, world_size=2, check_files=False)
    return args


@pytest.mark.parametrize("extra", [[], ["--no-use-layer-wise-param-layout"], ["--bf16"]])
def test_distributed_muon_is_accepted(extra):
    args = _validated(extra)
    assert args.use_distributed_optimizer and args.optimizer == "muon"
    assert args.use_layer_wise_param_layout == ("--no-use-layer-wise-param-layout" not in extra)


def test_distributed_muon_refuses_optimizer_copies():
    with pytest.raises(UserError, match="--num-distributed-optimizer-instances > 1 with --opt"):
        _validated(["--num-distributed-optimizer-instances", "2"])
