"""Megatron's Maximal Update Parameterization (`--use-mup`): hyperparameters tuned on a narrow
base model carry over to wider ones. With width multiplier w = hidden / --mup-base-hidden-size
(Megatron's rules, which megatron-core 0.16.1 predates, so they are applied here):

* initialization: hidden weights N(0, std / sqrt(w)), residual-branch outputs
  N(0, std / sqrt(2 L w)); the embeddings keep N(0, std);
* attention: softmax scale sqrt(--mup-base-head-dim) / d_head ** --mup-attn-scale-power
  (1 / d_head by default instead of 1 / sqrt(d_head));
* the embedding's output times --mup-embedding-mult, the logits times --mup-output-mult
  (1 / w when left at 1);
* the optimizer: under Adam(W) the hidden matrices' learning rate (peak and floor) and epsilon
  divided by w; under SGD the vector-like parameters' learning rate (1-D ones, the embedding
  and output layer) times w; under the other optimizers the hidden matrices' learning rate
  divided by w, except the matrices Muon orthogonalizes (its own scale). With --decoupled-lr
  the embedding and output layer keep that schedule.
"""

import argparse
import math

import torch

from megatron.common.errors import UserError


def add_mup_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("muP (maximal update parameterization)").add_argument
    add("--use-mup", action="store_true",
        help="scale initialization, attention, logits and learning rates with the width")  # fmt: skip
    add("--mup-base-hidden-size", type=int, default=None,
        help="the base model's hidden size (default: --hidden-size, width multiplier 1)")  # fmt: skip
    add("--mup-base-head-dim", type=float, default=None,
        help="softmax scale sqrt(this) / d_head ** power (default: 1 / d_head ** power)")  # fmt: skip
    add("--mup-embedding-mult", type=float, default=1.0, help="the embedding output's factor")
    add("--mup-output-mult", type=float, default=1.0,
        help="the logits' factor (left at 1: 1 / width multiplier)")  # fmt: skip
    add("--mup-attn-scale-power", type=float, default=1.0,
        help="1: muP attention (1 / d_head); 0.5: the standard 1 / sqrt(d_head)")  # fmt: skip


def validate_mup_args(args: argparse.Namespace) -> None:
    given = [flag for flag, value, default in (
        ("--mup-base-hidden-size", args.mup_base_hidden_size, None),
        ("--mup-base-head-dim", args.mup_base_head_dim, None),
        ("--mup-embedding-mult", args.mup_embedding_mult, 1.0),
        ("--mup-output-mult", args.mup_output_mult, 1.0),
        ("--mup-attn-scale-power", args.mup_attn_scale_power, 1.0),
    ) if value != default]  # fmt: skip
    if not args.use_mup:
        if given:
            raise UserError(f"{given[0]} acts only with --use-mup")
        return
    base = args.mup_base_hidden_size
    if base is not None and base <= 0:
        raise UserError(f"--mup-base-hidden-size must be positive, got {base}")
    if args.mup_base_head_dim is not None and args.mup_base_head_dim <= 0:
        raise UserError(f"--mup-base-head-dim must be positive, got {args.mup_base_head_dim}")
    for flag, on in (("--enable-vocab-parallel", args.enable_vocab_parallel),
                     ("--multi-latent-attention", args.multi_latent_attention)):  # fmt: skip
        if on:
            raise UserError(f"--use-mup with {flag} is not supported yet")


def width_mult(model) -> float:
    """hidden / base hidden size (1 without muP); `model`: a ModelConfig."""
    if not model.use_mup:
        return 1.0
    return model.hidden_size / (model.mup_base_hidden_size or model.hidden_size)


def softmax_scale(model) -> float | None:
    """The attention's softmax scale under muP (None: megatron-core's 1 / sqrt(d_head))."""
    if not model.use_mup:
        return None
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    base = 1.0 if model.mup_base_head_dim is None else math.sqrt(model.mup_base_head_dim)
    return base / head_dim**model.mup_attn_scale_power


def output_mult(model) -> float:
    if model.mup_output_mult == 1.0:
        return 1.0 / width_mult(model)
    return model.mup_output_mult


def init_std(kind: str, name: str, std: float, num_layers: int, width: float) -> float:
    """The N(0, .) std of a weight under muP (`kind` as model._init_kind: normal or
    scaled_normal); the embeddings keep the base std."""
    if "embedding" in name and kind == "normal":
        return std
    if kind == "scaled_normal":
        return std / (math.sqrt(2.0 * num_layers) * math.sqrt(width))
    return std / math.sqrt(width)


def config_attributes(model) -> dict:
    """What the model builder reads off megatron-core's TransformerConfig (set as attributes,
    as megatron-core 0.16.1 has no muP fields): the width multiplier and the ModelConfig."""
    if not model.use_mup:
        return {}
    return {"mup_width_mult": width_mult(model), "mup": model}


def apply_multipliers(model: torch.nn.Module, config) -> None:
    """The embedding's and the output layer's factors, as forward hooks (a factor before the
    embedding's dropout or after it is the same); `config`: the ModelConfig, None without
    muP."""
    if config is None or not config.use_mup:
        return
    embedding, output_layer = getattr(model, "embedding", None), getattr(
        model, "output_layer", None
    )
    if embedding is not None and config.mup_embedding_mult != 1.0:
        embedding.register_forward_hook(_scaled_by(config.mup_embedding_mult))
    factor = output_mult(config)
    if output_layer is not None and factor != 1.0:
        output_layer.register_forward_hook(_scaled_by(factor))


def _scaled_by(factor: float):
    def hook(module, inputs, output):
        if isinstance(output, tuple):  # megatron-core's linear layers: (output, bias)
            return (output[0] * factor, *output[1:])
        return output * factor

    return hook


def group_overrides(config, *, matrix: bool, vector_like: bool, embedding_or_output: bool) -> dict:
    """The optimizer settings muP changes for a parameter (`config`: an OptimizerConfig whose
    `mup_width_mult` is set): `matrix`, 2-D; `vector_like`, 1-D or the embedding or output
    layer; `embedding_or_output`, what --decoupled-lr schedules apart."""
    width = config.mup_width_mult
    if width == 1.0:
        return {}
    decoupled = config.decoupled_lr is not None and embedding_or_output
    if config.optimizer == "sgd":
        if not vector_like or decoupled:
            return {}
        return {"max_lr": config.lr * width, "min_lr": config.min_lr * width, "mup": "vector"}
    if vector_like or (config.optimizer == "muon" and matrix):
        return {}  # Muon's matrices keep their own scale
    settings = {} if decoupled else {"max_lr": config.lr / width, "min_lr": config.min_lr / width}
    if config.optimizer == "adam":
        settings["eps"] = config.adam_eps / width
    return {**settings, "mup": "hidden"} if settings else {}
