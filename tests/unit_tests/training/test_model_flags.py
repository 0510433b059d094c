"""Megatron's model flags that megatron-core implements (RoPE scaling and interpolation, the
OpenAI GeLU, Xavier-uniform init), Megatron's legacy and deprecated spellings, and the long tail
of its parser refused in one line."""

import math

import pytest
import torch
from small_run_flags import BASE, configured, validated

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.megatron_flags import DEPRECATED, NOT_YET, not_supported_message

ROPE = ["--position-embedding-type", "rope"]


def stage(extra: list[str]):
    from megatron.model.build import build_stage_model

    return build_stage_model(configured(extra, vocab_size=128), torch.device("cpu"))


def test_rope_scaling_and_interpolation_reach_megatron_cores_rotary_embedding(one_rank_group):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    plain = stage(ROPE).rotary_pos_emb
    scaled = stage(ROPE + ["--use-rope-scaling", "--rope-scaling-factor", "4"]).rotary_pos_emb
    reference = RotaryEmbedding(
        16, 1.0, rope_scaling=True, rope_scaling_factor=4.0, use_cpu_initialization=True
    )
    assert torch.equal(scaled.inv_freq, reference.inv_freq)
    assert not torch.equal(scaled.inv_freq, plain.inv_freq)
    interpolated = stage(ROPE + ["--rotary-seq-len-interpolation-factor", "2"]).rotary_pos_emb
    emb = interpolated.get_emb(8)[:, 0, 0, : plain.inv_freq.numel()]
    assert torch.allclose(emb, torch.outer(torch.arange(8) / 2, plain.inv_freq))
    assert not torch.allclose(emb, plain.get_emb(8)[:, 0, 0, : plain.inv_freq.numel()])


def test_openai_gelu_is_megatron_cores(one_rank_group):
    from megatron.core.transformer.utils import openai_gelu

    from megatron.model.build import transformer_config

    config = transformer_config(configured(["--openai-gelu"]), torch.device("cpu"))
    assert config.activation_func is openai_gelu
    default = transformer_config(configured([]), torch.device("cpu"))
    assert default.activation_func is torch.nn.functional.gelu


def test_xavier_uniform_init_of_every_weight_matrix(one_rank_group):
    xavier, normal = stage(["--init-method-xavier-uniform"]), stage([])
    checked = 0
    for (name, weight), (_, reference) in zip(xavier.named_parameters(), normal.named_parameters()):
        if weight.dim() != 2:
            assert torch.equal(weight, reference), name  # norms and biases: unchanged
            continue
        fan_out, fan_in = weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        assert weight.abs().max() <= bound, name
        assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.1 * bound, name
        assert reference.abs().max() < 0.5 * bound or reference.std() < 0.5 * weight.std(), name
        checked += 1
    assert checked >= 5  # embedding, qkv, proj, fc1, fc2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--no-position-embedding"],
         "--no-position-embedding is deprecated, use --position-embedding-type"),
        (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
        (["--rotary-seq-len-interpolation-factor", "2"],
         "--rotary-seq-len-interpolation-factor needs --position-embedding-type rope"),
        (["--openai-gelu", "--swiglu"], "--swiglu and --openai-gelu exclude each other"),
    ],
)  # fmt: skip
def test_model_flag_mistakes_are_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value) == message


def test_legacy_rope_spellings():
    assert validated(["--use-rotary-position-embeddings"]).position_embedding_type == "rope"
    assert not validated(ROPE + ["--no-position-embedding"]).add_position_embedding


@pytest.mark.parametrize("flag", sorted(DEPRECATED))
def test_deprecated_spellings_get_megatrons_message(flag):
    kind, message = DEPRECATED[flag]
    with pytest.raises(UserError) as caught:
        validated([flag] + ([] if kind is None else ["4"]))
    assert str(caught.value) == message


def test_deprecated_without_effect_is_accepted_with_megatrons_notice(capsys):
    args = validated(["--use-dist-ckpt", "--dist-ckpt-format", "torch_dist"])
    assert args.ckpt_format == "torch_dist"
    out = capsys.readouterr().out
    assert "--use-dist-ckpt is deprecated and has no effect" in out
    assert "--dist-ckpt-format is deprecated and has no effect" in out


def test_every_flag_of_the_long_tail_fails_with_one_line():
    parser = build_parser()
    for flag in NOT_YET:
        given = [flag.name] if flag.type is None else [flag.name, "1"]
        args = parser.parse_args(BASE + given)
        with pytest.raises(UserError) as caught:
            validate_args(args, world_size=1)
        assert str(caught.value) == not_supported_message(flag.name), flag.name
    assert len(NOT_YET) > 300


def test_no_flag_of_megatrons_pretraining_parser_is_unknown():
    """tools/megatron_flag_coverage.py's list of Megatron-LM's in-scope parser flags: each one
    parses here (works, is our behaviour, is deprecated with Megatron's message, or is refused
    in one line)."""
    import json
    import os

    from megatron.studies.flag_coverage import in_scope, parser_flag_statuses

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with open(os.path.join(repo, "tools", "data", "megatron_pretraining_flags.json")) as handle:
        stored = json.load(handle)["flags"]
    assert len(stored) > 600 and all(in_scope(group, flag) for group, flag, _ in stored)
    statuses = parser_flag_statuses(stored)
    assert [flag for flag, _, status in statuses if status == "unknown"] == []
    with open(os.path.join(repo, "docs", "megatron_flags.md")) as handle:
        docs = handle.read()
    missing = [f for f, group, status in statuses if f"| `{f}` | {group} | {status} |" not in docs]
    assert not missing, f"rows of docs/megatron_flags.md out of date (--flag-table): {missing[:5]}"
    implemented = {flag for flag, _, status in statuses if status == "implemented"}
    assert {"--eod-mask-loss", "--train-data-path", "--use-rope-scaling",
            "--muon-nesterov", "--lion-beta1"} <= implemented  # fmt: skip


def test_reset_attention_mask_needs_every_stage_to_read_the_batch():
    args = build_parser().parse_args(
        BASE + ["--reset-attention-mask", "--pipeline-model-parallel-size", "4"]
    )
    with pytest.raises(UserError) as caught:
        validate_args(args, world_size=4)
    assert str(caught.value).startswith(
        "--reset-attention-mask with pipeline stages that read no batch"
    )
    validated(["--reset-attention-mask"])  # one stage: accepted
