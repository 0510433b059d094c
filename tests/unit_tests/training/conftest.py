"""A tiny module with GPT-style parameter names, for optimizer tests without megatron-core."""

import os
from types import SimpleNamespace

import pytest
import torch

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
        self.config = SimpleNamespace(num_attention_heads=HEADS, num_query_groups=HEADS)


def optimizer_args(name: str, **overrides) -> SimpleNamespace:
    args = dict(
        optimizer=name, lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_eps=1e-8, sgd_momentum=0.9, muon_momentum=0.9,
        muon_use_nesterov=False, muon_split_qkv=True, muon_scale_mode="spectral",
        muon_num_ns_steps=5, muon_extra_scale_factor=1.0, tensor_model_parallel_size=1,
        num_attention_heads=HEADS, async_error_feedback=False, delay_compensation_lambda=0.0,
        train_iters=10, lr_decay_iters=None, lr_warmup_fraction=None, lr_warmup_iters=0,
        lr_decay_style="constant",
    )  # fmt: skip
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.fixture
def tiny_gpt():
    return TinyGPT()
