"""Megatron's MoE and expert-parallel flags: parsing (megatron-core's defaults), the checks
that stop a bad setting with one line before anything starts, and the TransformerConfig
fields they become."""

from __future__ import annotations

import ast


def moe_layer_pattern(freq, num_layers: int) -> list[bool]:
    """Megatron's --moe-layer-freq: an int k (every k-th layer, from layer 0, is MoE) or a
    list of 0/1 per layer; True where the layer is MoE."""
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    pattern = [bool(x) for x in freq]
    if len(pattern) != num_layers:
        raise ValueError(
            f"--moe-layer-freq lists {len(pattern)} layers, the model has {num_layers}"
        )
    return pattern


def layer_pattern_parser(flag: str, example: str):
    """Megatron's parser of a per-layer pattern flag (--moe-layer-freq, --linear-attention-freq):
    an int, or a Python list expression of 0/1 such as "([1]*3+[0]*1)*2", evaluated safely."""

    def parse(text):
        if isinstance(text, int):
            return text
        text = str(text).strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            value = _evaluate_list_expression(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, TypeError):
            value = None
        if not isinstance(value, list) or not all(v in (0, 1) for v in value):
            import argparse

            raise argparse.ArgumentTypeError(
                f"invalid {flag} {text!r}: an int or a list of 0/1 such as {example}"
            )
        return value

    return parse


parse_moe_layer_freq = layer_pattern_parser("--moe-layer-freq", "[1,0,1,0]")


def _evaluate_list_expression(node):
    """Integers, lists, + and * only (no names, no calls)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_list_expression(node.left), _evaluate_list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list expression")


# ---------------------------------------------------------------------------- flags
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("allgather", "alltoall")  # "flex" (DeepEP / HybridEP) needs CUDA


def add_moe_args(parser) -> None:
    """Megatron's MoE and expert-parallel flags, with megatron-core's defaults."""
    import argparse

    add = parser.add_argument_group("mixture of experts").add_argument
    add("--num-experts", type=int, default=None, help="experts per MoE layer (None: no MoE)")
    add("--expert-model-parallel-size", type=int, default=1,
        help="expert parallelism: the experts of a layer split over this many ranks")  # fmt: skip
    add("--expert-tensor-parallel-size", type=int, default=None,
        help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)")  # fmt: skip
    add("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
        help='every N-th layer is MoE, or a list such as "([1]*3+[0]*1)*2"')  # fmt: skip
    add("--moe-ffn-hidden-size", type=int, default=None,
        help="each expert's hidden size (default: --ffn-hidden-size)")  # fmt: skip
    add("--moe-shared-expert-intermediate-size", type=int, default=None,
        help="hidden size of the shared experts, all of them together (None: none)")  # fmt: skip
    add("--moe-shared-expert-gate", action="store_true",
        help="a sigmoid gate on the shared experts' output")  # fmt: skip
    add("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
        choices=LOAD_BALANCING_TYPES + ("quantile_balancing",))  # fmt: skip
    add("--moe-router-topk", type=int, default=2)
    add("--moe-router-score-function", default="softmax", choices=("softmax", "sigmoid"))
    add("--moe-router-pre-softmax", action="store_true",
        help="softmax before the top-k (else after it)")  # fmt: skip
    add("--moe-router-num-groups", type=int, default=None,
        help="group-limited routing: experts in this many groups")  # fmt: skip
    add("--moe-router-group-topk", type=int, default=None,
        help="group-limited routing: tokens go to experts of this many groups")  # fmt: skip
    add("--moe-router-topk-scaling-factor", type=float, default=None)
    add("--moe-router-dtype", default=None, choices=("fp32", "fp64"),
        help="the router's computation dtype (default: the model's)")  # fmt: skip
    add("--moe-router-enable-expert-bias", action="store_true",
        help="aux-loss-free balancing: a per-expert bias on the routing scores, updated at "
        "every step from the tokens each expert received")  # fmt: skip
    add("--moe-router-bias-update-rate", type=float, default=1e-3)
    add("--moe-router-force-load-balancing", action="store_true",
        help="route by random scores (benchmarks)")  # fmt: skip
    add("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    add("--moe-z-loss-coeff", type=float, default=None)
    add("--moe-input-jitter-eps", type=float, default=None)
    add("--moe-token-dispatcher-type", default="allgather",
        choices=DISPATCHERS + ("flex",))  # fmt: skip
    add("--moe-expert-capacity-factor", type=float, default=None,
        help="drop tokens beyond capacity factor x the even share of each expert")  # fmt: skip
    add("--moe-pad-expert-input-to-capacity", action="store_true")
    add("--moe-token-drop-policy", default="probs", choices=("probs", "position"))
    add("--moe-grouped-gemm", action="store_true",
        help="grouped expert GEMMs where the machine has them (CUDA with Transformer Engine); "
        "elsewhere SequentialMLP, the same math and the same checkpoint keys")  # fmt: skip
    add("--moe-apply-probs-on-input", action="store_true")
    # speed only: the fused kernels compute what the unfused code does (docs/megatron_flags.md)
    add("--moe-permute-fusion", action="store_true", help=argparse.SUPPRESS)
    # speed only: Megatron overlaps one microbatch's expert all-to-alls with another's compute
    # on CUDA streams; here they run in turn, the same numbers (docs/megatron_flags.md)
    add("--overlap-moe-expert-parallel-comm", action="store_true", help=argparse.SUPPRESS)
    add("--moe-router-fusion", action="store_true", help=argparse.SUPPRESS)


# Parsed so that a Megatron command line reads completely; any use fails in one line.
MOE_NOT_SUPPORTED = (
    ("--moe-enable-deepep", "GPU-only: DeepEP"),
    ("--moe-shared-expert-overlap", "GPU-only: overlaps on CUDA streams"),
    ("--moe-use-legacy-grouped-gemm", "GPU-only: grouped-GEMM kernels"),
    ("--moe-use-upcycling", "dense-to-MoE checkpoint conversion"),
    ("--moe-per-layer-logging", "per-layer MoE logging"),
    ("--moe-layer-recompute", "MoE recomputation"),
    ("--moe-router-padding-for-fp8", "GPU-only: FP8"),
    ("--moe-router-padding-for-quantization", "GPU-only: FP8"),
    ("--moe-enable-routing-replay", "routing replay"),
)
MOE_VALUE_NOT_SUPPORTED = (
    ("--moe-router-topk-limited-devices", int),
    ("--moe-flex-dispatcher-backend", str),
    ("--moe-deepep-num-sms", int),
    ("--moe-upcycling-granularity", int),
    ("--moe-latent-size", int),
)


MOE_GPU_ONLY_VALUES = {
    "--moe-flex-dispatcher-backend": "the flex dispatcher's DeepEP and HybridEP kernels",
    "--moe-deepep-num-sms": "DeepEP",
}


def add_moe_unsupported_args(parser) -> None:
    import argparse

    add = parser.add_argument_group("MoE: not supported yet").add_argument
    for flag, _ in MOE_NOT_SUPPORTED:
        add(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in MOE_VALUE_NOT_SUPPORTED:
        add(flag, type=kind, default=None, help=argparse.SUPPRESS)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def validate_moe_args(args, *, world_size: int) -> None:
    """One line for each bad MoE / expert-parallel setting, before anything starts."""
    from megatron.common.errors import UserError

    for flag, why in MOE_NOT_SUPPORTED:
        if getattr(args, _dest(flag), False):
            raise UserError(f"{flag} is not supported yet ({why})")
    for flag, _ in MOE_VALUE_NOT_SUPPORTED:
        if getattr(args, _dest(flag), None) is not None:
            why = MOE_GPU_ONLY_VALUES.get(flag)
            raise UserError(f"{flag} is not supported yet" + (f" (GPU-only: {why})" if why else ""))
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep < 1 or etp < 1:
        raise UserError(
            "--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1"
        )
    if args.num_experts is None:
        if ep > 1:
            raise UserError("--expert-model-parallel-size > 1 needs --num-experts")
        _refuse_moe_flags_without_experts(args)
        return
    _validate_expert_layout(args, world_size)
    _validate_router(args)
    if not args.disable_bias_linear:
        # megatron-core 0.16.1's SequentialMLP adds the expert's fc2 bias in place into the
        # output of its tensor-parallel reduction, which autograd refuses at ETP=1 (and its
        # config refuses bias at ETP>1)
        raise UserError("MoE with linear biases is not supported yet: add --disable-bias-linear")
    _validate_expert_parallel_overlap(args)
    try:
        pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    except ValueError as error:
        raise UserError(str(error)) from None
    if not any(pattern):
        raise UserError("--moe-layer-freq puts no MoE layer in the model")
    _validate_with_the_rest_of_the_run(args)


def _validate_expert_layout(args, world_size: int) -> None:
    """The experts' parallel sizes against the world and the dense layout."""
    from megatron.common.errors import UserError

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp, experts = (
        args.expert_model_parallel_size,
        args.expert_tensor_parallel_size,
        args.num_experts,
    )
    if experts < 1:
        raise UserError("--num-experts must be >= 1")
    if experts % ep:
        raise UserError(
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}"
        )
    if world_size % (pp * etp * ep):
        raise UserError(
            f"world size {world_size} is not divisible by pipeline x expert tensor x expert "
            f"parallel size {pp} x {etp} x {ep} = {pp * etp * ep}"
        )
    expert_data_parallel = world_size // (pp * etp * ep)
    if getattr(args, "use_tp_pp_dp_mapping", False) and pp > 1:
        if expert_data_parallel != args.data_parallel_size:  # megatron-core asserts it
            raise UserError(
                f"--use-tp-pp-dp-mapping with MoE needs the experts' data-parallel size "
                f"({expert_data_parallel}) to equal the data-parallel size "
                f"({args.data_parallel_size}); drop the flag or change the expert sizes"
            )
    instances = args.num_distributed_optimizer_instances
    if expert_data_parallel % instances:  # megatron-core asserts it
        raise UserError(
            f"--num-distributed-optimizer-instances {instances} must divide the experts' "
            f"data-parallel size {expert_data_parallel}"
        )
    if tp > 1 and not args.sequence_parallel:  # megatron-core's MoELayer refuses it
        raise UserError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron)"
        )


def _validate_router(args) -> None:
    """Top-k, the token dispatcher, the balancing losses and group-limited routing."""
    from megatron.common.errors import UserError

    experts = args.num_experts
    if not 1 <= args.moe_router_topk <= experts:
        raise UserError(
            f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
            f"{experts}"
        )
    if args.moe_token_dispatcher_type == "flex":
        raise UserError(
            "--moe-token-dispatcher-type flex is not supported yet (DeepEP / HybridEP need "
            "CUDA): use allgather or alltoall"
        )
    types = _as_list(args.moe_router_load_balancing_type)
    if "quantile_balancing" in types:
        raise UserError("--moe-router-load-balancing-type quantile_balancing is not supported yet")
    coeffs = _as_list(args.moe_aux_loss_coeff)
    if len(types) > 1 and len(coeffs) != len(types):
        raise UserError(
            f"--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type "
            f"({len(types)}), got {len(coeffs)}"
        )
    if "sinkhorn" in types and (len(types) > 1 or any(coeffs)):  # megatron-core's router
        raise UserError(
            "--moe-router-load-balancing-type sinkhorn takes no aux loss: pass it alone, with "
            "--moe-aux-loss-coeff 0"
        )
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise UserError("--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is not None:
        if groups < 1 or experts % groups or not 1 <= group_topk <= groups:
            raise UserError(
                f"--moe-router-num-groups {groups} must divide --num-experts {experts} and "
                f"--moe-router-group-topk {group_topk} be between 1 and it"
            )


def _validate_with_the_rest_of_the_run(args) -> None:
    """Checkpoint format, the distributed optimizer and emulated compute with experts."""
    from megatron.common.errors import UserError

    apart = args.expert_model_parallel_size > 1 or (
        args.expert_tensor_parallel_size != args.tensor_model_parallel_size
    )
    if apart and args.ckpt_format == "torch" and (args.save or args.load):
        # one file per (pipeline, tensor) rank, written by its first data-parallel rank: the
        # other data-parallel ranks' experts would be lost
        raise UserError(
            "--ckpt-format torch with expert parallelism is not supported yet (torch_dist, the "
            "default, is)"
        )
    if args.emulated_forward_ms is not None:
        raise UserError("--emulated-forward-ms with MoE (--num-experts) is not supported yet")


def _validate_expert_parallel_overlap(args) -> None:
    """--overlap-moe-expert-parallel-comm: accepted where Megatron accepts it (megatron-core's
    TransformerConfig asserts, one line each); what runs is the same without the overlap."""
    from megatron.common.errors import UserError

    if not args.overlap_moe_expert_parallel_comm:
        return
    recompute_modules = getattr(args, "recompute_modules", None) or ()
    rules = (
        ("needs --expert-model-parallel-size > 1", args.expert_model_parallel_size > 1),
        ("needs --moe-token-dispatcher-type alltoall", args.moe_token_dispatcher_type == "alltoall"),
        ("needs --bf16 or --fp16", args.bf16 or args.fp16),
        ("with --pipeline-model-parallel-size > 1 needs virtual pipeline stages",
         args.pipeline_model_parallel_size == 1
         or (args.virtual_pipeline_model_parallel_size or 1) > 1),
        ("excludes full recomputation (--recompute-granularity full, --recompute-method, "
         "--recompute-num-layers, moe in --recompute-modules)",
         args.recompute_granularity != "full" and args.recompute_method is None
         and getattr(args, "recompute_num_layers", None) is None
         and "moe" not in recompute_modules),
        ("supports at most one --mtp-num-layers", (getattr(args, "mtp_num_layers", None) or 0) <= 1),
    )  # fmt: skip
    for rule, holds in rules:
        if not holds:
            raise UserError(f"--overlap-moe-expert-parallel-comm {rule} (as in Megatron)")


# flags that mean something only with --num-experts, at their defaults
_MOE_DEFAULTS = {
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_router_enable_expert_bias": False,
    "moe_grouped_gemm": False,
    "moe_expert_capacity_factor": None,
    "moe_z_loss_coeff": None,
}


def _refuse_moe_flags_without_experts(args) -> None:
    from megatron.common.errors import UserError

    for dest, default in _MOE_DEFAULTS.items():
        if getattr(args, dest) != default:
            raise UserError(f"--{dest.replace('_', '-')} needs --num-experts")


def moe_config_fields(moe, parallel, *, grouped_gemm_available: bool = False) -> dict:
    """The TransformerConfig fields of the run's `MoEConfig` and `ParallelConfig` (empty for a
    dense model, `moe` None)."""
    if moe is None:
        return {}
    types = _as_list(moe.moe_router_load_balancing_type)
    coeffs = _as_list(moe.moe_aux_loss_coeff)
    return dict(
        num_moe_experts=moe.num_experts,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        moe_layer_freq=moe.moe_layer_freq,
        moe_ffn_hidden_size=moe.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=moe.moe_shared_expert_gate,
        moe_router_load_balancing_type=types[0] if len(types) == 1 else types,
        moe_aux_loss_coeff=coeffs[0] if len(coeffs) == 1 else coeffs,
        moe_z_loss_coeff=moe.moe_z_loss_coeff,
        moe_router_topk=moe.moe_router_topk,
        moe_router_score_function=moe.moe_router_score_function,
        moe_router_pre_softmax=moe.moe_router_pre_softmax,
        moe_router_num_groups=moe.moe_router_num_groups,
        moe_router_group_topk=moe.moe_router_group_topk,
        moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
        moe_router_dtype=moe.moe_router_dtype,
        moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
        moe_router_force_load_balancing=moe.moe_router_force_load_balancing,
        moe_input_jitter_eps=moe.moe_input_jitter_eps,
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=moe.moe_token_drop_policy,
        moe_grouped_gemm=moe.moe_grouped_gemm and grouped_gemm_available,
        moe_apply_probs_on_input=moe.moe_apply_probs_on_input,
        # the fused kernels are Transformer Engine's; the unfused code computes the same
        moe_permute_fusion=moe.moe_permute_fusion and grouped_gemm_available,
        moe_router_fusion=moe.moe_router_fusion and grouped_gemm_available,
    )
