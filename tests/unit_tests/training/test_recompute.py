"""Activation recomputation: Megatron's flags and rules, the TransformerConfig fields, and
megatron-core's checkpoint on a machine without CUDA (dropout masks drawn again exactly)."""

import pytest
import torch
from small_run_flags import configured, validated

from megatron.common.errors import UserError


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (["--recompute-granularity", "full"], 1,
         "--recompute-granularity full needs --recompute-method uniform or block"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform"], 1,
         "--recompute-granularity full needs --recompute-num-layers (1 to 4, the layers of a "
         "stage)"),
        (["--recompute-method", "block"], 1,
         "--recompute-method needs --recompute-granularity (or --recompute-activations)"),
        (["--recompute-modules", "core_attn"], 1,
         "--recompute-modules needs --recompute-granularity (or --recompute-activations)"),
        (["--recompute-activations", "--recompute-method", "uniform"], 1,
         "--recompute-method is not supported with --recompute-granularity selective "
         "(Megatron: recompute method is for full recomputation only)"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
         "--recompute-num-layers must not be set with --recompute-granularity selective"),
        (["--recompute-activations", "--recompute-granularity", "full"], 1,
         "--recompute-activations means --recompute-granularity selective; it conflicts with "
         "--recompute-granularity full"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "0"], 1, "--recompute-num-layers must be >= 1, got 0"),
        (["--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
         "--recompute-num-layers 3 exceeds the 2 layers of a pipeline stage"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "2", "--pipeline-model-parallel-size", "4"], 4,
         "--recompute-method uniform: --recompute-num-layers 2 must divide the layers of every "
         "pipeline stage (1 1 1 1)"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1", "--recompute-modules", "core_attn"], 1,
         "--recompute-modules applies to --recompute-granularity selective only"),
        (["--recompute-activations", "--recompute-modules", "moe"], 1,
         "--recompute-modules moe is not supported yet (no MoE or MLA)"),
        (["--recompute-activations", "--recompute-modules", "attn"], 1,
         "unknown --recompute-modules 'attn' (known: core_attn)"),
        (["--recompute-activations", "--recompute-modules", "mlp"], 1,
         "--recompute-modules mlp is not supported yet (megatron-core's recursion on the MLP's "
         "bias)"),
        (["--recompute-activations", "--recompute-modules", "core_attn", "layernorm"], 1,
         "--recompute-modules layernorm is not supported yet (GPU-only: megatron-core's needs "
         "Transformer Engine)"),
        (["--recompute-activations", "--recompute-modules", "[core_attn mlp]"], 1,
         "--recompute-modules mlp is not supported yet (megatron-core's recursion on the MLP's "
         "bias)"),  # Megatron's test configs write the list as one string
    ],
)  # fmt: skip
def test_megatron_rules_fail_with_one_line(extra, world_size, message):
    with pytest.raises(UserError) as caught:
        validated(extra, world_size)
    assert str(caught.value) == message


def test_uneven_stages_bound_the_uniform_chunk():
    """1 + 3 + 3 + 1 layers: uniform chunks of 1 fit every stage, chunks of 3 do not."""
    uneven = ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
              "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
              "1", "--recompute-granularity", "full", "--recompute-method", "uniform"]  # fmt: skip
    assert validated(uneven + ["--recompute-num-layers", "1"], 4).recompute_num_layers == 1
    with pytest.raises(UserError, match=r"every pipeline stage \(1 3 3 1\)"):
        validated(uneven + ["--recompute-num-layers", "3"], 4)


@pytest.mark.parametrize(
    "extra, granularity, method, layers, modules",
    [
        ([], None, None, None, ["core_attn"]),
        (["--recompute-activations"], "selective", None, None, ["core_attn"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
         "selective", None, None, ["core_attn"]),
        (["--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "3"], "full", "block", 3, ["core_attn"]),
    ],
)  # fmt: skip
def test_flags_reach_transformer_config(extra, granularity, method, layers, modules):
    from megatron.model.build import transformer_config

    config = transformer_config(configured(extra), torch.device("cpu"))
    assert config.recompute_granularity == granularity
    assert config.recompute_method == method
    assert config.recompute_num_layers == layers
    assert config.recompute_modules == modules


def _dropout_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    hidden = torch.nn.functional.dropout(x @ weight, p=0.5, training=True)
    return torch.nn.functional.dropout(torch.tanh(hidden) @ weight, p=0.5, training=True)


def test_megatron_core_checkpoint_redraws_the_same_dropout_masks_on_cpu():
    """megatron-core's `tensor_parallel.checkpoint` (what full and selective recomputation call)
    on CPU: the recomputed forward must draw the forward's dropout masks, so the gradients equal
    those of the plain forward, and the generator continues as if nothing was recomputed."""
    from megatron.core import tensor_parallel

    from megatron.model.recompute import use_host_rng_states

    use_host_rng_states()
    weight = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(7)
    plain = _dropout_chain(x, weight)
    plain.sum().backward()
    expected = (plain.detach(), x.grad.clone(), weight.grad.clone(), torch.rand(3))
    x.grad = weight.grad = None
    torch.manual_seed(7)
    recomputed = tensor_parallel.checkpoint(_dropout_chain, False, x, weight)
    recomputed.sum().backward()
    after = torch.rand(3)
    assert torch.equal(recomputed.detach(), expected[0])
    assert torch.equal(x.grad, expected[1]) and torch.equal(weight.grad, expected[2])
    assert torch.equal(after, expected[3])


def test_recompute_num_layers_alone_has_no_effect_as_in_megatron(capsys):
    args = validated(["--recompute-num-layers", "1"])
    assert args.recompute_num_layers is None and args.recompute_granularity is None
    assert "--recompute-num-layers has no effect without --recompute-granularity" in (
        capsys.readouterr().out
    )
