"""fp32 main weights and gradients (--bf16/--fp16), the per-stage loss scaler's rules, and the
distributed optimizer against the unsharded one (two gloo processes)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from conftest import TinyGPT, backward_with, optimizer_config
from rank_processes import start_ranks

from megatron.training.optimizer.build import StageOptimizerStep, build_optimizer
from megatron.training.optimizer.distributed_optimizer import ShardedMainOptimizer
from megatron.training.optimizer.loss_scaling import DynamicLossScaler, StaticLossScaler
from megatron.training.optimizer.main_params import GradBuffer, ReplicatedMainOptimizer
from megatron.training.reporting import _optimizer_state_bytes


# ---------------------------------------------------------------------------- loss scaler
def test_dynamic_scaler_backs_off_after_hysteresis_overflows():
    scaler = DynamicLossScaler(1024.0, min_scale=1.0, window=1000, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # the first overflow only uses up hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)  # hysteresis is not restored by an overflow
    assert scaler.scale == 256.0


def test_dynamic_scaler_grows_after_a_clean_window_and_restores_hysteresis():
    scaler = DynamicLossScaler(8.0, min_scale=1.0, window=3, hysteresis=2)
    scaler.update(True)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 16.0  # hysteresis back to 2 after the growth
    for _ in range(2):
        scaler.update(False)
    scaler.update(True)  # an overflow restarts the clean window, not the hysteresis
    assert scaler.scale == 8.0


def test_dynamic_scaler_stops_at_the_minimum():
    scaler = DynamicLossScaler(4.0, min_scale=2.0, window=10, hysteresis=1)
    assert scaler.can_back_off()
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 2.0 and not scaler.can_back_off()
    restored = DynamicLossScaler(1.0, min_scale=1.0, window=10, hysteresis=1)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128.0)
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale == 128.0 and not scaler.can_back_off()


# ---------------------------------------------------------------------------- fp32 gradients
def test_grad_buffer_accumulates_bf16_gradients_in_fp32_and_frees_them():
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    buffer = GradBuffer([param], shards=4)
    assert buffer.flat.numel() == 4 and buffer.flat.dtype == torch.float32
    for coefficient in (1.0, 2.0**-9):  # the second is below bf16's resolution at 1.0
        (param * coefficient).sum().backward()
        assert param.grad is None
    assert torch.equal(param.main_grad, torch.full((3,), 1.0 + 2.0**-9))


def test_grad_buffer_unscales_each_microbatch_with_the_current_scale():
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    buffer = GradBuffer([param])
    buffer.loss_scaler = StaticLossScaler(1024.0)
    (param * 1024.0).sum().backward()
    buffer.loss_scaler = StaticLossScaler(256.0)
    (param * 256.0).sum().backward()
    assert torch.equal(param.main_grad, torch.full((2,), 2.0))


def _bf16_rounded_pair():
    """A bf16 model and an fp32 model holding the same (bf16-representable) values."""
    fp32 = TinyGPT()
    with torch.no_grad():
        for param in fp32.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    bf16 = TinyGPT().to(torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    return fp32, bf16


def test_bf16_steps_fp32_main_weights_like_an_fp32_model():
    fp32, bf16 = _bf16_rounded_pair()
    reference = build_optimizer(fp32, optimizer_config("adam", weight_decay=0.1))
    mixed = build_optimizer(bf16, optimizer_config("adam", weight_decay=0.1, bf16=True))
    assert isinstance(mixed, ReplicatedMainOptimizer)
    for step in range(3):
        backward_with(fp32, step)
        backward_with(bf16, step)
        for param in fp32.parameters():
            param.grad = param.grad.to(torch.bfloat16).float()  # what the bf16 model sees
        reference.step()
        mixed.step()
        reference.zero_grad()
        mixed.zero_grad()
    for (name, param), main, model_param in zip(fp32.named_parameters(), mixed.main,
                                                bf16.parameters()):  # fmt: skip
        assert torch.equal(main, param), name
        assert torch.equal(model_param, param.to(torch.bfloat16)), name
    states = [value for state in mixed.state.values() for value in state.values()]
    assert all(v.dtype == torch.float32 for v in states if torch.is_tensor(v) and v.numel() > 1)


def test_loading_the_model_refreshes_the_main_weights():
    _, bf16 = _bf16_rounded_pair()
    mixed = build_optimizer(bf16, optimizer_config("adam", bf16=True))
    other = TinyGPT(seed=5).to(torch.bfloat16)
    bf16.load_state_dict(other.state_dict())
    for main, param in zip(mixed.main, other.parameters()):
        assert torch.equal(main, param.float())


# ---------------------------------------------------------------------------- distributed
class _NoSchedule:
    def step(self, increment: int) -> None:
        pass


def _stage_step(model, optimizer, group) -> StageOptimizerStep:
    return StageOptimizerStep(model, optimizer, _NoSchedule(), data_parallel_group=group,
                              grad_norm_group=None, tensor_parallel_rank=0, clip_grad=0.5)  # fmt: skip


def _tensors_close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_close(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)
    return a == b


def test_replicated_main_optimizer_checkpoint_restores_the_fp32_main_weights():
    """A fresh bf16 optimizer loading a checkpoint gets the inner state and the saved fp32 main
    weights, not the model's bf16-rounded ones that loading the model gives it."""
    _, bf16 = _bf16_rounded_pair()
    mixed = build_optimizer(bf16, optimizer_config("adam", bf16=True))
    for step in range(2):
        backward_with(bf16, step)
        mixed.step()
        mixed.zero_grad()
    saved = mixed.state_dict()
    fresh_model = TinyGPT(seed=3).to(torch.bfloat16)
    fresh = build_optimizer(fresh_model, optimizer_config("adam", bf16=True))
    fresh_model.load_state_dict(bf16.state_dict())
    assert not all(torch.equal(a, b) for a, b in zip(fresh.main, mixed.main))  # only rounded
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.main, mixed.main))
    assert _tensors_close(fresh.state_dict(), saved)


def _compare_sharded_with_unsharded(rank: int, name: str, dtype: torch.dtype, extra: dict) -> None:
    overrides = dict(weight_decay=0.1, bf16=dtype == torch.bfloat16, **extra)
    plain_model, sharded_model = TinyGPT().to(dtype), TinyGPT().to(dtype)
    plain = build_optimizer(plain_model, optimizer_config(name, **overrides))
    sharded = build_optimizer(sharded_model, optimizer_config(name, use_distributed_optimizer=True,
                                                           **overrides))  # fmt: skip
    assert isinstance(sharded, ShardedMainOptimizer)
    steps = [_stage_step(m, o, dist.group.WORLD) for m, o in
             ((plain_model, plain), (sharded_model, sharded))]  # fmt: skip
    for iteration in range(3):
        for model in (plain_model, sharded_model):
            backward_with(model, 10 * iteration + rank)  # different data on each rank
        reports = [step() for step in steps]
        assert abs(reports[0].grad_norm - reports[1].grad_norm) <= 1e-6 * reports[0].grad_norm
    for a, b in zip(plain_model.parameters(), sharded_model.parameters()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-7)
    unsharded_state = plain.state_dict()
    assert _tensors_close(sharded.state_dict(), unsharded_state)
    if extra.get("use_precision_aware_optimizer"):  # bf16 moments on both, sharded or not
        for optimizer in (plain, sharded.inner):
            state = next(iter(getattr(optimizer, "inner", optimizer).state.values()))
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    whole, mine = _optimizer_state_bytes(plain), _optimizer_state_bytes(sharded)
    assert abs(mine - whole / 2) <= 64 * 4  # half, give or take the padding and boundaries
    fresh_model = TinyGPT(seed=3).to(dtype)
    fresh_model.load_state_dict(plain_model.state_dict())
    fresh = build_optimizer(fresh_model, optimizer_config(name, use_distributed_optimizer=True,
                                                        **overrides))  # fmt: skip
    fresh.load_state_dict(unsharded_state)
    assert _tensors_close(fresh.state_dict(), unsharded_state)


def _compare_average_in_collective(rank: int, dtype: torch.dtype, sharded: bool) -> None:
    """--ddp-average-in-collective (ReduceOp.AVG) steps as the sum and division do."""
    overrides = dict(bf16=dtype == torch.bfloat16, use_distributed_optimizer=sharded)
    models = [TinyGPT().to(dtype), TinyGPT().to(dtype)]
    steps = []
    for model, in_collective in zip(models, (False, True)):
        optimizer = build_optimizer(model, optimizer_config("adam", **overrides))
        step = _stage_step(model, optimizer, dist.group.WORLD)
        step.average_in_collective = in_collective
        steps.append(step)
    for iteration in range(2):
        for model in models:
            backward_with(model, 10 * iteration + rank)
        norms = [step().grad_norm for step in steps]
        assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0]
    for a, b in zip(*(model.parameters() for model in models)):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-7)


def _worker(rank: int, port: int, cases: list) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        for name, dtype, extra in cases:
            _compare_sharded_with_unsharded(rank, name, dtype, extra)
        for dtype, sharded in ((torch.float32, False), (torch.bfloat16, False),
                               (torch.float32, True)):  # fmt: skip
            _compare_average_in_collective(rank, dtype, sharded)
    finally:
        dist.destroy_process_group()


def test_distributed_optimizer_equals_the_unsharded_one_over_two_ranks():
    """Same gradient norm, weights and (gathered) state as the unsharded optimizer; half the
    state per rank; its checkpoint format is the unsharded one, both ways (also with the
    embedding and output layer in groups of their own, --decoupled-lr). And
    --ddp-average-in-collective gives the same steps as the sum and division (plain, bf16 main
    weights, sharded)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cases = [("adam", torch.float32, {}), ("sgd", torch.float32, {}),
             ("adam", torch.bfloat16, {}), ("lion", torch.float32, {}),
             ("adan", torch.float32, {}),
             ("adam", torch.float32, {"decoupled_lr": 3e-2, "decoupled_min_lr": 1e-3}),
             ("adam", torch.bfloat16, {"use_precision_aware_optimizer": True,
                                       "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"})]  # fmt: skip
    start_ranks(_worker, (port, cases), nprocs=2)


def test_distributed_optimizer_refuses_matrix_optimizers():
    from megatron.common.errors import UserError
    from megatron.training.arguments import build_parser, validate_args

    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "0.1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--use-distributed-optimizer", "--optimizer", "mars"]  # fmt: skip
    with pytest.raises(UserError) as caught:
        validate_args(build_parser().parse_args(argv), world_size=2)
    assert (
        str(caught.value)
        == "--use-distributed-optimizer with --optimizer mars is not supported yet"
    )  # muon has the layer-wise distributed optimizer (test_layer_wise_muon.py)


# ---------------------------------------------------------------------------- step and flags
def test_overflow_skips_the_step_halves_the_scale_and_is_not_divergence():
    model = TinyGPT().to(torch.float16)
    optimizer = build_optimizer(model, optimizer_config("adam", fp16=True, loss_scale=None,
                                                      initial_loss_scale=4.0, min_loss_scale=2.0,
                                                      loss_scale_window=1000, hysteresis=1))  # fmt: skip
    step = _stage_step(model, optimizer, None)
    before = [p.detach().clone() for p in model.parameters()]
    for expected_scale, expected_in_a_row in ((2.0, 0), (2.0, 1)):
        backward_with(model, 0)
        model.output_layer.weight.main_grad[0, 0] = float("inf")
        report = step()
        assert report.skipped and step.loss_scale == expected_scale
        assert step.consecutive_skips == expected_in_a_row  # at the minimum scale it counts
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step.skipped_steps == 2 and float(optimizer.buffer.flat.abs().sum()) == 0.0
    backward_with(model, 1)
    assert not step().skipped and step.consecutive_skips == 0


def test_gradient_messages_carry_the_scale_exactly():
    from megatron.pipeline.p2p import decode_scale, encode_scale, scale_elements

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tail = encode_scale(2.0**32, dtype, torch.device("cpu"))
        assert tail.dtype == dtype and tail.numel() == scale_elements(dtype)
        assert decode_scale(tail) == 2.0**32


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other"),
        (["--overlap-param-gather"],
         "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
        (["--fp16", "--loss-scale", "-1"], "--loss-scale must be a positive number, got -1.0"),
        (["--use-distributed-optimizer", "--optimizer", "soap"],
         "--use-distributed-optimizer with --optimizer soap is not supported yet"),
        (["--use-distributed-optimizer", "--async-error-feedback", "--pipeline-schedule", "paci"],
         "--use-distributed-optimizer with --async-error-feedback is not supported yet"),
        (["--num-distributed-optimizer-instances", "2"],
         "--num-distributed-optimizer-instances needs --use-distributed-optimizer"),
        (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
         "--num-distributed-optimizer-instances 3 must divide the data-parallel size 2"),
    ],
)  # fmt: skip
def test_precision_flags_are_checked(extra, message):
    from megatron.common.errors import UserError
    from megatron.training.arguments import build_parser, validate_args

    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "0.1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]  # fmt: skip
    with pytest.raises(UserError) as caught:
        validate_args(build_parser().parse_args(argv + extra), world_size=2)
    assert str(caught.value) == message


def test_accepted_precision_flags():
    from megatron.training.arguments import build_parser, validate_args

    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "0.1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--bf16",
            "--accumulate-allreduce-grads-in-fp32", "--use-distributed-optimizer",
            "--overlap-grad-reduce", "--overlap-param-gather"]  # fmt: skip
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=2)
    assert args.initial_loss_scale == 2**32 and args.hysteresis == 2
