"""Megatron-LM flags that we accept without implementing them, and the check that says so.

Two tables, both listed in docs/megatron_flags.md:

* `OUR_BEHAVIOUR`: flags whose effect is already what this implementation does (for example
  `--use-mcore-models`: the model is always megatron-core's), or that only change speed and
  never the numbers, the memory or the parallel layout. Accepted and documented.
* `NOT_SUPPORTED`: features we do not have yet. They parse, so a Megatron command line is
  read completely, but any value other than the default fails validation with one line:
  `--foo is not supported yet`. Flags that take a value and support some of its values list
  the supported ones; anything else fails the same way naming the value.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron.training.errors import UserError


@dataclass(frozen=True)
class Flag:
    """How a compatibility flag parses: a switch (no value) or a value of `type`."""

    name: str
    type: type | None = None  # None: a store_true switch
    default: object = None
    nargs: str | None = None
    supported: tuple | None = ()  # values accepted besides the default; None: any value

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def _switches(*names: str) -> list[Flag]:
    return [Flag(name) for name in names]


# Accepted: our behaviour already, or speed-only (see the docs table for each one's reason).
OUR_BEHAVIOUR = [
    *_switches(
        "--use-mcore-models",
        "--no-gradient-accumulation-fusion",
        "--no-rope-fusion",
        "--no-persist-layer-norm",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--manual-gc",
        "--async-save",
        "--use-persistent-ckpt-worker",
        "--dist-ckpt-optim-fully-reshardable",
        "--ckpt-fully-parallel-load",
        "--ckpt-fully-parallel-save",
        "--no-ckpt-fully-parallel-save",
        "--ckpt-assume-constant-structure",
        "--async-ckpt-use-cpu-shm",
        "--apply-query-key-layer-scaling",
        "--attention-softmax-in-fp32",
        "--overlap-p2p-communication-warmup-flush",
    ),
    Flag("--transformer-impl", str, "transformer_engine", supported=("local",)),
    Flag("--attention-backend", str, "auto", supported=("flash", "fused", "unfused", "local")),
    Flag("--async-strategy", str, "nvrx", supported=None),
    Flag("--num-workers", int, 2, supported=None),
    Flag("--empty-unused-memory-level", int, 0, supported=(1, 2)),
    Flag("--rerun-mode", str, "disabled"),
    Flag("--timing-log-level", int, 0),
    Flag("--context-parallel-size", int, 1),
]

# Parsed, rejected at validation unless left at the default.
NOT_SUPPORTED = [
    # mixed precision and low precision
    *_switches("--fp8-param-gather", "--grad-reduce-in-bf16"),
    Flag("--fp8-format", str),
    Flag("--fp8-recipe", str),
    Flag("--fp8-amax-history-len", int),
    Flag("--fp8-amax-compute-algo", str),
    # distributed optimizer, overlap, FSDP
    *_switches(
        "--use-torch-fsdp2",
        "--use-megatron-fsdp",
        "--tp-comm-overlap",
        "--defer-embedding-wgrad-compute",
        "--use-tp-pp-dp-mapping",
    ),
    Flag("--data-parallel-sharding-strategy", str),
    Flag("--megatron-fsdp-main-params-dtype", str),
    Flag("--megatron-fsdp-main-grads-dtype", str),
    Flag("--megatron-fsdp-grad-comm-dtype", str),
    Flag("--tp-comm-overlap-cfg", str),
    Flag("--wgrad-deferral-limit", int, 0),
    # context parallelism (expert parallelism: moe/flags.py)
    Flag("--cp-comm-type", str),
    Flag("--hierarchical-context-parallel-sizes", str, nargs="+"),
    # other attention variants (MoE: moe/flags.py)
    Flag("--multi-latent-attention"),
    Flag("--q-lora-rank", int),
    Flag("--kv-lora-rank", int),
    Flag("--qk-head-dim", int),
    Flag("--qk-pos-emb-head-dim", int),
    Flag("--v-head-dim", int),
    Flag("--experimental-attention-variant", str),
    Flag("--attention-output-gate"),
    Flag("--linear-attention-freq", int),
    Flag("--linear-conv-kernel-dim", int),
    Flag("--linear-key-head-dim", int),
    Flag("--linear-value-head-dim", int),
    Flag("--linear-num-key-heads", int),
    Flag("--linear-num-value-heads", int),
    Flag("--dsa-indexer-n-heads", int),
    Flag("--dsa-indexer-head-dim", int),
    Flag("--dsa-indexer-topk", int),
    Flag("--dsa-indexer-loss-coeff", float),
    Flag("--apply-wd-to-qk-layernorm"),
    Flag("--use-mup"),
    Flag("--mup-base-hidden-size", int),
    # optimizer and batch schedule variants
    Flag("--step-batch-size-schedule", str),
    Flag("--eval-global-batch-size", int),
    # data variants
    Flag("--fim-data"),
    Flag("--fim-rate", float),
    Flag("--fim-spm-rate", float),
    Flag("--tiktoken-pattern", str),
    # checkpoints, fault tolerance, testing hooks
    Flag("--save-retain-interval", int),
    Flag("--error-injection-rate", int, 0),
    Flag("--error-injection-type", str),
    Flag("--export-te-mcore-model"),
    Flag("--export-kd-teacher-load", str),
    Flag("--export-kd-cfg", str),
    # logging and profiling outside this process
    Flag("--wandb-project", str),
    Flag("--wandb-entity", str),
    Flag("--wandb-exp-name", str),
    Flag("--wandb-save-dir", str),
    Flag("--profile"),
    Flag("--profile-step-start", int, 10),
    Flag("--profile-step-end", int, 12),
]

# Value flags whose other values are other features (`--ckpt-format torch_dcp` and
# `fsdp_dtensor`: other checkpoint formats). These are parsed in arguments.py.
VALUE_NOT_SUPPORTED = {
    "--ckpt-format": ("torch_dist", "torch"),
}


def add_compatibility_flags(parser: argparse.ArgumentParser) -> None:
    for title, flags in (("Megatron flags: our behaviour", OUR_BEHAVIOUR),
                         ("Megatron flags: not supported yet", NOT_SUPPORTED)):  # fmt: skip
        add = parser.add_argument_group(title).add_argument
        for flag in flags:
            if flag.type is None:
                add(flag.name, action="store_true", help=argparse.SUPPRESS)
            else:
                add(flag.name, type=flag.type, default=flag.default, nargs=flag.nargs,
                    help=argparse.SUPPRESS)  # fmt: skip


def _rejected_value(flag: Flag, value) -> bool:
    default = False if flag.type is None else flag.default
    if flag.supported is None:
        return False
    return value != default and value not in flag.supported


def unsupported_flags(args: argparse.Namespace) -> list[str]:
    """`--foo` (or `--foo VALUE`) for every flag set to something we do not implement."""
    found = []
    for flag in OUR_BEHAVIOUR:
        value = getattr(args, flag.dest)
        if flag.type is not None and _rejected_value(flag, value):
            found.append(f"{flag.name} {value}")
    for flag in NOT_SUPPORTED:
        if _rejected_value(flag, getattr(args, flag.dest)):
            found.append(flag.name)
    for name, supported in VALUE_NOT_SUPPORTED.items():
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if value not in supported:
            found.append(f"{name} {value}")
    return found


def apply_megatron_fallbacks(args: argparse.Namespace) -> None:
    """What Megatron turns off rather than refuses: --sequence-parallel without tensor
    parallelism (the sequence is then not split: nothing changes), with Megatron's warning."""
    if getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size == 1:
        if os.environ.get("RANK", "0") == "0":
            print(
                "WARNING: Disabling sequence parallelism because tensor model parallelism is "
                "disabled",
                flush=True,
            )
        args.sequence_parallel = False


def reject_unsupported_flags(args: argparse.Namespace) -> None:
    apply_megatron_fallbacks(args)
    found = unsupported_flags(args)
    if found:
        raise UserError(f"{found[0]} is not supported yet")
