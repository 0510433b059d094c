"""Command-line arguments, with Megatron's flag names, and their validation.

Validation runs before anything heavy (process groups, model, data) and raises `UserError`
with one line naming the problem.
"""

import argparse
import os

from megatron.common.errors import UserError
from megatron.distributed.context_parallel.flags import (
    add_context_parallel_args,
    validate_context_parallel_args,
)
from megatron.distributed.data_parallel import add_data_parallel_args
from megatron.distributed.fsdp_flags import add_fsdp_args, validate_fsdp_args
from megatron.model.dsa import add_dsa_args, validate_dsa_args
from megatron.model.flags import add_model_args, validate_model_args, validate_test_mode
from megatron.model.gated_delta_net import (
    add_gated_delta_net_args,
    validate_gated_delta_net_args,
)
from megatron.model.mla import add_mla_args, validate_mla_and_yarn_args
from megatron.model.moe import (
    add_moe_args,
    add_moe_unsupported_args,
    moe_config_fields,
    validate_moe_args,
)
from megatron.model.mtp import add_mtp_args, validate_mtp_args
from megatron.model.mup import add_mup_args, validate_mup_args
from megatron.model.recompute import add_recompute_args, validate_recompute_args
from megatron.pipeline.schedules import (
    SCHEDULES,
    VIRTUAL_STAGE_SCHEDULES,
    get_schedule,
    virtual_schedule,
)
from megatron.pipeline.schedules.paci import DEFAULT_ARRIVAL_RULE
from megatron.training.batch_schedule import (
    set_step_schedule_iterations,
    validate_accumulation_schedule,
    validate_rampup,
    validate_step_schedule,
)
from megatron.training.config import MoEConfig, ParallelConfig, pipeline_plan
from megatron.training.data.sources import add_data_source_args, validate_sample_options
from megatron.training.megatron_flags import add_compatibility_flags, reject_unsupported_flags
from megatron.training.optimizer.flags import (
    add_optimizer_args,
    add_optimizer_suite_args,
    add_precision_args,
    validate_lr_schedule_source,
    validate_optimizer_suite_args,
    validate_precision_args,
)
from megatron.training.pipeline_flags import (
    add_benchmark_args,
    add_paci_args,
    validate_defer_embedding_wgrad,
    validate_deferred_step,
    validate_emulated_stages,
    validate_emulation_and_rule,
    validate_vocab_parallel,
    validate_weight_stashing,
)
from megatron.training.rerun import add_rerun_args, validate_rerun_args
from megatron.training.tokenizer.tokenizer import add_tiktoken_args
from megatron.training.tracking.wandb_run import add_wandb_args, validate_wandb_args
from megatron.training.validation import add_reliability_args, validate_reliability

TOKENIZER_CHOICES = [
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="GPT pretraining on megatron-core with synchronous and asynchronous "
        "pipeline schedules",
        allow_abbrev=False,
    )
    for add_group in (add_model_args, _add_parallel_args, _add_training_args,
                      add_optimizer_args, _add_data_args, _add_logging_args,
                      _add_checkpoint_args, add_paci_args, add_benchmark_args):  # fmt: skip
        add_group(parser)
    add_optimizer_suite_args(parser)
    add_precision_args(parser)
    add_data_parallel_args(parser)
    add_fsdp_args(parser)
    add_data_source_args(parser)
    add_wandb_args(parser)
    add_recompute_args(parser)
    add_reliability_args(parser)
    add_rerun_args(parser)
    add_mla_args(parser)
    add_gated_delta_net_args(parser)
    add_dsa_args(parser)
    add_mtp_args(parser)
    add_mup_args(parser)
    add_moe_args(parser)
    add_moe_unsupported_args(parser)
    add_compatibility_flags(parser)
    return parser


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("parallelism").add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add_context_parallel_args(add)
    add("--use-tp-pp-dp-mapping", action="store_true",
        help="rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp: a stage's pipeline "
        "neighbours on nearby ranks, its data-parallel replicas far apart")  # fmt: skip
    add("--distributed-backend", default=None, choices=["nccl", "gloo"],
        help="default: nccl when CUDA is available, else gloo")  # fmt: skip
    add("--disable-gloo-process-groups", action="store_true",
        help="megatron-core creates no gloo twin of each process group (nothing here uses them)")  # fmt: skip
    add("--sequence-parallel", action="store_true",
        help="split the sequence over the tensor-parallel ranks outside the tensor-parallel "
        "layers (norms, dropout); stage boundaries carry [s/tp, b, h]")  # fmt: skip
    add("--distributed-timeout-minutes", type=int, default=10)
    add("--rendezvous-timeout-seconds", type=float, default=None,
        help="how long a process waits for the others to join at start-up before it stops "
        "with the count that came (default: --distributed-timeout-minutes)")  # fmt: skip
    add("--cpu-mmap-threshold-kib", type=int, default=128,
        help="CPU runs: glibc's mmap threshold, fixed so that the resident set follows live "
        "memory (real_peak_bytes); 0 keeps glibc's dynamic threshold, faster (fewer page "
        "faults) but the resident set then follows heap fragmentation")  # fmt: skip
    add("--decoder-first-pipeline-num-layers", type=int, default=None,
        help="layers on the first stage (the rest split evenly)")  # fmt: skip
    add("--decoder-last-pipeline-num-layers", type=int, default=None,
        help="layers on the last stage, e.g. fewer to balance the output layer and loss")  # fmt: skip
    add("--account-for-embedding-in-pipeline-split", action="store_true",
        help="count the embedding as a layer when splitting layers over the stages")  # fmt: skip
    add("--account-for-loss-in-pipeline-split", action="store_true",
        help="count the output layer and loss as a layer when splitting")  # fmt: skip
    add("--pipeline-model-parallel-layout", default=None,
        help='the layers of each stage, Megatron\'s string: "Et|(tt|)*2,tL" (E embedding, '
        "t transformer layer, L loss, | between stages, (..)*n repeats)")  # fmt: skip
    add("--pipeline-schedule", default="1f1b",
        help=f"one of: {', '.join(sorted(SCHEDULES))}")  # fmt: skip
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
        help="Megatron's virtual pipeline: layers per model chunk (several chunks per rank; "
        "1f1b then runs interleaved 1F1B)")  # fmt: skip
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
        help="Megatron's virtual pipeline: model chunks per pipeline rank")  # fmt: skip
    add("--enable-vocab-parallel", action="store_true",
        help="split the output layer and the loss by vocabulary over the pipeline ranks, "
        "their passes placed in the schedule (docs/vocab_parallel.md)")  # fmt: skip
    add("--defer-embedding-wgrad-compute", action="store_true",
        help="the last stage's output layer computes its weight gradient at the stage's step "
        "(or the flush), keeping each microbatch's input and output gradient until then: "
        "same numbers, more memory (docs/zero_bubble.md)")  # fmt: skip
    add("--wgrad-deferral-limit", type=int, default=0,
        help="with --defer-embedding-wgrad-compute: defer at most this many microbatches "
        "between drains, the later ones as without the flag (0: all)")  # fmt: skip
    add("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
        help="interleaved 1F1B: microbatches run through each chunk in a row (default: the "
        "pipeline size)")  # fmt: skip


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("batch and run control").add_argument
    add("--micro-batch-size", type=int, required=True)
    add("--global-batch-size", type=int, default=None, help="default: micro x data parallel")
    add("--train-iters", type=int, default=None)
    add("--train-samples", type=int, default=None, help="instead of --train-iters")
    add("--exit-interval", type=int, default=None, help="stop after an iteration divisible by N")
    add("--exit-duration-in-mins", type=float, default=None,
        help="stop (and save) once this many minutes passed since the run started; all ranks "
        "agree on the iteration (under PACI a drain a few iterations later)")  # fmt: skip
    add("--exit-signal-handler", action="store_true",
        help="on SIGTERM, stop at an iteration all ranks agree on, save and exit 0")  # fmt: skip
    add("--rampup-batch-size", nargs="*", default=None, metavar="N",
        help="START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over "
        "SAMPLES samples (needs --train-samples)")  # fmt: skip
    add("--step-batch-size-schedule", nargs="+", default=None, metavar="THRESHOLD:BATCH",
        help="'0:384 200B:768 ...': the global batch from each threshold of consumed tokens on "
        "(K/M/B/T suffixes); sets --global-batch-size to its last batch")  # fmt: skip
    add("--calculate-per-token-loss", action="store_true",
        help="scale the summed loss by the step's token count (over its microbatches and "
        "data-parallel ranks) instead of averaging per microbatch")  # fmt: skip
    add("--skip-train", action="store_true", help="only evaluate")
    add("--seed", type=int, default=1234)
    add("--enable-experimental", action="store_true",
        help="megatron-core's experimental features (its process-wide flag, as Megatron sets it)")  # fmt: skip
    add("--deterministic-mode", action="store_true",
        help="reproducible runs: PACI follows the fixed 1F1B order instead of reacting to "
        "arrivals")  # fmt: skip


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("data").add_argument
    add("--data-path", nargs="*", default=None, help="prefixes, or 'weight prefix ...' pairs")
    add("--split", default="969,30,1")
    add("--mock-data", action="store_true", help="synthetic tokens (megatron-core MockGPTDataset)")
    add("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_CHOICES)
    add("--tokenizer-model", default=None)
    add("--vocab-file", default=None)
    add("--merge-file", default=None)
    add("--vocab-size", type=int, default=None,
        help="NullTokenizer's ids; TikTokenizer's whole vocabulary (default 2**17)")  # fmt: skip
    add_tiktoken_args(parser.add_argument_group("TikTokenizer"))
    add("--data-cache-path", default=None)
    add("--dataloader-type", default=None, choices=("single", "cyclic", "external"),
        help="single (default): one pass in order; cyclic: random order, epoch after epoch")  # fmt: skip
    add("--no-data-sharding", action="store_false", dest="data_sharding",
        help="cyclic: one permutation of the data dealt to all ranks, not a bucket per rank")  # fmt: skip
    _add_fim_args(parser)


def _add_fim_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's fill-in-the-middle flags (names and defaults): data/fim.py."""
    add = parser.add_argument_group("fill-in-the-middle (data/fim.py)").add_argument
    add("--fim-data", action="store_true", help="rearrange samples for fill-in-the-middle")
    add("--fim-rate", type=float, default=0.5, help="the share of samples rearranged")
    add("--fim-spm-rate", type=float, default=0.5,
        help="the share of rearranged samples laid out SPM (the rest PSM)")  # fmt: skip
    add("--fim-split-sample", default=None,
        help="a token between the files of a document: each file rearranged on its own")  # fmt: skip
    add("--fim-fragment-rate", type=float, default=None,
        help="with --fim-split-sample: the share of files rearranged")  # fmt: skip
    add("--fim-no-prefix", default=None, help="leave text that starts with this as it is")
    add("--fim-prefix-token", default="<fim_prefix>")
    add("--fim-middle-token", default="<fim_middle>")
    add("--fim-suffix-token", default="<fim_suffix>")
    add("--fim-pad-token", default="<fim_pad>")
    add("--fim-eod-token", default="<|endoftext|>",
        help="the token between documents (each rearranged on its own)")  # fmt: skip


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("logging").add_argument
    add("--log-interval", type=int, default=100)
    add("--logging-level", type=int, default=None,
        help="the root Python logger's level (10 debug ... 40 error); default: left as it is")  # fmt: skip
    add("--eval-interval", type=int, default=1000)
    add("--eval-iters", type=int, default=100)
    add("--eval-global-batch-size", type=int, default=None,
        help="samples per evaluation iteration (default: --global-batch-size)")  # fmt: skip
    add("--eval-micro-batch-size", type=int, default=None,
        help="evaluation's micro-batch (default: --micro-batch-size)")  # fmt: skip
    add("--tensorboard-dir", default=None)
    add("--log-validation-ppl-to-tensorboard", action="store_true")
    add("--log-params-norm", action="store_true",
        help="1F1B: the model's; PACI: the logging (last) stage's")  # fmt: skip
    add("--log-num-zeros-in-grad", action="store_true",
        help="1F1B: the model's; PACI: the logging (last) stage's")  # fmt: skip
    add("--log-timers-to-tensorboard", action="store_true")
    add("--log-throughput", action="store_true", help="model TFLOP/s per GPU on the iteration line")
    add("--log-memory-to-tensorboard", action="store_true")
    add("--metrics-dir", default=None, help="write summary.json here when the run ends")
    add("--timeline-file", default=None, help="Chrome trace of every stage's actions")


# megatron-core's StrictHandling values (dist_checkpointing.validation)
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                        "raise_all", "return_unexpected", "return_all", "ignore_all")  # fmt: skip


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("checkpoints").add_argument
    add("--save", default=None)
    add("--save-interval", type=int, default=None)
    add("--save-retain-interval", type=int, default=None,
        help="keep only the checkpoints of its multiples, and the newest")  # fmt: skip
    add("--load", default=None)
    add("--ckpt-step", type=int, default=None,
        help="load the checkpoint of this iteration from --load, not the newest one")  # fmt: skip
    add(
        "--ckpt-format",
        default="torch_dist",
        help="torch_dist (Megatron's default: megatron-core's distributed checkpoint, loads into "
        "any TP x PP x DP layout), torch (one file per model-parallel rank, same layout only) "
        "or fsdp_dtensor (a fully sharded model's rows as the ranks hold them, any DP size)",
    )
    add(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="load a checkpoint in whichever format it is (else it must be --ckpt-format's)",
    )
    add(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=DIST_CKPT_STRICTNESS,
        help="torch_dist: what to do with keys the checkpoint and the model do not share",
    )
    add("--verify-integrity", action="store_true",
        help="torch_dist: hash the checkpoint's files on save, check them before load")  # fmt: skip
    add("--no-load-optim", action="store_true")
    add("--no-load-rng", action="store_true")
    add("--no-save-optim", action="store_true")
    add("--no-save-rng", action="store_true")
    add("--finetune", action="store_true",
        help="load the model only and start at iteration 0")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return args


def _validate_moe_with_megatron_core(args) -> None:
    """megatron-core's own rules on the MoE settings (TransformerConfig's checks: top-1
    softmax routing needs pre-softmax, expert bias needs sigmoid scores, padding needs a
    capacity factor, bias with expert tensor parallelism, ...), each as one line. Run here, after the MoE section's own checks: it builds the
    run's typed sections, which the model package does not import."""
    import warnings

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(
                num_layers=args.num_layers,
                hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
                add_bias_linear=not args.disable_bias_linear,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_dtype=torch.float32,
                **moe_config_fields(MoEConfig.from_flags(args), ParallelConfig.from_flags(args)),
            )
    except (AssertionError, ValueError) as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        raise UserError(f"MoE settings: {detail}") from None


def validate_args(args: argparse.Namespace, *, world_size: int, check_files: bool = True) -> None:
    """Fill defaults that depend on other flags and reject inconsistent ones.

    `check_files=False` skips the checks that read the data files (for measuring which command
    lines parse, see tools/megatron_flag_coverage.py)."""
    reject_unsupported_flags(args)
    validate_wandb_args(args)
    validate_reliability(args)
    _validate_parallel_layout(args, world_size)
    validate_moe_args(args, world_size=world_size)
    if args.num_experts is not None:
        _validate_moe_with_megatron_core(args)
    validate_model_args(args)
    _validate_weight_hash_check(args)
    validate_test_mode(args, replicas_order_on_their_own=_replicas_order_on_their_own(args))
    validate_mla_and_yarn_args(args)
    validate_gated_delta_net_args(args)
    validate_dsa_args(args)
    validate_mtp_args(args, placement_v=get_schedule(args.pipeline_schedule).placement is not None)
    validate_recompute_args(args, args.stage_layers)
    validate_mup_args(args)
    validate_rerun_args(args, synchronous=get_schedule(args.pipeline_schedule).flushes_every_call)
    _validate_batch_and_run_length(args)
    if check_files:
        _validate_data_args(args)
    elif args.mock_data and args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise UserError("NullTokenizer needs --vocab-size")
    validate_emulated_stages(args)
    if args.verify_integrity and args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise UserError("--verify-integrity is only supported with --ckpt-format torch_dist "
                        "or fsdp_dtensor")  # fmt: skip
    if args.save_interval is not None and args.save is None:
        raise UserError("--save-interval needs --save DIR")
    retain = args.save_retain_interval
    if retain is not None and (retain < 1 or not args.save_interval or retain % args.save_interval):
        raise UserError(f"--save-retain-interval {retain} must be a positive multiple of "
                        f"--save-interval ({args.save_interval})")  # fmt: skip
    _validate_ckpt_step(args)
    validate_defer_embedding_wgrad(args)
    if args.emulated_forward_ms is not None and (args.save or args.load):
        if args.ckpt_format == "torch_dist":  # its keys come from megatron-core's model
            raise UserError("emulated stages have no megatron-core model: checkpoint them with "
                            "--ckpt-format torch")  # fmt: skip
    validate_sample_options(args)
    # before the optimizer's: Megatron-FSDP turns the distributed one on
    validate_fsdp_args(args, replicas_order_on_their_own=_replicas_order_on_their_own(args))
    validate_optimizer_suite_args(args)
    validate_weight_stashing(args)
    validate_deferred_step(args)
    validate_precision_args(args)
    validate_accumulation_schedule(args)
    validate_lr_schedule_source(args)
    pipeline_plan(args)  # a combination no schedule defines fails here, in one line


def _validate_ckpt_step(args: argparse.Namespace) -> None:
    if args.ckpt_step is None:
        return
    if args.load is None:
        raise UserError("--ckpt-step needs --load DIR")
    if args.ckpt_step < 0:
        raise UserError(f"--ckpt-step must be >= 0, got {args.ckpt_step}")
    if args.load_fallback:
        raise UserError("--ckpt-step names one checkpoint; --load-fallback picks one: pass one")


def _validate_parallel_layout(args: argparse.Namespace, world_size: int) -> None:
    if args.cpu_mmap_threshold_kib < 0:
        raise UserError("--cpu-mmap-threshold-kib must be >= 0 (0: glibc's dynamic threshold)")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise UserError(
            "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--context-parallel-size must be >= 1"
        )
    if world_size % (tp * pp * cp) != 0:
        raise UserError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
            f"size {tp} x {pp} x {cp} = {tp * pp * cp}"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    validate_context_parallel_args(args)
    if args.pipeline_schedule not in SCHEDULES:
        known = ", ".join(sorted(SCHEDULES))
        raise UserError(f"unknown --pipeline-schedule {args.pipeline_schedule!r} (known: {known})")
    _validate_layer_split(args, pp)
    _validate_virtual_pipeline(args, pp)
    validate_vocab_parallel(args)
    tied = not args.untie_embeddings_and_output_weights
    if tied and pp > 1 and not get_schedule(args.pipeline_schedule).flushes_every_call:
        for flag in ("async_sync_warmup_iters", "async_sync_cooldown_iters"):
            if getattr(args, flag, 0):
                raise UserError(
                    f"--{flag.replace('_', '-')} with tied embeddings is not supported yet "
                    "(add --untie-embeddings-and-output-weights)"
                )


def _chunks_from_layers_per_chunk(args: argparse.Namespace, pp: int, per_chunk: int) -> int:
    """--num-layers-per-virtual-pipeline-stage as Megatron reads it: chunks per rank."""
    if args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers:
        raise UserError(
            "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline "
            "parallel degree when enable uneven pipeline parallelism"
        )
    if per_chunk < 1:
        raise UserError("--num-layers-per-virtual-pipeline-stage must be >= 1")
    # Megatron counts the embedding and the loss as layers here when they are accounted
    accounted = (
        args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    )
    per_stage = (args.num_layers + accounted) // pp
    if per_stage % per_chunk:
        raise UserError(
            f"number of layers per pipeline stage ({per_stage}) must be divisible by "
            f"--num-layers-per-virtual-pipeline-stage {per_chunk}"
        )
    return per_stage // per_chunk


def _validate_virtual_pipeline(args: argparse.Namespace, pp: int) -> None:
    """Megatron's rules for the virtual pipeline flags, which set
    `args.virtual_pipeline_model_parallel_size` (None: one model chunk per rank)."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    chunks = args.num_virtual_stages_per_pipeline_rank
    given = [flag for flag, value in (
        ("--num-layers-per-virtual-pipeline-stage", per_chunk),
        ("--num-virtual-stages-per-pipeline-rank", chunks),
        ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout),
    ) if value is not None]  # fmt: skip
    if len(given) > 1:
        raise UserError(f"no more than one of {', '.join(given)} can be set at the same time")
    args.virtual_pipeline_model_parallel_size = args.chunk_layers = None
    if get_schedule(args.pipeline_schedule).placement is not None:
        _validate_v_placement(args, pp, given, chunks, per_chunk)
        return
    if args.pipeline_model_parallel_layout is not None:
        chunks = args.layout_chunks
    elif per_chunk is not None:
        chunks = _chunks_from_layers_per_chunk(args, pp, per_chunk)
    elif chunks is not None and chunks < 1:
        raise UserError("--num-virtual-stages-per-pipeline-rank must be >= 1")
    if chunks is None or chunks == 1:
        return
    if pp < 2:
        raise UserError(
            "When interleaved schedule is used, pipeline-model-parallel size should be greater "
            "than 1"
        )
    for flag, value in (
        ("--rampup-batch-size", args.rampup_batch_size),
        ("--step-batch-size-schedule", args.step_batch_size_schedule),
        ("--async-sync-warmup-iters", getattr(args, "async_sync_warmup_iters", 0)),
        ("--async-sync-cooldown-iters", getattr(args, "async_sync_cooldown_iters", 0)),
        ("--paci-accumulation-schedule", getattr(args, "paci_accumulation_schedule", None)),
    ):  # fmt: skip
        if value:
            raise UserError(f"{flag} with virtual pipeline stages is not supported yet")
    args.chunk_layers = layers_by_chunk(args, pp, chunks)
    args.stage_layers = [sum(layers) for layers in args.chunk_layers]
    name = args.pipeline_schedule
    if name not in VIRTUAL_STAGE_SCHEDULES:
        raise UserError(f"{given[0]} with --pipeline-schedule {name} is not supported yet")
    try:
        options = (args.paci_arrival_rule, args.paci_inflight_limit) if name == "paci" else ()
        virtual_schedule(name, None, *options)
    except ValueError as error:
        raise UserError(f"{error} is not supported yet") from None
    args.virtual_pipeline_model_parallel_size = chunks


def _validate_v_placement(args, pp: int, given: list[str], chunks, per_chunk) -> None:
    """ZB-V and DualPipeV: two model chunks per rank on a V (rank r runs virtual stages r and
    2N - 1 - r), the layers split evenly over the 2N virtual stages."""
    name = args.pipeline_schedule
    if pp < 2:
        raise UserError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2")
    per_stage = args.num_layers // (2 * pp)
    if chunks not in (None, 2) or per_chunk not in (None, per_stage):
        raise UserError(f"--pipeline-schedule {name} runs exactly 2 model chunks per pipeline "
                        f"rank (the V), not what {given[0]} asks for")  # fmt: skip
    for flag, value in (
        ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout),
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers),
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
        ("--rampup-batch-size", args.rampup_batch_size),
        ("--step-batch-size-schedule", args.step_batch_size_schedule),
    ):  # fmt: skip
        if value:
            raise UserError(f"{flag} with --pipeline-schedule {name} is not supported yet")
    if args.num_layers % (2 * pp):
        raise UserError(f"--pipeline-schedule {name}: --num-layers {args.num_layers} must be "
                        f"divisible by 2 x --pipeline-model-parallel-size {pp} (the V's "
                        f"{2 * pp} virtual stages)")  # fmt: skip
    args.virtual_pipeline_model_parallel_size = 2
    args.chunk_layers = [[per_stage, per_stage] for _ in range(pp)]
    args.stage_layers = [2 * per_stage] * pp


def layers_by_chunk(args: argparse.Namespace, pp: int, chunks: int) -> list[list[int]]:
    """Transformer layers of each rank's chunks, as megatron-core assigns them
    (`get_num_layers_to_build` with `vp_stage`); one line where they do not split evenly."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    uneven = (args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers
              or args.pipeline_model_parallel_layout)  # fmt: skip
    accounted = (
        args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    )
    if not uneven and (args.num_layers + accounted) % (pp * chunks):
        counted = f" (+{accounted} for the embedding and loss)" if accounted else ""
        raise UserError(
            f"--num-layers {args.num_layers}{counted} is not divisible by "
            f"--pipeline-model-parallel-size {pp} x {chunks} virtual stages per pipeline rank"
        )
    config = layout_config(args, chunks)
    count = get_num_layers_to_build
    if config.pipeline_model_parallel_layout is not None:  # megatron-core's functions would ask
        # the process groups for the ranks: the layout's table answers for any chunk and rank
        from megatron.core.transformer.enums import LayerType

        def count(config, vp_stage, pp_rank):
            table = config.pipeline_model_parallel_layout.layout  # [pp rank][vp stage]
            return table[pp_rank][vp_stage].count(LayerType.decoder)

    layers = [[count(config, vp_stage=c, pp_rank=r) for c in range(chunks)] for r in range(pp)]
    if sum(map(sum, layers)) != args.num_layers:
        raise UserError(
            f"--num-layers {args.num_layers} does not split over {pp} pipeline ranks x {chunks} "
            f"virtual stages (megatron-core assigns {layers})"
        )
    return layers


def _validate_eval_batch(args: argparse.Namespace) -> None:
    """Evaluation's batch (Megatron's defaults: training's) and its microbatches per
    iteration, `args.eval_num_microbatches`."""
    for name, default in (("eval_micro_batch_size", args.micro_batch_size),
                          ("eval_global_batch_size", args.global_batch_size)):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        setattr(args, name, default if value is None else value)
    per_microbatch = args.eval_micro_batch_size * args.data_parallel_size
    if args.eval_global_batch_size % per_microbatch:
        raise UserError(
            f"--eval-global-batch-size {args.eval_global_batch_size} is not divisible by "
            f"--eval-micro-batch-size x data-parallel size = {args.eval_micro_batch_size} x "
            f"{args.data_parallel_size}"
        )
    if args.eval_micro_batch_size % args.micro_batch_size:  # pieces of training's (evaluate)
        raise UserError(
            f"--eval-micro-batch-size {args.eval_micro_batch_size} other than a multiple of "
            f"--micro-batch-size {args.micro_batch_size} is not supported yet"
        )
    args.eval_num_microbatches = args.eval_global_batch_size // per_microbatch
    pieces = args.eval_num_microbatches * args.eval_micro_batch_size // args.micro_batch_size
    if pieces != args.num_microbatches:
        check_virtual_microbatches(args, pieces, "--eval-global-batch-size")


def check_virtual_microbatches(args: argparse.Namespace, microbatches: int | None = None,
                               batch_flag: str = "--global-batch-size") -> None:  # fmt: skip
    """megatron-core's rule on the microbatches of an interleaved step (`microbatches`,
    default the training step's), as one line."""
    chunks = args.virtual_pipeline_model_parallel_size
    if not chunks:
        return
    pp, group = (
        args.pipeline_model_parallel_size,
        args.microbatch_group_size_per_virtual_pipeline_stage,
    )
    if group is not None and group < 1:
        raise UserError("--microbatch-group-size-per-virtual-pipeline-stage must be >= 1")
    schedule = get_schedule(args.pipeline_schedule)
    if schedule.placement is None:
        schedule = virtual_schedule(args.pipeline_schedule, group)
    try:
        schedule.check_microbatches(pp, chunks, microbatches or args.num_microbatches)
    except ValueError as error:
        batch = getattr(args, batch_flag[2:].replace("-", "_"))
        raise UserError(
            f"{batch_flag} {batch} gives {microbatches or args.num_microbatches} "
            f"microbatches per step: {error}"
        ) from None


def _replicas_order_on_their_own(args: argparse.Namespace) -> bool:
    """Data-parallel replicas under a reactive PACI arrival rule: each orders its forwards,
    backwards and steps by its own arrivals."""
    reactive = args.paci_arrival_rule not in (None, DEFAULT_ARRIVAL_RULE)
    return reactive and not args.deterministic_mode and args.data_parallel_size > 1


def _validate_weight_hash_check(args: argparse.Namespace) -> None:
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is None:
        return
    if interval < 1:
        raise UserError(
            f"--check-weight-hash-across-dp-replicas-interval must be >= 1, got {interval}"
        )
    if _replicas_order_on_their_own(args):
        raise UserError(
            f"--check-weight-hash-across-dp-replicas-interval with --paci-arrival-rule "
            f"{args.paci_arrival_rule} and data parallelism is not supported yet (arrivals "
            "order each replica's steps on their own, so at an iteration's end the replicas "
            "need not have taken the same steps)"
        )


def _validate_batch_and_run_length(args: argparse.Namespace) -> None:
    for flag in ("micro_batch_size", "seq_length", "log_interval", "eval_interval"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    validate_step_schedule(args)  # sets the global batch: the schedule's last
    per_microbatch = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_microbatch
    if args.global_batch_size % per_microbatch != 0:
        raise UserError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
            f"{args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_microbatch
    check_virtual_microbatches(args)
    _validate_eval_batch(args)
    _validate_run_length(args)
    validate_rampup(args)
    set_step_schedule_iterations(args)
    if args.exit_interval is not None and args.exit_interval < 1:
        raise UserError("--exit-interval must be >= 1")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise UserError("--exit-duration-in-mins must be >= 0 (0: no limit, as Megatron)")


def _validate_run_length(args: argparse.Namespace) -> None:
    """--train-iters or --train-samples; a sample-based run takes its LR schedule in samples."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise UserError("pass exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise UserError(
                "with --train-samples use --lr-decay-samples / --lr-warmup-samples, not iterations"
            )
        args.train_iters = args.train_samples // args.global_batch_size
    elif args.lr_decay_samples is not None or args.lr_warmup_samples:
        raise UserError("--lr-decay-samples / --lr-warmup-samples need --train-samples")
    # a ramp counts its own iterations, and so does a step schedule by samples
    counts_own = args.rampup_batch_size is not None or (
        args.step_batch_size_schedule is not None and args.train_samples is not None
    )
    if args.train_iters < 1 and not counts_own:
        raise UserError("--train-iters must be >= 1 (or --train-samples >= --global-batch-size)")
    validate_emulation_and_rule(args)


def _validate_layer_split(args: argparse.Namespace, pp: int) -> None:
    """Megatron's rules for how layers go onto stages, then the per-stage counts from
    megatron-core's own functions (`args.stage_layers`, which the model and the simulator use)."""
    uneven = {
        "--decoder-first-pipeline-num-layers": args.decoder_first_pipeline_num_layers,
        "--decoder-last-pipeline-num-layers": args.decoder_last_pipeline_num_layers,
    }
    given = {flag: n for flag, n in uneven.items() if n is not None}
    accounted = [
        flag
        for flag, on in (
            ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
            ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
        )
        if on
    ]  # fmt: skip
    if args.pipeline_model_parallel_layout is not None:
        others = list(given) + accounted
        if others:
            raise UserError(
                f"--pipeline-model-parallel-layout cannot be set with other pipeline layout "
                f"arguments: {', '.join(others)}"
            )
        args.layout_chunks = _validate_layout_stages(args.pipeline_model_parallel_layout, pp)
        if args.layout_chunks > 1:  # the interleaved pipeline: its chunks' layers come later
            return
    elif given and accounted:
        raise UserError(
            f"{' and '.join(accounted)} cannot be set at the same time as {' and '.join(given)}"
        )
    elif given:
        _validate_uneven_split(args, pp, given)
    else:
        layers = args.num_layers + len(accounted)
        if layers % pp != 0:
            counted = f" (+{len(accounted)} for {' and '.join(accounted)})" if accounted else ""
            raise UserError(
                f"--num-layers {args.num_layers}{counted} is not divisible by "
                f"--pipeline-model-parallel-size {pp}"
            )
    args.stage_layers = layers_by_stage(args)


def _validate_layout_stages(layout: str, pp: int) -> int:
    """Megatron's first check of a layout string: its stages fill the pipeline ranks, the same
    number on each (more than one: the interleaved pipeline's virtual stages). Returns that
    number, the model chunks per rank."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
    except (AssertionError, ValueError, KeyError) as error:
        raise UserError(f"--pipeline-model-parallel-layout {layout!r}: {error}") from None
    if stages % pp != 0:
        raise UserError(
            f"--pipeline-model-parallel-layout {layout!r}: the length of the layout ({stages} "
            f"stages) must be divisible by --pipeline-model-parallel-size {pp}"
        )
    return stages // pp


def _validate_uneven_split(args: argparse.Namespace, pp: int, given: dict) -> None:
    if pp < 2:
        raise UserError(f"{' and '.join(given)} need a pipeline of at least 2 stages")
    for flag, layers in given.items():
        if layers < 1:
            raise UserError(f"{flag} must be >= 1")
    rest, middle = args.num_layers - sum(given.values()), pp - len(given)
    if rest < middle or (middle and rest % middle) or (not middle and rest):
        raise UserError(
            f"--num-layers {args.num_layers} minus {sum(given.values())} on uneven stages leaves "
            f"{rest}, which does not split evenly over the other {middle} stages"
        )


def layers_by_stage(args: argparse.Namespace) -> list[int]:
    """Transformer layers on each pipeline stage, as megatron-core assigns them: its
    `get_num_layers_to_build` (even, first/last counts, embedding or loss counted as a layer)
    or its `PipelineParallelLayerLayout` (after the checks above)."""
    pp = args.pipeline_model_parallel_size
    split_flags = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                   args.pipeline_model_parallel_layout)  # fmt: skip
    if all(flag is None for flag in split_flags) and not (
        args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    ):  # the even split, without importing megatron-core before a bad flag's one line
        return [args.num_layers // pp] * pp
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = layout_config(args)
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return [layout.get_num_layers_to_build(LayerType.decoder, pp_rank=s) for s in range(pp)]
    return [get_num_layers_to_build(config, pp_rank=s) for s in range(pp)]


def layout_config(args: argparse.Namespace, chunks: int | None = None):
    """The layer-split settings as a megatron-core TransformerConfig, which checks a layout
    string by megatron-core's own rules (one line each); `chunks`: model chunks per rank."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        return TransformerConfig(
            num_layers=args.num_layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            pipeline_dtype=torch.float32,  # required with pipelining; unused by the split
            num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
            account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
            pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
            virtual_pipeline_model_parallel_size=chunks,
            mtp_num_layers=getattr(args, "mtp_num_layers", None) or None,  # a layout's m
        )
    except (AssertionError, ValueError, KeyError) as error:
        layout = args.pipeline_model_parallel_layout
        what = f"--pipeline-model-parallel-layout {layout!r}" if layout else "the layer split"
        detail = " ".join(str(error).split()) or type(error).__name__
        raise UserError(f"{what}: {detail}") from None


def _validate_data_args(args: argparse.Namespace) -> None:
    if args.mock_data:
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            raise UserError("NullTokenizer needs --vocab-size")
        return
    from megatron.training.data.sources import validate_data_source

    validate_data_source(args)
