"""--use-mup (Megatron's maximal update parameterization): the flags, the width multiplier,
the attention scale, the initialization's stds, the logits' and embedding's factors, and the
optimizer's per-parameter learning rates and epsilons, against Megatron's formulas written
out here."""

import math

import pytest
import torch
from conftest import TinyGPT, optimizer_config
from small_run_flags import configured, validated

from megatron.common.errors import UserError
from megatron.model import mup
from megatron.model.build import transformer_config
from megatron.model.gpt import _init_kind
from megatron.training.optimizer.build import build_optimizer

MUP = ["--use-mup", "--mup-base-hidden-size", "16"]  # BASE has --hidden-size 64: w = 4


def test_width_multiplier_softmax_scale_and_output_factor():
    model = configured(MUP).model
    assert mup.width_mult(model) == 4.0
    head_dim = model.hidden_size // model.num_attention_heads
    assert mup.softmax_scale(model) == pytest.approx(1.0 / head_dim)  # 1/d, not 1/sqrt(d)
    assert mup.output_mult(model) == 0.25
    config = transformer_config(configured(MUP), torch.device("cpu"))
    assert config.softmax_scale == pytest.approx(1.0 / head_dim)
    assert config.mup_width_mult == 4.0


def test_base_head_dim_power_and_explicit_output_factor():
    model = configured(MUP + ["--mup-base-head-dim", "4", "--mup-attn-scale-power", "0.5",
                              "--mup-output-mult", "0.5"]).model  # fmt: skip
    head_dim = model.hidden_size // model.num_attention_heads
    assert mup.softmax_scale(model) == pytest.approx(2.0 / math.sqrt(head_dim))
    assert mup.output_mult(model) == 0.5


def test_without_mup_nothing_changes():
    model = configured([]).model
    assert mup.width_mult(model) == 1.0 and mup.softmax_scale(model) is None
    assert transformer_config(configured([]), torch.device("cpu")).softmax_scale is None


@pytest.mark.parametrize("extra, message", [
    (["--mup-base-hidden-size", "16"], "--mup-base-hidden-size acts only with --use-mup"),
    (["--use-mup", "--mup-base-hidden-size", "0"], "--mup-base-hidden-size must be positive, got 0"),
    (["--use-mup", "--mup-base-head-dim", "-1"], "--mup-base-head-dim must be positive, got -1.0"),
    (["--use-mup", "--multi-latent-attention"],
     "--use-mup with --multi-latent-attention is not supported yet"),
])  # fmt: skip
def test_bad_input_is_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value) == message


@pytest.mark.parametrize("name, kind, expected", [
    ("embedding.word_embeddings.weight", "normal", 0.02),
    ("decoder.layers.0.self_attention.linear_qkv.weight", "normal", 0.02 / 2),
    ("output_layer.weight", "normal", 0.02 / 2),  # megatron-core's init_method: width-scaled
    ("decoder.layers.0.mlp.linear_fc2.weight", "scaled_normal", 0.02 / (math.sqrt(2 * 6) * 2)),
])  # fmt: skip
def test_initialization_stds(name, kind, expected):
    assert _init_kind(name, torch.nn.Parameter(torch.zeros(2, 2))) == kind
    assert mup.init_std(kind, name, 0.02, num_layers=6, width=4.0) == pytest.approx(expected)


def test_the_factors_scale_embedding_and_logits():
    model = torch.nn.Module()
    model.embedding, model.output_layer = torch.nn.Identity(), torch.nn.Identity()
    settings = configured(MUP + ["--mup-embedding-mult", "3"]).model
    mup.apply_multipliers(model, settings)
    x = torch.ones(2)
    assert torch.equal(model.embedding(x), 3 * x)
    assert torch.equal(model.output_layer(x), x / 4)


def _groups_of(optimizer):
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("bf16", [False, True])
def test_adam_scales_the_hidden_matrices_lr_and_eps(bf16):
    model = TinyGPT().to(torch.bfloat16 if bf16 else torch.float32)
    config = optimizer_config("adam", lr=1e-2, min_lr=1e-3, bf16=bf16, mup_width_mult=4.0)
    optimizer = build_optimizer(model, config)
    mains = dict(zip(map(id, optimizer.params), optimizer.main)) if bf16 else None
    groups = _groups_of(optimizer)
    for name, param in model.named_parameters():
        group = groups[id(mains[id(param)] if bf16 else param)]
        hidden = param.dim() == 2 and not name.startswith(("embedding", "output_layer"))
        if hidden:
            assert (group["max_lr"], group["min_lr"]) == (1e-2 / 4, 1e-3 / 4), name
            assert group["eps"] == pytest.approx(1e-8 / 4)
        else:
            assert "max_lr" not in group and group["eps"] == 1e-8, name


def test_sgd_scales_the_vector_like_parameters_and_muon_nothing():
    model = TinyGPT()
    groups = _groups_of(build_optimizer(model, optimizer_config("sgd", mup_width_mult=4.0)))
    for name, param in model.named_parameters():
        vector_like = param.dim() <= 1 or name.startswith(("embedding", "output_layer"))
        assert groups[id(param)].get("max_lr") == (4e-2 if vector_like else None), name
    muon = build_optimizer(TinyGPT(), optimizer_config("muon", mup_width_mult=4.0))
    assert not any(g.get("mup") for g in muon.param_groups)


def test_decoupled_lr_keeps_its_schedule_under_mup():
    model = TinyGPT()
    config = optimizer_config("adam", decoupled_lr=3e-2, mup_width_mult=4.0)
    groups = _groups_of(build_optimizer(model, config))
    assert groups[id(model.output_layer.weight)]["max_lr"] == 3e-2
    assert groups[id(model.output_layer.weight)]["eps"] == 1e-8
