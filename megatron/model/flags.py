"""The model's flags, with Megatron's names and defaults: position embeddings (RoPE and its
variants; YaRN's in mla.py), the shape (layers, hidden and FFN sizes, heads, query groups,
sequence length), norms, activations, dropout, bias, tied embeddings, the fused cross entropy
and megatron-core's realtime test (--test-mode), with their checks. build.py's `model_switches`
reads them (from the run's `ModelConfig`).

Two flags of the "model" group are checked where they are used: the training loop's
--check-weight-hash-across-dp-replicas-interval in training/loop_flags.py, --bf16 with the other
precision flags in training/optimizer/flags.py."""

import argparse
import math

from megatron.common.errors import UserError
from megatron.model.mla import add_yarn_args


def _add_position_embedding_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("position embeddings").add_argument
    add("--position-embedding-type", default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "none"])  # fmt: skip
    add("--rotary-percent", type=float, default=1.0)
    add("--rotary-base", type=int, default=10000)
    add("--rotary-interleaved", action="store_true")
    add("--use-rotary-position-embeddings", action="store_true",
        help="Megatron's older spelling of --position-embedding-type rope")  # fmt: skip
    add("--no-position-embedding", action="store_false", dest="add_position_embedding",
        help="deprecated in Megatron: refused unless --position-embedding-type rope")  # fmt: skip
    add("--use-rope-scaling", action="store_true",
        help="Llama 3.1's RoPE frequency scaling (megatron-core's rotary embedding)")  # fmt: skip
    add("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    add("--rotary-seq-len-interpolation-factor", type=int, default=None,
        help="RoPE positions divided by this factor (linear sequence-length interpolation)")  # fmt: skip
    add_yarn_args(parser)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    _add_position_embedding_args(parser)
    add = parser.add_argument_group("model").add_argument
    add("--num-layers", type=int, required=True)
    add("--hidden-size", type=int, required=True)
    add("--ffn-hidden-size", type=int, default=None,
        help="default: 4 x hidden size (with --swiglu: 8/3 x hidden size, as Megatron)")  # fmt: skip
    add("--num-attention-heads", type=int, required=True)
    add("--group-query-attention", action="store_true")
    add(
        "--num-query-groups",
        type=int,
        default=1,
        help="key/value heads with --group-query-attention",
    )
    add("--kv-channels", type=int, default=None, help="head dim; default hidden / heads")
    add("--seq-length", type=int, required=True)
    add("--max-position-embeddings", type=int, default=None, help="default: seq length")
    add("--init-method-std", type=float, default=0.02)
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add("--openai-gelu", action="store_true",
        help="OpenAI's tanh approximation of GeLU as the MLP activation")  # fmt: skip
    add("--init-method-xavier-uniform", action="store_true",
        help="Xavier-uniform weights (of the full, unsharded matrix) instead of normal(std)")  # fmt: skip
    add("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    add("--norm-epsilon", type=float, default=1e-5)
    add("--apply-layernorm-1p", action="store_true",
        help="zero-centered norm weight (stores gamma - 1)")  # fmt: skip
    add("--qk-layernorm", action="store_true")
    add("--cross-entropy-loss-fusion", action="store_true",
        help="megatron-core's fused vocab-parallel cross entropy (its logit gradient is bf16)")  # fmt: skip
    add("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    add("--test-mode", action="store_true",
        help="megatron-core's realtime check: q/k layernorm weights equal on every TP and DP "
        "rank, at every attention forward")  # fmt: skip
    add("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
        help="every N iterations (and at the start), check that the data-parallel replicas "
        "of each stage hold bit-identical weights")  # fmt: skip
    add("--apply-residual-connection-post-layernorm", action="store_true")
    add("--swiglu", action="store_true")
    add("--squared-relu", action="store_true")
    add("--disable-bias-linear", action="store_true")
    add("--add-qkv-bias", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true",
        help="separate input embedding and output layer weights (default: tied, as Megatron)")  # fmt: skip
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--bf16", action="store_true",
        help="bf16 parameters and activations, fp32 main weights and gradient accumulation")  # fmt: skip


def validate_model_args(args: argparse.Namespace) -> None:
    """The model's shape (with Megatron's defaults filled in), its position embeddings and
    activation, and the fused cross entropy."""
    _validate_model_shape(args)
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        raise UserError(  # Megatron refuses it the same way
            "--cross-entropy-fusion-impl te is disabled (Transformer Engine's fused cross entropy "
            "had stability issues): use --cross-entropy-fusion-impl native"
        )


def _validate_model_shape(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    if args.kv_channels is None and args.hidden_size % heads != 0:
        raise UserError("--hidden-size must be divisible by --num-attention-heads")
    if heads % tp != 0:
        raise UserError("--num-attention-heads must be divisible by --tensor-model-parallel-size")
    if getattr(args, "sequence_parallel", False) and tp > 1 and args.seq_length % tp != 0:
        raise UserError(
            f"--sequence-parallel: --seq-length {args.seq_length} must be divisible by "
            f"--tensor-model-parallel-size {tp} (each rank holds s / tp of the sequence)"
        )
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups < 1 or heads % groups != 0 or groups % tp != 0:
            raise UserError(
                "--num-query-groups must divide --num-attention-heads and be divisible by "
                "--tensor-model-parallel-size"
            )
    else:
        args.num_query_groups = None  # megatron-core: one key/value head per query head
    if args.ffn_hidden_size is None:
        # Megatron's default: 4h, or 8h/3 rounded down to a multiple of 64 with SwiGLU
        four_h = 4 * args.hidden_size
        args.ffn_hidden_size = int(four_h * 2 / 3 / 64) * 64 if args.swiglu else four_h
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // heads
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise UserError("--seq-length exceeds --max-position-embeddings")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise UserError("--rotary-percent must be in (0, 1]")
    _validate_position_and_activation(args)


def _validate_position_and_activation(args: argparse.Namespace) -> None:
    """Megatron's legacy position-embedding spellings and the RoPE variants, which need RoPE
    (Megatron would ignore them without it); the activation switches exclude each other."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise UserError("--no-position-embedding is deprecated, use --position-embedding-type")
    for flag, given in (("--use-rope-scaling", args.use_rope_scaling),
                        ("--rotary-seq-len-interpolation-factor",
                         args.rotary_seq_len_interpolation_factor is not None)):  # fmt: skip
        if given and args.position_embedding_type != "rope":
            raise UserError(f"{flag} needs --position-embedding-type rope")
    if args.rotary_seq_len_interpolation_factor is not None:
        if args.rotary_seq_len_interpolation_factor < 1:
            raise UserError("--rotary-seq-len-interpolation-factor must be >= 1")
    if not (math.isfinite(args.rope_scaling_factor) and args.rope_scaling_factor > 0):
        raise UserError(f"--rope-scaling-factor must be > 0, got {args.rope_scaling_factor}")
    chosen = [flag for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                    ("--openai-gelu", args.openai_gelu)) if on]  # fmt: skip
    if len(chosen) > 1:
        raise UserError(f"{' and '.join(chosen)} exclude each other")


def validate_test_mode(args: argparse.Namespace, *, replicas_order_on_their_own: bool) -> None:
    """megatron-core's realtime test (--test-mode); `replicas_order_on_their_own`: the
    data-parallel replicas order their passes by their own arrivals (a reactive PACI rule)."""
    if not (args.test_mode and args.qk_layernorm):
        return  # megatron-core's realtime test only checks the q/k layernorms
    if args.normalization != "LayerNorm":
        raise UserError("--test-mode compares the q/k layernorm biases: it needs LayerNorm")
    if replicas_order_on_their_own:
        raise UserError(
            f"--test-mode with --paci-arrival-rule {args.paci_arrival_rule} and data parallelism "
            "is not supported yet (its check gathers over the data-parallel group at every "
            "forward, in an order that arrivals decide on each replica)"
        )
