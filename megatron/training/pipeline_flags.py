"""The pipeline schedules' flags besides the layer layout (training/layout_flags.py): PACI's
(--paci-*) and the emulated stages of the schedule benchmarks (--emulated-*), with the checks of
what a schedule runs with: its per-stage values, weight stashing, PACI's deferred step, the
vocabulary-parallel output layer and the deferred embedding weight gradient (those two flags
are parsed with the parallelism group). megatron/pipeline takes no `args`: it reads them from
the run's `PipelinePlan` and `PipelineConfig`."""

import argparse

from megatron.common.errors import UserError
from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.paci import (
    ARRIVAL_RULES,
    DEFAULT_ARRIVAL_RULE,
    DEFAULT_INFLIGHT_LIMIT,
    INFLIGHT_LIMITS,
)
from megatron.pipeline.schedules.vocab_passes import cannot_take
from megatron.pipeline.simulation.costs import stage_values
from megatron.training.config import check_vocabulary_split, pipeline_plan
from megatron.training.optimizer.flags import validate_stage_lr_scale


def add_paci_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("PACI (--pipeline-schedule paci)").add_argument
    add("--paci-arrival-rule", default=None, choices=list(ARRIVAL_RULES),
        help=f"what a PACI stage runs first when it may (default {DEFAULT_ARRIVAL_RULE})")  # fmt: skip
    add("--paci-inflight-limit", default=None, choices=list(INFLIGHT_LIMITS),
        help="most microbatches a PACI stage s holds: depth = N - s (default), flush = "
        "min(N - s, microbatches per step), flush's activation memory also when there are fewer "
        "microbatches per step than stages")  # fmt: skip
    add("--paci-accumulation-schedule", default=None, metavar="A:ITERS[,A:ITERS...]",
        help="PACI's accumulation factor a by phase: a = A for the next ITERS iterations, "
        "phase after phase, then the a of --global-batch-size; the global batch of an "
        "iteration is a x micro batch x data parallel; the pipeline drains at each change")  # fmt: skip
    add("--paci-stage-lr-scale", type=float, default=None, metavar="C",
        help="PACI: multiply pipeline stage s's LR (max and min, every param group) by "
        "1 / (1 + C (N - 1 - s) / a), N stages, a microbatches per step: (N - 1 - s) / a is the "
        "mean number of steps its gradients are stale; the last stage keeps its LR")  # fmt: skip
    add("--paci-deferred-step", type=int, nargs="?", const=0, default=None, metavar="D",
        help="PACI: a stage goes on with its next passes while the data-parallel reduction of "
        "its step is in flight, and applies the update just before its D-th backward after the "
        "step (1 <= D <= a; without D, a: its next step's last backward); the reduction hides "
        "behind those passes, the gradients are up to one step staler (drift bound "
        "ceil((N - s) / a)), one extra copy of the gradients")  # fmt: skip
    add("--paci-weight-stashing", action="store_true",
        help="PACI (a study variant): each backward runs on the weights its forward used, as "
        "PipeDream stashes them; PACI's order and gradient staleness, without the forward/"
        "backward weight mismatch, at up to ceil((N - 1 - s) / a) extra weight copies on "
        "stage s")  # fmt: skip


def add_benchmark_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("benchmarking").add_argument
    add("--emulated-forward-ms", type=stage_values, default=None,
        help="replace each stage's forward by a wait of this many ms, or a comma list with one "
        "value per stage (schedule benchmarks)")  # fmt: skip
    add("--emulated-backward-ms", type=stage_values, default=None)
    add("--emulated-weight-grad-ms", type=stage_values, default=None,
        help="the part of each emulated backward that computes the weight gradient, which a "
        "split-backward schedule (zb-h1, zb-v, dualpipe-v) runs apart; ms, or one per stage")  # fmt: skip
    add("--emulated-vocab-forward-ms", type=stage_values, default=0.0,
        help="with --enable-vocab-parallel: each rank's emulated VF pass (its output shard's "
        "logits), ms, or one per pipeline rank")  # fmt: skip
    add("--emulated-vocab-backward-ms", type=stage_values, default=0.0,
        help="with --enable-vocab-parallel: each rank's emulated VB pass (its shard's weight "
        "gradient), ms, or one per pipeline rank")  # fmt: skip
    add("--emulated-link-gbs", type=float, default=None, metavar="B",
        help="emulate a link of B GB/s per rank: each rank's point-to-point sends to other "
        "ranks wait, one after another, latency + bytes / B before they start (a pacing on "
        "top of the backend's own transfer; docs/vocab_parallel_pace.md)")  # fmt: skip
    add("--emulated-link-latency-us", type=float, default=0.0, metavar="L",
        help="with --emulated-link-gbs: each message's latency on the emulated link, us")  # fmt: skip
    add("--emulated-link-unpaced-embedding", action="store_true",
        help="with --emulated-link-gbs: the input embedding's messages (with "
        "--enable-vocab-parallel) bypass the emulated link")  # fmt: skip
    add("--emulated-noise-cv", type=stage_values, default=0.0,
        help="lognormal noise on each emulated action: CV, or one per stage (seeded by --seed)")  # fmt: skip
    add("--emulated-param-count", type=int, default=None, metavar="N",
        help="give each emulated stage (each model chunk) N more parameters, in 8 tensors, whose "
        "gradients (ones) its backward produces over its course and the optimizer steps: a "
        "data-parallel reduction of 4N bytes (fp32) per stage and step, in buckets as a real "
        "model's (communication benchmarks)")  # fmt: skip


FAN_ARITY = "fan"  # --vocab-parallel-tree-arity's spelling of arity N - 1
DEFAULT_TREE_ARITY = 2


def tree_arity_of(value: str | int | None, pipeline_size: int) -> int:
    """--vocab-parallel-tree-arity as the children per rank (`VocabLinks.tree_arity`): an
    integer >= 1, or `fan` (N - 1: every rank the last stage's child). UserError otherwise."""
    if value is None:
        return DEFAULT_TREE_ARITY
    if value == FAN_ARITY:
        return max(pipeline_size - 1, 1)
    try:
        arity = int(value)
    except (TypeError, ValueError):
        arity = 0
    if arity < 1:
        raise UserError(f"--vocab-parallel-tree-arity must be an integer >= 1 or {FAN_ARITY}, "
                        f"got {value!r}")  # fmt: skip
    return arity


def validate_vocab_parallel(args: argparse.Namespace) -> None:
    """--enable-vocab-parallel: what the split output layer and input embedding run with so
    far; --vocab-parallel-tree-arity resolved to its number of children per rank."""
    arity = getattr(args, "vocab_parallel_tree_arity", None)
    if arity not in (None, DEFAULT_TREE_ARITY) and not args.enable_vocab_parallel:
        raise UserError("--vocab-parallel-tree-arity needs --enable-vocab-parallel")
    args.vocab_parallel_tree_arity = tree_arity_of(arity, args.pipeline_model_parallel_size)
    if not args.enable_vocab_parallel:
        return
    schedule = pipeline_plan(args, vocab_passes=False).schedule
    problem = cannot_take(schedule)
    unsupported = [
        (not args.untie_embeddings_and_output_weights and schedule.stashes_weights,
         f"with tied embeddings and --pipeline-schedule {args.pipeline_schedule}",
         "a weight-stashing schedule keeps the input embedding whole on the first stage: add "
         "--untie-embeddings-and-output-weights"),
        (problem is not None, f"with --pipeline-schedule {args.pipeline_schedule}", problem),
        (args.context_parallel_size > 1, "with --context-parallel-size > 1", None),
        (bool(getattr(args, "mtp_num_layers", None)), "with --mtp-num-layers", None),
        (args.deterministic_mode and not get_schedule(args.pipeline_schedule).flushes_every_call,
         "with --deterministic-mode and an asynchronous schedule",
         "a shard's weight version depends on when the hidden state arrives"),
    ]  # fmt: skip
    for failed, what, why in unsupported:
        if failed:
            raise UserError(
                f"--enable-vocab-parallel {what} is not supported yet"
                + (f" ({why})" if why else "")
            )
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size:  # known before any process
        vocab = args.vocab_size + 1  # and the end-of-document id
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        shards = args.pipeline_model_parallel_size * args.tensor_model_parallel_size
        check_vocabulary_split(-(-vocab // multiple) * multiple, shards)


def validate_defer_embedding_wgrad(args: argparse.Namespace) -> None:
    """As megatron-core refuses them (its gradient-accumulation-fusion requirement is its
    fused CUDA kernel's, not the deferral's: ours uses a plain product)."""
    if not args.defer_embedding_wgrad_compute:
        return  # megatron-core reads --wgrad-deferral-limit only with the flag
    if args.wgrad_deferral_limit < 0:
        raise UserError("--wgrad-deferral-limit must be >= 0 (0: defer every microbatch)")
    if args.pipeline_model_parallel_size == 1:
        raise UserError("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1")
    if args.enable_vocab_parallel:
        raise UserError("--defer-embedding-wgrad-compute with --enable-vocab-parallel is not "
                        "supported yet (the output layer is split over the stages)")  # fmt: skip
    if args.emulated_forward_ms is not None:
        raise UserError("--defer-embedding-wgrad-compute needs the model's output layer, not "
                        "emulated compute")  # fmt: skip


def validate_emulated_stages(args: argparse.Namespace) -> None:
    """--emulated-*: waits (and parameters) in place of the model's compute."""
    if (args.emulated_forward_ms is None) != (args.emulated_backward_ms is None):
        raise UserError("--emulated-forward-ms and --emulated-backward-ms go together")
    if args.emulated_weight_grad_ms is not None and args.emulated_backward_ms is None:
        raise UserError("--emulated-weight-grad-ms is part of --emulated-backward-ms: give both")
    if args.calculate_per_token_loss and args.emulated_forward_ms is not None:
        raise UserError("--calculate-per-token-loss needs the model's loss, not emulated compute")
    _validate_emulated_param_count(args)
    _validate_emulated_link(args)


def _validate_emulated_link(args: argparse.Namespace) -> None:
    bandwidth = getattr(args, "emulated_link_gbs", None)
    latency = getattr(args, "emulated_link_latency_us", 0.0)
    if bandwidth is None:
        if latency or getattr(args, "emulated_link_unpaced_embedding", False):
            raise UserError("--emulated-link-latency-us and --emulated-link-unpaced-embedding "
                            "need --emulated-link-gbs")  # fmt: skip
        return
    if not bandwidth > 0 or not latency >= 0:
        raise UserError(f"--emulated-link-gbs must be > 0 and --emulated-link-latency-us >= 0, "
                        f"got {bandwidth} and {latency}")  # fmt: skip


def _validate_emulated_param_count(args: argparse.Namespace) -> None:
    count = args.emulated_param_count
    if count is None:
        return
    if count < 1:
        raise UserError(f"--emulated-param-count must be >= 1, got {count}")
    if args.emulated_forward_ms is None:
        raise UserError("--emulated-param-count gives emulated stages parameters: it needs "
                        "--emulated-forward-ms and --emulated-backward-ms")  # fmt: skip


def validate_emulation_and_rule(args: argparse.Namespace) -> None:
    pp = args.pipeline_model_parallel_size
    for flag, value, default in (
        ("--paci-arrival-rule", args.paci_arrival_rule, DEFAULT_ARRIVAL_RULE),
        ("--paci-inflight-limit", args.paci_inflight_limit, DEFAULT_INFLIGHT_LIMIT),
    ):
        if value not in (None, default) and args.pipeline_schedule != "paci":
            raise UserError(f"{flag} applies to --pipeline-schedule paci only")
    validate_stage_lr_scale(args)
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    for flag in ("emulated_forward_ms", "emulated_backward_ms", "emulated_weight_grad_ms",
                 "emulated_noise_cv", "emulated_vocab_forward_ms",
                 "emulated_vocab_backward_ms"):  # fmt: skip
        if isinstance(getattr(args, flag), list) and len(getattr(args, flag)) != pp * chunks:
            each = f"virtual stage ({pp * chunks})" if chunks > 1 else f"pipeline stage ({pp})"
            raise UserError(f"--{flag.replace('_', '-')}: one value, or one per {each}")


def _stashes_weights(args: argparse.Namespace) -> bool:
    """2bw, pipedream, and paci with --paci-weight-stashing keep old weight versions."""
    if getattr(args, "paci_weight_stashing", False):
        if args.pipeline_schedule != "paci":
            raise UserError("--paci-weight-stashing applies to --pipeline-schedule paci only")
        if (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
            raise UserError("--paci-weight-stashing with virtual pipeline stages is not "
                            "supported yet")  # fmt: skip
        return True
    return get_schedule(args.pipeline_schedule).stashes_weights


def validate_weight_stashing(args: argparse.Namespace) -> None:
    """2bw, pipedream and PACI with stashing: what stashed weight versions do not support yet."""
    if not _stashes_weights(args):
        return
    schedule = pipeline_plan(args).schedule
    name, pp = args.pipeline_schedule, args.pipeline_model_parallel_size
    least = schedule.min_microbatches_per_step(pp)
    if args.num_microbatches < least:
        deeper = ", one more with --enable-vocab-parallel" if schedule.vocab_passes else ""
        raise UserError(
            f"--pipeline-schedule {name} on {pp} stages needs at least {least} microbatches per "
            f"step (pipeline size - 1{deeper}, so that two weight versions suffice), got "
            f"{args.num_microbatches}"
        )
    unsupported = {
        "async_sync_warmup_iters": "switching to and from 1f1b",
        "async_sync_cooldown_iters": "switching to and from 1f1b",
        "save": "checkpointing the stashed weight versions",
        "load": "checkpointing the stashed weight versions",
    }
    for flag, missing in unsupported.items():
        if getattr(args, flag):
            raise UserError(
                f"--{flag.replace('_', '-')} is not supported yet with --pipeline-schedule "
                f"{name} ({missing} is not implemented)"
            )


def validate_deferred_step(args: argparse.Namespace) -> None:
    """--paci-deferred-step: PACI only; what it does not support yet. At data-parallel size 1
    there is nothing to overlap, but the update still lands late (the semantics a study of
    it needs; the start-up line says so)."""
    if args.paci_deferred_step is None:
        return
    if args.pipeline_schedule != "paci":
        raise UserError("--paci-deferred-step needs --pipeline-schedule paci")
    a = args.num_microbatches
    if args.paci_deferred_step == 0:  # the bare flag: the whole next step
        args.paci_deferred_step = a
    if not 1 <= args.paci_deferred_step <= a:
        raise UserError(f"--paci-deferred-step D needs 1 <= D <= {a} (microbatches per step), "
                        f"got {args.paci_deferred_step}")  # fmt: skip
    unsupported = [
        (not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1,
         "tied embeddings over several stages (add --untie-embeddings-and-output-weights)"),
        (args.use_distributed_optimizer, "--use-distributed-optimizer"),
        (args.use_torch_fsdp2 or args.use_megatron_fsdp, "FSDP"),
        (args.num_experts is not None, "MoE"),
        (args.virtual_pipeline_model_parallel_size is not None, "virtual stages"),
        (args.enable_vocab_parallel, "--enable-vocab-parallel"),
        (args.calculate_per_token_loss, "--calculate-per-token-loss"),
        (args.paci_weight_stashing, "--paci-weight-stashing"),
        (bool(args.paci_accumulation_schedule), "--paci-accumulation-schedule"),
        (args.async_sync_warmup_iters or args.async_sync_cooldown_iters,
         "synchronous warm-up or cool-down phases"),
    ]  # fmt: skip
    for refused, what in unsupported:
        if refused:
            raise UserError(f"--paci-deferred-step with {what} is not supported yet")
