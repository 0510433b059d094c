"""A tiny module with GPT-style parameter names, for optimizer tests without megatron-core."""

import os
from types import SimpleNamespace

import pytest
import torch

from megatron.training.optimizer.config import LRScheduleConfig, OptimizerConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HIDDEN, HEADS, VOCAB = 8, 2, 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.linear_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input_layernorm = torch.nn.LayerNorm(HIDDEN)


class TinyGPT(torch.nn.Module):
    """embedding.word_embeddings, decoder.layers.0.self_attention.*, output_layer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.decoder.layers[0].self_attention = Block()
        self.output_layer = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        for weight in (self.embedding.word_embeddings.weight, self.output_layer.weight):
            weight.is_embedding_or_output_parameter = True  # as megatron-core marks them
        self.config = SimpleNamespace(num_attention_heads=HEADS, num_query_groups=HEADS)


def backward_with(model, seed: int) -> None:
    """Gradients equal to fixed random coefficients (through autograd, so hooks run)."""
    generator = torch.Generator().manual_seed(seed)
    loss = 0.0
    for param in model.parameters():
        coefficient = torch.randn(param.shape, generator=generator).to(param.dtype)
        loss = loss + (param * coefficient).float().sum()
    loss.backward()


def optimizer_config(name: str, *, bf16: bool = False, fp16: bool = False, **overrides):
    """An OptimizerConfig for the tiny model (bf16/fp16: the model's dtype, as the flags)."""
    fields = dict(
        optimizer=name, lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_eps=1e-8, sgd_momentum=0.9, muon_momentum=0.9,
        muon_nesterov=False, muon_split_qkv=True, muon_scale_mode="spectral",
        muon_num_ns_steps=5, muon_extra_scale_factor=1.0, muon_coefficient_type="simple", tensor_model_parallel_size=1,
        num_attention_heads=HEADS, async_error_feedback=False, delay_compensation_lambda=0.0,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
    )  # fmt: skip
    fields.update(overrides)
    return OptimizerConfig(**fields)


def schedule_config(config) -> LRScheduleConfig:
    """A constant learning rate at the config's LR (10 steps, no warmup)."""
    return LRScheduleConfig(
        max_lr=config.lr, min_lr=config.min_lr, warmup_steps=0, decay_steps=10,
        decay_style="constant", weight_decay=config.weight_decay,
    )  # fmt: skip


@pytest.fixture
def tiny_gpt():
    return TinyGPT()
