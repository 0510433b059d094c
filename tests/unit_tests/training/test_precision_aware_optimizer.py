"""--use-precision-aware-optimizer: Adam's moments stored in bf16/fp16, computed in fp32."""

import pytest
import torch
from conftest import TinyGPT, optimizer_config
from small_run_flags import validated

from megatron.common.errors import UserError
from megatron.training.optimizer.build import build_optimizer
from megatron.training.optimizer.precision_aware import PrecisionAwareAdamW
from megatron.training.reporting import _optimizer_state_bytes

STEPS = 4


def train(model, optimizer) -> None:
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def pao_config(exp_avg: str, exp_avg_sq: str):
    return optimizer_config("adam", weight_decay=0.1, use_precision_aware_optimizer=True,
                            exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq)  # fmt: skip


def test_fp32_moments_are_torchs_adamw_bit_for_bit():
    ours, reference = TinyGPT(), TinyGPT()
    train(ours, build_optimizer(ours, pao_config("fp32", "fp32")))
    config = optimizer_config("adam", weight_decay=0.1)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                       eps=1e-8, weight_decay=0.1, foreach=False))  # fmt: skip
    for a, b in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_moments_halve_the_state_and_follow_fp32(dtype):
    plain, low = TinyGPT(), TinyGPT()
    plain_opt = build_optimizer(plain, pao_config("fp32", "fp32"))
    low_opt = build_optimizer(low, pao_config(dtype, dtype))
    train(plain, plain_opt)
    train(low, low_opt)
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    state = next(iter(low_opt.state.values()))
    assert state["exp_avg"].dtype == expected and state["exp_avg_sq"].dtype == expected
    assert _optimizer_state_bytes(low_opt) * 2 == _optimizer_state_bytes(plain_opt)
    moved = [(a - b).abs().max() for a, b in zip(low.parameters(), plain.parameters())]
    assert max(moved) > 0  # the rounding is real
    for a, b in zip(low.parameters(), plain.parameters()):
        # within a tenth of the farthest Adam can move in STEPS steps (lr each)
        torch.testing.assert_close(a, b, rtol=0, atol=0.1 * 1e-2 * STEPS)


def test_a_checkpoint_keeps_the_moments_dtype():
    model = TinyGPT()
    optimizer = build_optimizer(model, pao_config("bf16", "bf16"))
    assert isinstance(optimizer, PrecisionAwareAdamW)
    train(model, optimizer)
    again = build_optimizer(model, pao_config("bf16", "bf16"))
    again.load_state_dict(optimizer.state_dict())
    for state in again.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--optimizer", "sgd"],
         "--use-precision-aware-optimizer with --optimizer sgd is not supported yet"),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
         "--main-grads-dtype bf16 is not supported yet"),
        (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"],
         "--exp-avg-sq-dtype fp8 is not supported yet"),
    ],
)  # fmt: skip
def test_what_it_does_not_cover_is_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value) == message


def test_flags_reach_the_optimizer_config():
    from megatron.training.optimizer.config import OptimizerConfig

    args = validated(["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                      "--exp-avg-sq-dtype", "bf16", "--bf16"])  # fmt: skip
    config = OptimizerConfig.from_args(args)
    assert config.use_precision_aware_optimizer and config.exp_avg_sq_dtype == "bf16"
