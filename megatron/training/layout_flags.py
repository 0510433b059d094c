"""The parallelism flags and the pipeline's layer layout: tensor, pipeline and context-parallel
sizes, the process groups' options, how the layers split over the pipeline stages (evenly, first
and last stage counts, the embedding or the loss counted as a layer, Megatron's layout string)
and the virtual pipeline stages, checked by Megatron's and megatron-core's rules.
`layers_by_stage` and `layers_by_chunk` give the transformer layers of each stage and model
chunk (`args.stage_layers`, `args.chunk_layers`), which the model and the simulator use.
megatron/pipeline takes no `args`: it gets the layout from the run's `ParallelConfig`."""

import argparse

from megatron.common.errors import UserError
from megatron.distributed.context_parallel.flags import (
    add_context_parallel_args,
    validate_context_parallel_args,
)
from megatron.pipeline.schedules import (
    CHUNKS_FROM_FLAGS,
    SCHEDULES,
    VIRTUAL_STAGE_SCHEDULES,
    get_schedule,
    virtual_schedule,
)
from megatron.training.pipeline_flags import validate_vocab_parallel


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
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
    add("--vocab-parallel-tree-arity", default=None, metavar="K|fan",
        help="with --enable-vocab-parallel: children per rank of the tree the output layer's "
        "messages travel on, rooted at the last stage (default 2, the binary tree; 1 a chain; "
        "fan: every rank the last stage's child, arity N - 1)")  # fmt: skip
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


def validate_parallel_layout(args: argparse.Namespace, world_size: int) -> None:
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
    name = args.pipeline_schedule
    own_chunks = name in CHUNKS_FROM_FLAGS  # its own placement, v from the flags
    if get_schedule(name).placement is not None and not own_chunks:
        _validate_v_placement(args, pp, given, chunks, per_chunk)
        return
    chunks = _chunks_of_flags(args, pp, chunks, per_chunk)
    if own_chunks:
        chunks = _check_own_chunks(args, pp, given, chunks)
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
    if not own_chunks:
        _check_virtual_schedule(args, given)
    args.virtual_pipeline_model_parallel_size = chunks


def _check_virtual_schedule(args: argparse.Namespace, given: list[str]) -> None:
    """The --pipeline-schedule has a variant over virtual stages (1F1B, PACI) with its options."""
    name = args.pipeline_schedule
    if name not in VIRTUAL_STAGE_SCHEDULES:
        raise UserError(f"{given[0]} with --pipeline-schedule {name} is not supported yet")
    try:
        options = (args.paci_arrival_rule, args.paci_inflight_limit) if name == "paci" else ()
        virtual_schedule(name, None, *options)
    except ValueError as error:
        raise UserError(f"{error} is not supported yet") from None


def _chunks_of_flags(args: argparse.Namespace, pp: int, chunks, per_chunk) -> int | None:
    """Model chunks per rank the virtual-pipeline flags ask for (None: none given)."""
    if args.pipeline_model_parallel_layout is not None:
        return args.layout_chunks
    if per_chunk is not None:
        return _chunks_from_layers_per_chunk(args, pp, per_chunk)
    if chunks is not None and chunks < 1:
        raise UserError("--num-virtual-stages-per-pipeline-rank must be >= 1")
    return chunks


def _check_own_chunks(args: argparse.Namespace, pp: int, given: list[str], chunks) -> int:
    """A schedule with its own placement and v from the flags (zb-interleaved): its default v
    without them, at least 2, and no microbatch group (its rounds follow from m and N)."""
    name = args.pipeline_schedule
    if pp < 2:
        raise UserError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2")
    if chunks is None:
        chunks = get_schedule(name).default_chunks_per_rank
    if chunks < 2:
        raise UserError(f"--pipeline-schedule {name} needs at least 2 model chunks per pipeline "
                        f"rank, not the {chunks} that {given[0]} gives")  # fmt: skip
    if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
        raise UserError(f"--microbatch-group-size-per-virtual-pipeline-stage with "
                        f"--pipeline-schedule {name} is not supported (its rounds are "
                        f"max(1, m // N) equal groups)")  # fmt: skip
    return chunks


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

        def count_in_layout(config, vp_stage, pp_rank):
            table = config.pipeline_model_parallel_layout.layout  # [pp rank][vp stage]
            return table[pp_rank][vp_stage].count(LayerType.decoder)

        count = count_in_layout

    layers = [[count(config, vp_stage=c, pp_rank=r) for c in range(chunks)] for r in range(pp)]
    if sum(map(sum, layers)) != args.num_layers:
        raise UserError(
            f"--num-layers {args.num_layers} does not split over {pp} pipeline ranks x {chunks} "
            f"virtual stages (megatron-core assigns {layers})"
        )
    return layers


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
