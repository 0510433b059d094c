"""Gated DeltaNet hybrid attention (megatron/model/gated_delta_net.py): Megatron's flags and
their one-line refusals, the hybrid model megatron-core builds from them in the portable spec
(GDN where --linear-attention-freq puts it, the layer's initialization), the tensor-parallel
slicing of its fused projections, and --apply-wd-to-qk-layernorm's weight decay groups."""

import pytest
import torch
from small_run_flags import configured, validated

from megatron.common.errors import UserError
from megatron.model.gated_delta_net import tensor_parallel_slice

GDN = [
    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
    "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
    "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
]  # fmt: skip


def without(flags: list[str], name: str) -> list[str]:
    index = flags.index(name)
    return flags[:index] + flags[index + 2 :]


@pytest.mark.parametrize(
    "extra, message",
    [
        (without(GDN, "--linear-attention-freq"),
         "--experimental-attention-variant gated_delta_net needs --linear-attention-freq"),
        (GDN + ["--linear-attention-freq", "[1,0,1]"],
         "--linear-attention-freq lists 3 layers, --num-layers 4"),
        (GDN + ["--linear-attention-freq", "0"], "--linear-attention-freq must be >= 1, got 0"),
        (GDN + ["--linear-num-value-heads", "3"],
         "--linear-num-value-heads 3 must be a multiple of --linear-num-key-heads 2"),
        (GDN + ["--linear-conv-kernel-dim", "0"], "--linear-conv-kernel-dim must be >= 1, got 0"),
        (GDN + ["--context-parallel-size", "2", "--attention-dropout", "0"],
         "--experimental-attention-variant gated_delta_net with --context-parallel-size > 1 is "
         "not supported yet"),
        (GDN + ["--mtp-num-layers", "1"],
         "--experimental-attention-variant gated_delta_net with --mtp-num-layers is not "
         "supported yet"),
        (["--experimental-attention-variant", "dsa"],
         "--experimental-attention-variant dsa needs --multi-latent-attention (megatron-core's "
         "sparse attention is MLA's)"),
        (["--attention-output-gate", "--multi-latent-attention"],
         "--attention-output-gate with --multi-latent-attention: megatron-core has no output "
         "gate for MLA"),
    ],
)  # fmt: skip
def test_flag_mistakes_are_one_line(extra, message):
    world_size = 2 if "--context-parallel-size" in extra else 1
    with pytest.raises(UserError) as caught:
        validated(extra, world_size=world_size)
    assert str(caught.value) == message


def test_tensor_parallel_heads_must_divide():
    with pytest.raises(UserError) as caught:
        validated(GDN + ["--linear-num-key-heads", "1", "--tensor-model-parallel-size", "2"], 2)
    assert str(caught.value) == (
        "--linear-num-key-heads and --linear-num-value-heads must divide by the tensor-parallel "
        "size 2"
    )


def test_megatrons_list_pattern_is_parsed():
    args = validated(GDN + ["--linear-attention-freq", "([1]*1+[0]*1)*2"])
    assert args.linear_attention_freq == [1, 0, 1, 0]
    assert configured(GDN).model.linear_attention_freq == 2


def test_hybrid_model_has_gdn_where_the_pattern_says(one_rank_group):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    from megatron.model.build import build_stage_model

    config = configured(GDN + ["--attention-output-gate", "--swiglu"], vocab_size=128)
    model = build_stage_model(config, torch.device("cpu"))
    kinds = [type(layer.self_attention) for layer in model.decoder.layers]
    assert kinds == [GatedDeltaNet, SelfAttention, GatedDeltaNet, SelfAttention]
    gdn = model.decoder.layers[0].self_attention
    assert gdn.in_proj.weight.shape == (2 * 16 + 2 * 32 + 2 * 4, 64)  # q k v gate beta alpha
    assert torch.all((gdn.A_log >= 0) & (gdn.A_log <= torch.log(torch.tensor(16.0))))
    assert torch.equal(gdn.dt_bias, torch.ones(4))
    assert gdn.conv1d.weight.abs().max() <= 0.5  # 1 / sqrt(width 4)
    assert gdn.conv1d.weight.std() > 0.1
    # the gated softmax attention projects a gate per query head too
    attention = model.decoder.layers[1].self_attention
    assert attention.linear_qkv.weight.shape[0] == (4 + 4 + 2 * 4) * 16
    tokens = torch.randint(0, 128, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    logits = model(tokens, positions, None)
    assert logits.shape[-1] == 128 and torch.isfinite(logits).all()
    logits.float().sum().backward()
    assert gdn.A_log.grad.abs().sum() > 0 and gdn.conv1d.weight.grad.abs().sum() > 0


def test_tensor_parallel_slice_takes_each_blocks_part():
    full = torch.arange(12.0)[:, None]  # blocks of 4, 4 and 4 rows
    assert tensor_parallel_slice(full, (4, 4, 4), 2, 1).flatten().tolist() == [
        2, 3, 6, 7, 10, 11,
    ]  # fmt: skip
    assert tensor_parallel_slice(full, 2, 2, 0).flatten().tolist() == [0, 1, 2, 6, 7, 8]


def test_weight_decay_on_qk_layernorms_only_when_asked(one_rank_group):
    from megatron.model.build import build_stage_model
    from megatron.training.optimizer.suite import decay_groups, decay_qk_layernorms

    config = configured(["--qk-layernorm"], vocab_size=128)
    model = build_stage_model(config, torch.device("cpu"))
    qk_norms = {id(p) for n, p in model.named_parameters() if "q_layernorm." in n}
    assert qk_norms

    def decayed(named):
        return {id(p) for g in decay_groups(named) if g["wd_mult"] == 1.0 for p in g["params"]}

    assert not qk_norms & decayed(list(model.named_parameters()))
    decay_qk_layernorms(model)
    assert qk_norms <= decayed(list(model.named_parameters()))
    qk = ("q_layernorm.", "k_layernorm.")
    others = {
        id(p) for n, p in model.named_parameters() if "norm" in n and not any(q in n for q in qk)
    }
    assert not others & decayed(list(model.named_parameters()))
