"""Context parallelism's flags: --context-parallel-size, --cp-comm-type (one type, or one per
layer) and --hierarchical-context-parallel-sizes, with Megatron's rules; attention.py runs
them."""

import argparse
import math

from megatron.common.errors import UserError
from megatron.distributed.context_parallel.attention import CP_COMM_TYPES


def add_context_parallel_args(add) -> None:
    """Into the parallelism group (`add`: its add_argument)."""
    add("--context-parallel-size", type=int, default=1,
        help="split each sequence over this many ranks (2 x CP chunks, chunk i and 2CP-1-i on "
        "rank i); attention runs as a ring over them")  # fmt: skip
    add("--cp-comm-type", nargs="+", type=str, default=["p2p"],
        help="context-parallel attention: p2p (ring), all_gather, a2a (all-to-all of heads) or "
        "a2a+p2p (hierarchical); one type, or one per layer")  # fmt: skip
    add("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
        help="a2a+p2p: A B, the all-to-all inside groups of A consecutive context-parallel "
        "ranks, the ring over B of them (A x B = --context-parallel-size)")  # fmt: skip


def validate_context_parallel_args(args: argparse.Namespace) -> None:
    """--context-parallel-size: each rank holds 2 chunks of s / (2 CP) tokens (and with
    sequence parallelism a 1/tp share of them); --cp-comm-type and its groups."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    _validate_cp_comm_type(args)
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        raise UserError(f"--seq-length {args.seq_length} must be divisible by 2 x "
                        f"--context-parallel-size {cp} (two chunks per rank)")  # fmt: skip
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp:
        raise UserError(f"--sequence-parallel: --seq-length {args.seq_length} / "
                        f"--context-parallel-size {cp} must be divisible by "
                        f"--tensor-model-parallel-size {tp}")  # fmt: skip
    if args.emulated_forward_ms is not None:
        raise UserError("emulated stages with --context-parallel-size > 1 are not supported yet")
    if args.reset_attention_mask:
        raise UserError("--reset-attention-mask with --context-parallel-size > 1 is not supported "
                        "yet (the ring attention is causal over the whole sequence)")  # fmt: skip


def _validate_cp_comm_type(args: argparse.Namespace) -> None:
    """--cp-comm-type (one type, or one per layer) and --hierarchical-context-parallel-sizes,
    with Megatron's rules; an all-to-all needs the heads of a tensor-parallel rank to divide
    over its ranks (all of CP for a2a, the inner A for a2a+p2p)."""
    types, sizes = args.cp_comm_type or ["p2p"], args.hierarchical_context_parallel_sizes
    cp = args.context_parallel_size
    unknown = [t for t in types if t not in CP_COMM_TYPES]
    if unknown:
        raise UserError(f"--cp-comm-type {unknown[0]}: one of {', '.join(CP_COMM_TYPES)}")
    if len(types) not in (1, args.num_layers):
        raise UserError(f"--cp-comm-type: {len(types)} types for {args.num_layers} layers "
                        "(one for all, or one per layer)")  # fmt: skip
    if sizes and math.prod(sizes) != cp:
        raise UserError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: "
                        f"their product must be --context-parallel-size {cp}")  # fmt: skip
    if "a2a+p2p" in types and not sizes:
        raise UserError("--hierarchical-context-parallel-sizes must be set when a2a+p2p is used "
                        "in cp comm")  # fmt: skip
    if "a2a+p2p" in types and len(sizes) != 2:
        raise UserError("--cp-comm-type a2a+p2p takes 2 --hierarchical-context-parallel-sizes "
                        "(the all-to-all's, the ring's)")  # fmt: skip
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    for kind, size in (("a2a", cp), ("a2a+p2p", sizes[0] if sizes else 1)):
        if cp > 1 and kind in types and heads % size:
            raise UserError(f"--cp-comm-type {kind}: the {heads} attention heads of a "
                            f"tensor-parallel rank must divide over its all-to-all of {size} "
                            "ranks")  # fmt: skip
