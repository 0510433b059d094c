"""Activation recomputation through megatron-core: Megatron's flags, their rules, the CPU path.

The flags are Megatron-LM's (`--recompute-activations`, `--recompute-granularity`,
`--recompute-method`, `--recompute-num-layers`, `--recompute-modules`) and go unchanged into
megatron-core's `TransformerConfig`, whose `TransformerBlock` and `TransformerLayer` do the
recomputation (`tensor_parallel.checkpoint`, `CheckpointWithoutOutput`):

* `full`: a stage keeps only the input of each recomputed chunk of layers and reruns the chunk
  in the backward; `uniform` cuts the stage's layers into chunks of `--recompute-num-layers`,
  `block` recomputes the first `--recompute-num-layers` layers one by one and keeps the rest;
* `selective` (what `--recompute-activations` means): only the `--recompute-modules` inside
  each layer are rerun: `core_attn`, the attention's softmax and dropout (the others are
  refused, see `NOT_SUPPORTED_MODULES`).

megatron-core's checkpoint saves the CPU generator, the CUDA generator and the model-parallel
RNG tracker at the forward and restores them for the recomputation, so dropout draws the same
masks twice. On a machine without CUDA the CUDA part fails (it reads the CUDA generator), so
`use_host_rng_states` makes that part empty there; the CPU generator, the one dropout on CPU
tensors draws from, is still saved and restored. Recomputation with dropout is therefore exact
on CPU too (tested: losses equal those without recomputation).
"""

import argparse
import os

import torch

from megatron.common.errors import UserError

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
# megatron-core 0.16's modules for a dense GPT. Refused: `layernorm` (its CheckpointWithoutOutput
# takes itself for FP8 and calls Transformer Engine's FP8 state, failing without TE), `mlp`
# (with biases the checkpointed MLP returns its bias parameter as an output, which gives the
# parameter the checkpoint as its gradient function: the backward recurses without end), and
# the MoE/MLA modules (nothing to act on here).
MODULES = ("core_attn",)
NOT_SUPPORTED_MODULES = {
    "layernorm": "GPU-only: megatron-core's needs Transformer Engine",
    "mlp": "megatron-core's recursion on the MLP's bias",
    **{name: "no MoE or MLA" for name in ("moe_act", "mla_up_proj", "moe", "shared_experts")},
}


def add_recompute_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("activation recomputation (Megatron's flags)").add_argument
    add("--recompute-activations", action="store_true",
        help="selective recomputation (= --recompute-granularity selective)")  # fmt: skip
    add("--recompute-granularity", default=None, choices=GRANULARITIES,
        help="full: whole layers (needs --recompute-method and --recompute-num-layers); "
        "selective: the --recompute-modules inside each layer")  # fmt: skip
    add("--recompute-method", default=None, choices=METHODS,
        help="full only. uniform: chunks of --recompute-num-layers layers, each keeping its "
        "input; block: the first --recompute-num-layers layers of each stage")  # fmt: skip
    add("--recompute-num-layers", type=int, default=None)
    add("--recompute-modules", nargs="*", default=None,
        help=f"selective only, default core_attn; of: {', '.join(MODULES)}")  # fmt: skip


def validate_recompute_args(args: argparse.Namespace, layers_by_stage: list[int]) -> None:
    """Megatron's rules (megatron/training/arguments.py and TransformerConfig), one line each.

    `layers_by_stage`: the transformer layers on each pipeline stage."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise UserError(
                "--recompute-activations means --recompute-granularity selective; it conflicts "
                "with --recompute-granularity full"
            )
        args.recompute_granularity = "selective"
    granularity = args.recompute_granularity
    if granularity is None:
        _reject_without_granularity(args)
        return
    if getattr(args, "emulated_forward_ms", None) is not None:
        raise UserError("--recompute-granularity needs a model: not with --emulated-forward-ms")
    if granularity == "selective":
        _validate_selective(args)
    else:
        _validate_full(args, layers_by_stage)


def _reject_without_granularity(args: argparse.Namespace) -> None:
    if args.recompute_num_layers is not None:  # Megatron reads it only with a granularity
        if os.environ.get("RANK", "0") == "0":
            print("> --recompute-num-layers has no effect without --recompute-granularity (as "
                  "in Megatron): nothing is recomputed", flush=True)  # fmt: skip
        args.recompute_num_layers = None
    for flag in ("recompute_method", "recompute_modules"):
        if getattr(args, flag) is not None:
            name = "--" + flag.replace("_", "-")
            raise UserError(f"{name} needs --recompute-granularity (or --recompute-activations)")


def _validate_selective(args: argparse.Namespace) -> None:
    if args.recompute_method is not None:
        raise UserError(
            "--recompute-method is not supported with --recompute-granularity selective "
            "(Megatron: recompute method is for full recomputation only)"
        )
    if args.recompute_num_layers is not None:
        raise UserError(
            "--recompute-num-layers must not be set with --recompute-granularity selective"
        )
    if args.recompute_modules is None:
        return  # megatron-core's default: core_attn
    modules = args.recompute_modules = module_list(args.recompute_modules)
    if not modules:
        raise UserError("--recompute-modules needs at least one module")
    for module in modules:
        if module in NOT_SUPPORTED_MODULES:
            why = NOT_SUPPORTED_MODULES[module]
            raise UserError(f"--recompute-modules {module} is not supported yet ({why})")
        if module not in MODULES:
            raise UserError(f"unknown --recompute-modules {module!r} (known: {', '.join(MODULES)})")


def module_list(values: list[str]) -> list[str]:
    """--recompute-modules as Megatron's test configs write it too: one YAML string
    "[layernorm mlp]" (a list in brackets) besides separate values."""
    text = " ".join(values).replace("[", " ").replace("]", " ").replace(",", " ")
    return text.split()


def _validate_full(args: argparse.Namespace, layers_by_stage: list[int]) -> None:
    if args.recompute_modules is not None:
        raise UserError("--recompute-modules applies to --recompute-granularity selective only")
    if args.recompute_method is None:
        raise UserError("--recompute-granularity full needs --recompute-method uniform or block")
    layers = args.recompute_num_layers
    if layers is None:
        raise UserError(
            f"--recompute-granularity full needs --recompute-num-layers (1 to "
            f"{max(layers_by_stage)}, the layers of a stage)"
        )
    if layers < 1:
        raise UserError(f"--recompute-num-layers must be >= 1, got {layers}")
    if args.recompute_method == "block" and layers > max(layers_by_stage):
        raise UserError(
            f"--recompute-num-layers {layers} exceeds the {max(layers_by_stage)} layers of a "
            "pipeline stage"
        )
    uneven = [n for n in layers_by_stage if n % layers]
    if args.recompute_method == "uniform" and uneven:
        # megatron-core's uniform loop would index past the stage's last layer
        raise UserError(
            f"--recompute-method uniform: --recompute-num-layers {layers} must divide the layers "
            f"of every pipeline stage ({' '.join(map(str, layers_by_stage))})"
        )


def recompute_config_fields(model) -> dict:
    """The TransformerConfig fields of the run's `ModelConfig`."""
    fields = dict(
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
    )
    modules = model.recompute_modules
    if modules is not None:
        fields["recompute_modules"] = list(modules)
    return fields


def _empty_device_rng_state(*unused_args, **unused_kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_device_rng_state(*unused_args, **unused_kwargs) -> None:
    return None


def use_host_rng_states() -> bool:
    """Without CUDA, make megatron-core's checkpoint save and restore only the CPU generator.

    Its `_get_all_rng_states` reads the CUDA generator unconditionally (an error without CUDA)
    and `_set_all_rng_states` queues a CUDA call that would never run. With no CUDA device
    nothing can draw from that generator, so an empty state loses nothing. Returns whether it
    changed anything; with CUDA available it leaves megatron-core alone."""
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _empty_device_rng_state
    mcore_random._set_cuda_rng_state = _ignore_device_rng_state
    return True
