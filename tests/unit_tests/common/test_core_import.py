"""megatron-core imported lean (megatron/common/core_import.py): in a fresh process, importing
the training loop leaves TorchInductor's compiler and Weights & Biases unimported, restores
`torch.compile` and `wandb` for everyone else, and megatron-core's fused kernels still compile
(on their first call) with the options they asked for."""

import subprocess
import sys

CHECK = r"""
import sys
import torch

compiled = []  # stands for torch.compile: records what it is asked to compile
torch.compile = recorder = lambda model, **options: compiled.append(model.__name__) or model
import megatron.training.training  # noqa: F401  our packages first, as every entry point does

assert "megatron.core" in sys.modules
assert "torch._inductor.compile_fx" not in sys.modules, "TorchInductor imported"
assert "wandb" not in sys.modules, "megatron-core imported wandb"
assert torch.compile is recorder, "torch.compile not restored"
assert compiled == [], f"compiled at import: {compiled}"
from megatron.core.fusions.fused_bias_gelu import bias_gelu

x = torch.ones(3)
assert torch.equal(bias_gelu(x, x), bias_gelu(x, x))
assert compiled == ["bias_gelu"], compiled  # on its first call, once
import wandb  # noqa: F401  importable again for our own tracking

print("ok")
"""


def test_training_imports_megatron_core_lean():
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
