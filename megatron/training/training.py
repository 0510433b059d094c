"""The pretraining loop: set-up, iterations, evaluation, logging, metrics, checkpoints.

`pretrain(config, forward_step_func)` is what `pretrain_gpt.py` calls. The loop is the same for
every schedule; the schedule function (from `get_forward_backward_func`) steps each stage's
optimizer itself when a step is due.
"""

import contextlib
import datetime
import gc
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.config import set_experimental_flag

from megatron.common.errors import RunFailed, UserError
from megatron.distributed import fsdp
from megatron.distributed.data_parallel import named_reduction, resolve_bucket_size
from megatron.distributed.gloo_device import shared_gloo_device
from megatron.model.build import build_stage_model, shard_stage_model
from megatron.model.dsa import (
    IndexerLossLog,
    set_indexer_loss_scale,
    uses_sparse_attention,
)
from megatron.model.gated_delta_net import GDN_VARIANT
from megatron.model.gpt import run_sequence_parallel_on_host
from megatron.model.moe import (
    MoELoadStats,
    MoEStepHooks,
    experts_apart_from_dense,
    routing_buffers,
    set_aux_loss_scale,
)
from megatron.model.mtp import MTPLossLog, set_mtp_loss_scale
from megatron.pipeline.audit import (
    CollectiveAudit,
    audit_requested,
    record_cross_stage_collectives,
)
from megatron.pipeline.forward_backward import (
    attach_stage_runtime,
    forward_backward_func_for,
    get_forward_backward_func,
)
from megatron.pipeline.p2p import PacedLink
from megatron.pipeline.parallel import (
    build_lane_links,
    build_pipeline_context,
    build_vocab_links,
    ranks_of_my_stage,
)
from megatron.pipeline.runtime import RankRuntime, plain_links
from megatron.pipeline.transport import DistributedTransport
from megatron.training import divergence, faults, launch, run_control
from megatron.training.batch_schedule import (
    BatchSchedule,
    accumulation_phase_ends,
    lr_in_samples,
    total_train_samples,
)
from megatron.training.checkpointing import save_load as checkpointing
from megatron.training.checkpointing.writer_lock import WriterLock, describe, new_run_id
from megatron.training.config import RunConfig
from megatron.training.data.datasets import data_iterators_of_run, microbatch_pieces
from megatron.training.data.fim import FimSettings, resolve_token_ids
from megatron.training.data.sources import prefixes_of
from megatron.training.divergence import check_replicas_match
from megatron.training.host_memory import unmap_large_blocks_when_freed
from megatron.training.optimizer.build import (
    ExpertGroups,
    StageOptimizerStep,
    StepReport,
    attach_reduction,
    build_lr_scheduler,
    build_optimizer,
    logged_learning_rate,
    stage_lr_scale,
)
from megatron.training.optimizer.delay_lookahead import for_stage
from megatron.training.optimizer.delay_mitigation import (
    plan_of_iteration,
    set_synchronous_phase,
    synchronous_phase_ends,
)
from megatron.training.optimizer.lr_per_iteration import per_iteration
from megatron.training.optimizer.tied_embeddings import (
    ProcessGroupChannel,
    TiedEmbeddingExchange,
    lag_bound,
)
from megatron.training.reporting import (
    holds_the_loss,
    is_logging_rank,
    is_stage_leader,
    log_iteration,
    print_rank_0,
    print_rank_last,
    tensorboard_writer,
    write_summary,
    write_timelines,
)
from megatron.training.rerun import Phase, ReplayableIterator, ResultValidation
from megatron.training.tokenizer.tokenizer import build_tokenizer_of_run
from megatron.training.validation import check_token_ids

# ---------------------------------------------------------------------------- set-up
# Megatron's rank orders: the default, and --use-tp-pp-dp-mapping's
RANK_ORDERS = {False: "tp-cp-ep-dp-pp", True: "tp-cp-ep-pp-dp"}


def initialize_distributed(config) -> torch.device:
    """Process groups (torch.distributed + megatron-core's parallel_state) and the device."""
    layout, seed = config.parallel, config.training.seed
    backend = layout.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    with shared_gloo_device():
        _initialize_process_groups(config, backend)
    torch.manual_seed(seed)
    moe = config.moe is not None
    gdn = config.model.experimental_attention_variant == GDN_VARIANT  # its init forks the tracker
    if (
        layout.sequence_parallel or moe or gdn
    ) and device.type == "cpu":  # megatron-core's CUDA parts
        run_sequence_parallel_on_host(
            seed, parallel_state.get_tensor_model_parallel_rank(), moe=moe
        )
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return device


def _initialize_process_groups(config, backend: str) -> None:
    """torch.distributed's world (unless the caller made it) and megatron-core's groups."""
    layout = config.parallel
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=layout.distributed_timeout_minutes)
        startup_s = layout.rendezvous_timeout_seconds
        startup_s = timeout.total_seconds() if startup_s is None else startup_s
        launch.init_process_group(backend, timeout, startup_s)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        hierarchical_context_parallel_sizes=(
            list(layout.hierarchical_context_parallel_sizes)
            if layout.hierarchical_context_parallel_sizes and layout.context_parallel_size > 1
            else None
        ),
        distributed_timeout_minutes=layout.distributed_timeout_minutes,
        num_distributed_optimizer_instances=layout.num_distributed_optimizer_instances,
        # expert groups only where there are experts (without, the sizes change nothing)
        **(
            dict(
                expert_model_parallel_size=layout.expert_model_parallel_size,
                expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
            )
            if config.moe is not None
            else {}
        ),
        # megatron-core's extra gloo groups serve only its own distributed optimizer
        create_gloo_process_groups=not layout.disable_gloo_process_groups,
        order=RANK_ORDERS[layout.use_tp_pp_dp_mapping],
    )


# ---------------------------------------------------------------------------- state
@dataclass
class TrainingState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0  # evaluations read on from here, also after a resume
    losses: list = field(default_factory=list)  # lm loss per iteration (last stage)
    validation: list = field(default_factory=list)
    tokens: int = 0
    train_time_s: float = 0.0
    cross_stage_collectives: int | None = None  # counted when MEGATRON_AUDIT_COLLECTIVES=1
    nan_iterations: int = 0  # iterations whose loss was not finite (last stage)
    logged_counts: tuple = (0, 0)  # (skipped steps, nan iterations) at the last log line
    rollbacks: list = field(default_factory=list)  # {"iteration", "to"} per rollback
    fit_to_save: bool = True  # as agreed at the last drain point
    diverged: str | None = None  # why the run ended diverged
    global_batch_size: int = 0  # of the last iteration (a ramp or step schedule changes it)
    exit_reason: str | None = None  # why training stopped before --train-iters
    weight_hash_checks: list = field(default_factory=list)  # iterations whose check passed
    validation_exit: tuple | None = None  # (exit code, why): --rerun-mode validate_results


def build_step(config, model, optimizer, scheduler) -> "MegatronStep":
    """The stage's optimizer step. The gradient norm's reach: the whole model under 1F1B-flush
    (as Megatron), the stage's tensor-parallel ranks under PACI (no global synchronization)."""
    step_func = StageOptimizerStep(
        model,
        optimizer,
        # PipeDream steps m times per iteration
        per_iteration(scheduler, config.pipeline.plan, config.training.num_microbatches),
        # context-parallel ranks hold the same weights and each a part of every sequence's
        # gradient: the step averages over data x context parallel ranks, as Megatron's DDP
        data_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        grad_norm_group=(
            parallel_state.get_model_parallel_group()
            if config.pipeline.plan.global_grad_norm
            else parallel_state.get_tensor_model_parallel_group()
        ),
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        clip_grad=config.training.clip_grad,
        average_in_collective=config.parallel.ddp_average_in_collective,
        tensor_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        experts=_expert_groups(config),
    )
    return MegatronStep(step_func, model, config)


def _bucket_the_reduction(config, model, step: "MegatronStep") -> None:
    """--overlap-grad-reduce, --ddp-bucket-size, --ddp-num-buckets: the stage's data-parallel
    reduction in buckets (distributed/data_parallel.py); without them one blocking reduction
    at the step, as always."""
    layout = config.parallel
    deferred = config.pipeline.paci_deferred_step
    if not (layout.overlap_grad_reduce or layout.ddp_bucket_size or layout.ddp_num_buckets):
        if not deferred:
            return
    if layout.fully_sharded:
        return  # FSDP reduce-scatters each unit's gradients in its backward (fsdp.py)
    params = step.step_func.params
    bucket_size = resolve_bucket_size(
        overlap=layout.overlap_grad_reduce,
        bucket_size=layout.ddp_bucket_size,
        num_buckets=layout.ddp_num_buckets,
        num_parameters=sum(p.numel() for p in params),
        data_parallel_size=layout.data_parallel_size * layout.context_parallel_size,
    )
    chunks = getattr(model, "chunks", [model])
    chunk_index = {id(p): c for c, chunk in enumerate(chunks) for p in chunk.parameters()}
    gather_params = config.optimizer.overlap_param_gather  # the optimizer's gathers in them
    problem = attach_reduction(
        step.step_func,
        bucket_size=bucket_size,
        overlap=layout.overlap_grad_reduce,
        late=_changed_before_the_reduction(config, model, params),
        chunk_of=lambda param: chunk_index.get(id(param), 0),
        force=deferred,
        gather_params=gather_params,
    )
    if problem is not None:
        gathered = " (and its parameters gather in it)" if gather_params else ""
        print_rank_0(f"> --overlap-grad-reduce / buckets: not used on this stage ({problem}); "
                     f"its gradients reduce as one at the step{gathered}")  # fmt: skip
        return
    reduction = step.step_func.reduction
    if reduction is not None and is_stage_leader():
        late = sum(bucket.late for bucket in reduction.buckets)
        gathered = ", parameters gathered in the same buckets under the forward"
        print(f"> stage {parallel_state.get_pipeline_model_parallel_rank()}: data-parallel "
              f"reduction in {len(reduction.buckets)} bucket(s) ({late} at the step), "
              f"{'overlapped with the backward' if reduction.overlaps else 'at the step'}"
              f"{gathered if step.step_func.param_gather is not None else ''}",
              flush=True)  # fmt: skip


def _changed_before_the_reduction(config, model, params) -> list:
    """Parameters whose gradient changes between the backward and the data-parallel reduction
    (reduced at the step, after the change): the tied embedding's copies (summed or exchanged
    between the first and last stage), the vocabulary split's rows (their gradients come from
    vocabulary passes), a deferred output-layer gradient, and with a per-token loss all of
    them (the step divides by the step's token count first)."""
    if config.model.calculate_per_token_loss:
        return list(params)
    late = [p for p in params if getattr(p, "shared_embedding", False)]
    for chunk in getattr(model, "chunks", [model]):
        for name in ("output_shard", "input_shard"):
            shard = getattr(chunk, name, None)
            if isinstance(shard, torch.nn.Module):
                late += list(shard.parameters())
        if config.pipeline.defer_embedding_wgrad_compute:
            layer = getattr(chunk, "output_layer", None)
            if isinstance(layer, torch.nn.Module):
                late += list(layer.parameters())
    return late


def _expert_shard_group(config):
    """The expert-data-parallel group, when the distributed optimizer shards the routed
    experts over it apart from the dense parameters (MoE with EP > 1 or ETP != TP)."""
    if config.moe is None or not config.parallel.use_distributed_optimizer:
        return None
    layout = config.parallel
    if (layout.expert_model_parallel_size, layout.expert_tensor_parallel_size) == (
        1, layout.tensor_model_parallel_size,
    ):  # fmt: skip
        return None  # the expert groups are the dense ones
    return parallel_state.get_expert_data_parallel_group()


def _expert_groups(config) -> ExpertGroups | None:
    """megatron-core's expert process groups, for the routed experts' gradients (None
    without MoE)."""
    if config.moe is None:
        return None
    global_norm = config.pipeline.plan.global_grad_norm
    return ExpertGroups(
        data_parallel_group=parallel_state.get_expert_data_parallel_group(),
        grad_norm_group=(
            parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            if global_norm
            else parallel_state.get_expert_tensor_and_model_parallel_group()
        ),
        data_parallel_size=config.parallel.data_parallel_size,
    )


def _note_inflight_window(config) -> None:
    """PACI's window is N - s whatever the microbatches per step; with fewer than the stages,
    that is more than flush holds, so more activation memory: say so, and how to cap it."""
    n, m = config.parallel.pipeline_model_parallel_size, config.training.num_microbatches
    window = config.pipeline.plan.schedule.inflight_window
    if window is None or m >= n:  # (over virtual stages PACI holds at most interleaved flush's)
        return
    windows = " ".join(str(window(s, n, m)) for s in range(n))
    flush = " ".join(str(min(m, n - s)) for s in range(n))
    if windows != " ".join(str(n - s) for s in range(n)):  # capped by --paci-inflight-limit
        print_rank_0(f"> PACI in-flight limit flush: at most {windows} microbatches per stage")
        return
    print_rank_0(
        f"> note: {m} microbatches per step < {n} stages: PACI holds up to {windows} "
        f"microbatches in flight per stage, flush at most {flush} (more activation memory); "
        "--paci-inflight-limit flush keeps flush's"
    )


def drift_bound_note(config) -> str | None:
    """PACI with fewer microbatches per step than N - 1 lets the first stages' gradients grow
    more than one step stale; on the deep study model on 8 stages a = 8 instead of 4 (the same
    global batch) closed what 8 stages cost over 4 (docs/convergence_deep.md)."""
    plan, pipeline = config.pipeline.plan, config.pipeline
    drift_bound = plan.schedule.drift_bound  # PACI's; None for the stashing and flush schedules
    if drift_bound is None or plan.chunks_per_rank > 1 or pipeline.paci_deferred_step:
        return None  # (the deferred step prints its own bound)
    n, a = plan.num_stages, config.training.num_microbatches
    bounds = [drift_bound(s, n, a) for s in range(n)]
    if max(bounds) <= 1:
        return None
    return (f"> note: PACI on {n} stages at a = {a} microbatches per step: drift bound by stage "
            f"{' '.join(map(str, bounds))}; a >= {n - 1} (the same global batch at a smaller "
            "--micro-batch-size) keeps every stage within one step")  # fmt: skip


def _note_deferred_step(config) -> None:
    """--paci-deferred-step: the drift bound it implies, per stage (paci.py derives it)."""
    if not config.pipeline.paci_deferred_step:
        return
    from megatron.pipeline.schedules.paci import deferred_step_drift_bound, drift_bound

    n, a = config.parallel.pipeline_model_parallel_size, config.training.num_microbatches
    limit = config.pipeline.paci_inflight_limit or "depth"
    bounds = " ".join(str(deferred_step_drift_bound(s, n, a, limit)) for s in range(n))
    plain = " ".join(str(drift_bound(s, n, a, limit)) for s in range(n))
    d = config.pipeline.paci_deferred_step
    print_rank_0(f"> --paci-deferred-step {d}: each update lands before the stage's backward {d} "
                 f"of {a} after its step; drift bound by stage {bounds} (plain PACI {plain})")  # fmt: skip
    if config.parallel.data_parallel_size * config.parallel.context_parallel_size == 1:
        print_rank_0("> --paci-deferred-step at data-parallel size 1: no reduction to overlap; "
                     "the updates still land late")  # fmt: skip


def pretrain(args, forward_step_func) -> TrainingState:
    """Train with the validated flags `args`: the one place the run's typed configuration
    (`RunConfig`) is built from them; everything below reads the configuration."""
    wall_start = time.perf_counter()
    config = RunConfig.from_args(args)
    set_logging_level(config.logging.logging_level)
    set_experimental_flag(config.training.enable_experimental)  # process-wide, as Megatron's
    # Installed first, so that a SIGTERM during set-up is caught too (--exit-signal-handler).
    requests = None
    if run_control.requested(config.training):
        requests = run_control.StopRequests(config.training, wall_start)
    try:
        with faults.stop_on_interrupt():
            return _pretrain(config, forward_step_func, wall_start, requests)
    finally:
        if requests is not None:
            requests.release()


def set_logging_level(level: int | None) -> None:
    """--logging-level, else the MEGATRON_LOGGING_LEVEL environment variable, as Megatron: the
    root logger's level (Python's numbers: 10 debug ... 40 error); unset leaves it alone."""
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        try:
            level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
        except ValueError:
            raise UserError("MEGATRON_LOGGING_LEVEL must be an integer logging level") from None
    if level is not None:
        logging.getLogger().setLevel(level)


def _pretrain(config, forward_step_func, wall_start, requests) -> TrainingState:
    faults.watch_launcher()
    groups_before = _process_groups()
    device = initialize_distributed(config)
    run_id, save_lock = _take_save_directory(config.checkpoint)
    config = config.with_run_id(run_id)
    try:
        state = _set_up_and_train(config, forward_step_func, wall_start, requests, device,
                                  save_lock)  # fmt: skip
    finally:
        if save_lock is not None:
            save_lock.release()
    _destroy_groups_since(groups_before)  # once the run's model and runtime are gone
    return state


def _take_save_directory(checkpoint) -> tuple[str, WriterLock | None]:
    """Rank 0 holds `--save` for the run (checkpointing/writer_lock.py); every rank learns the
    run's id, and a refusal ends every rank with the same one line. (run id, the lock)."""
    lock, outcome = None, [None, None]  # (run id, problem)
    if dist.get_rank() == 0:
        run_id = new_run_id()
        outcome = [run_id, None]
        if checkpoint.save:
            lock = WriterLock(checkpoint.save, run_id)
            try:
                lock.acquire()
            except UserError as error:
                lock, outcome = None, [run_id, str(error)]
            if lock is not None and lock.taken_over:
                owner = describe(lock.taken_over)
                print(f"> --save {checkpoint.save}: the lock of {owner} was left by a run that "
                      "is no longer running: taken over", flush=True)  # fmt: skip
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise UserError(outcome[1])
    return outcome[0], lock


def _context_parallel(layout) -> str:
    """The context-parallel size for the start-up line, with its communication type(s) where
    they are not the default ring: `4 (a2a+p2p, 2 x 2)`, `2 (p2p all_gather a2a p2p)`."""
    size, types = layout.context_parallel_size, tuple(layout.cp_comm_type)
    if size == 1 or types == ("p2p",):
        return str(size)
    sizes = layout.hierarchical_context_parallel_sizes
    hierarchical = f", {' x '.join(map(str, sizes))}" if "a2a+p2p" in types and sizes else ""
    return f"{size} ({' '.join(types)}{hierarchical})"


def _set_up_and_train(config, forward_step_func, wall_start, requests, device,
                      save_lock) -> TrainingState:  # fmt: skip
    # the resident set follows live memory (host_memory.py)
    unmap_large_blocks_when_freed(device, config.parallel.cpu_mmap_threshold_kib)
    _print_layout(config)
    _note_inflight_window(config)
    if (note := drift_bound_note(config)) is not None:
        print_rank_0(note)
    _note_deferred_step(config)
    tokenizer, config = _build_checked_tokenizer(config)
    model = shard_stage_model(config, build_stage_model(config, device))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    optimizer = build_optimizer(
        model, for_stage(config.optimizer, config.pipeline, config.training, stage),
        expert_group=_expert_shard_group(config),
    )  # fmt: skip
    scheduler = build_lr_scheduler(
        optimizer, config.lr, lr_scale=stage_lr_scale(config.pipeline, config.training, stage)
    )
    step_func = build_step(config, model, optimizer, scheduler)
    if config.logging.timeline_file is not None:  # the reductions on the timeline too
        step_func.reduction_times.events = []
    _bucket_the_reduction(config, model, step_func)
    state = TrainingState()
    if config.checkpoint.load:
        state.iteration, state.consumed_train_samples, state.consumed_valid_samples = (
            checkpointing.load(
                config.checkpoint.load,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                config=config,
            )
        )
    runtime = _build_stage_runtime(config, model, device)
    _connect_step(runtime, step_func)
    train_iter, valid_iter = _build_train_valid_iterators(config, tokenizer, state, step_func)
    train_iter, valid_iter = _per_chunk_data(model, train_iter), _per_chunk_data(model, valid_iter)
    writer = tensorboard_writer(config)
    faults.register_peers()
    faults.apply_timeout_to_all_groups(config.parallel.distributed_timeout_minutes)
    dist.barrier()  # everyone built; from here on only the schedule's own traffic
    runtime.stats.start_memory_tracking(device)  # real peak memory: training, not set-up
    print_rank_0(f"> setup done in {time.perf_counter() - wall_start:.1f} s, training ...")

    control = run_control.build_agreement(config, requests, device)
    with _maybe_audit() as audit:
        if config.training.skip_train:
            print_rank_0("> --skip-train: evaluation only")
            evaluate(config, forward_step_func, model, valid_iter, state, writer)
        else:
            train(config, forward_step_func, model, runtime, step_func, train_iter, valid_iter,
                  state, writer, audit, control)  # fmt: skip
    if audit_requested():
        state.cross_stage_collectives = len(audit.violations)

    _finish_run(config, state, runtime, step_func, optimizer, writer, wall_start)
    return state


def _print_layout(config) -> None:
    layout = config.parallel
    print_rank_0(
        f"> world size {layout.world_size}: tensor {layout.tensor_model_parallel_size} x "
        f"pipeline {layout.pipeline_model_parallel_size} x context {_context_parallel(layout)} "
        f"x data {layout.data_parallel_size}, backend "
        f"{dist.get_backend()}, schedule {config.pipeline.plan.name}, "
        f"{config.training.num_microbatches} microbatches per step"
    )
    pipeline = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    print_rank_0(f"> rank order {RANK_ORDERS[layout.use_tp_pp_dp_mapping]}: rank 0's pipeline "
                 f"is ranks {pipeline}")  # fmt: skip


def _connect_step(runtime: RankRuntime, step_func: "MegatronStep") -> None:
    """What the runtime tells the step: the fp16 loss scale rides on its messages; a deferred
    update lands, and the reduction's buckets launch, as the step's passes run."""
    runtime.loss_scaler = step_func.loss_scaler
    if step_func.deferred:
        step_func.runtime = runtime
        runtime.gradient_syncs.append(step_func)
    if step_func.reduction is not None:
        runtime.gradient_syncs.append(step_func.reduction)
    if step_func.param_gather is not None:  # a backward reads every weight of the stage
        runtime.before_weight_reads.append(step_func.finish_param_gather)


def _process_groups() -> set:
    """The process groups of this process (torch's private registry, which faults.py reads
    too; empty if it moves)."""
    return set(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))


def _destroy_groups_since(before: set) -> None:
    """Destroy the groups this run created. megatron-core's destroy_model_parallel only drops
    its references, and each gloo group keeps its threads and sockets: about 18 groups and 55
    threads per run, which made later runs in the same process up to 60% slower (several runs
    per launch: the functional tests, the benchmarks). A destroyed group's threads end only when
    the group object goes, and reference cycles (the model's modules hold the groups) keep it
    until the cycle collector runs: collect now (measured: 51 gloo threads left per run
    without it, none with it). What survives the collection (torch, megatron-core, the modules:
    ~430,000 objects) is then frozen, out of later collections' scans, so that the next run in
    the process collects only its own objects (a full scan cost 0.3 s per run)."""
    for group in _process_groups() - before:
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()
    gc.freeze()


def _build_checked_tokenizer(config):
    """(The tokenizer, the configuration with its padded vocabulary); checks the data's token
    ids against it."""
    tokenizer = build_tokenizer_of_run(config.data)
    config = config.with_vocabulary(tokenizer.vocab_size)
    if not config.data.mock_data:
        check_token_ids(prefixes_of(config.data.source), tokenizer.vocab_size,
                        config.model.padded_vocab_size)  # fmt: skip
    fim = FimSettings.of_run(config.data)
    if fim is not None:  # a sentinel the vocabulary lacks fails before the model is built
        resolve_token_ids(fim, tokenizer)
    return tokenizer, config


def boundary_sequence_length(config) -> int:
    """The sequence length of the activations between stages: a context-parallel rank's two
    chunks, s / cp, and with sequence parallelism each tensor-parallel rank's part of them,
    [s / cp / tp, b, h] (megatron-core's convention)."""
    local = config.model.seq_length // config.parallel.context_parallel_size
    tp = config.parallel.tensor_model_parallel_size
    return local // tp if config.parallel.sequence_parallel else local


def emulated_link(pipeline) -> PacedLink | None:
    """The rank's emulated outgoing link of --emulated-link-gbs (None without it)."""
    if pipeline.emulated_link_gbs is None:
        return None
    return PacedLink(pipeline.emulated_link_gbs, pipeline.emulated_link_latency_us / 1e6)


def _build_stage_runtime(config, model, device) -> RankRuntime:
    """The rank's pipeline runtime, attached to the model with the run's pipeline plan."""
    dtype, plan = config.model.dtype, config.pipeline.plan
    # a stage's context-parallel ranks run one ring per forward and backward, its expert-
    # parallel ranks (over its data-parallel replicas) all-to-alls: they run the same order
    per_stage = (
        config.parallel.context_parallel_size > 1 or config.parallel.expert_model_parallel_size > 1
    )
    context = build_pipeline_context(device, decide_per_stage=per_stage)
    placement, output_shard, input_shard, vocab_links = plan.placement, None, None, None
    if plan.schedule.vocab_passes:  # the vocabulary rows of this rank, and their streams
        batch_shape = (config.training.micro_batch_size, config.model.seq_length)
        holder = getattr(model, "chunks", [model])[0]  # the rank's first chunk holds them
        output_shard = holder.output_shard.runtime_shard(math.prod(batch_shape))
        if plan.schedule.embedding_passes:  # the input embedding's rows (tied: the same)
            rows = getattr(holder, "input_shard", holder.output_shard)
            input_shard = rows.runtime_input_shard(batch_shape)
        vocab_links = build_vocab_links(config.pipeline.vocab_parallel_tree_arity)
    chunks = 1 if placement is None else placement.chunks_per_rank
    transport = DistributedTransport(
        rank=dist.get_rank(), backend=context.backend, device=device, dtype=dtype,
        links=plain_links(context) if placement is None else build_lane_links(placement),
        max_pending=chunks * (2 * context.num_stages + 2), vocab_links=vocab_links,
        link=emulated_link(config.pipeline),
        pace_embedding=not config.pipeline.emulated_link_unpaced_embedding,
    )  # fmt: skip
    runtime = RankRuntime(
        context,
        model,
        tensor_shape=(
            boundary_sequence_length(config),
            config.training.micro_batch_size,
            config.model.hidden_size,
        ),
        dtype=dtype,
        placement=placement,
        transport=transport,
        record_trace=config.logging.timeline_file is not None,
        deterministic=config.parallel.deterministic_mode,
        per_token_loss=config.model.calculate_per_token_loss,
        output_shard=output_shard,
        input_shard=input_shard,
    )
    if config.moe is not None:  # megatron-core's aux losses: scaled as each backward's loss
        runtime.backward_scale_listeners.append(set_aux_loss_scale)
        runtime.versioned_buffers.extend(routing_buffers(model))  # 2BW, PipeDream: stashed
    if config.model.mtp_num_layers:  # the MTP loss too
        runtime.backward_scale_listeners.append(set_mtp_loss_scale)
    if uses_sparse_attention(config.model):  # and the sparse attention's indexer loss
        runtime.backward_scale_listeners.append(set_indexer_loss_scale)
    attach_stage_runtime(model, runtime, plan)
    return runtime


def _build_train_valid_iterators(config, tokenizer, state: TrainingState, step_func):
    """The (train, valid) microbatch iterators of this data-parallel rank (the training data
    able to replay an iteration with --rerun-mode validate_results)."""
    train_iter, valid_iter = data_iterators_of_run(
        config,
        tokenizer,
        train_samples=total_train_samples(config),
        valid_samples=_eval_samples(config.training),
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=config.parallel.data_parallel_size,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
    )
    return _with_result_validation(config, step_func, train_iter, state), valid_iter


def _with_result_validation(config, step_func, train_iter, state):
    """--rerun-mode validate_results: the step's `validation`, resumed from the checkpoint's
    rerun state if it has one; the data able to replay an iteration."""
    if config.training.rerun_mode != "validate_results":
        return train_iter
    device = next(step_func.model.parameters(), torch.zeros(0)).device
    validation = ResultValidation(config.training, device=device, rank=dist.get_rank())
    if config.checkpoint.load and state.iteration:
        validation.load(config.checkpoint.load, state.iteration)
    if train_iter is not None:
        train_iter = validation.data = ReplayableIterator(train_iter)
    step_func.validation = validation
    return train_iter


def _per_chunk_data(model, iterator):
    """One iterator per model chunk when several chunks of this rank read the data (the V
    placement: rank 0 runs the first virtual stage, which reads the tokens, and the last, which
    reads the labels of the same microbatches), else the one iterator."""
    chunks = getattr(model, "chunks", None)
    if iterator is None or chunks is None:
        return iterator
    readers = [c for c in chunks if getattr(c, "pre_process", False) or c.post_process]
    return list(itertools.tee(iterator, len(chunks))) if len(readers) > 1 else iterator


def _finish_run(config, state, runtime, step_func, optimizer, writer, wall_start) -> None:
    """Write the timelines and summary, close the writer and tear down model parallelism;
    raises ``RunFailed`` when training diverged."""
    if config.logging.timeline_file:
        write_timelines(config, runtime, step_func)
    write_summary(config, state, runtime, step_func, optimizer, wall_start)
    if writer is not None:
        writer.close()
    parallel_state.destroy_model_parallel()
    if state.diverged:
        raise RunFailed(f"training diverged: {state.diverged}", exit_code=3)
    if state.validation_exit is not None:
        code, why = state.validation_exit
        raise RunFailed(f"--rerun-mode validate_results: {why}", exit_code=code)


@contextlib.contextmanager
def _maybe_audit():
    if not audit_requested():
        yield CollectiveAudit()  # records nothing: no collective is wrapped
        return
    with record_cross_stage_collectives(ranks_of_my_stage()) as audit:
        yield audit


class MegatronStep:
    """The stage's optimizer step with Megatron's extras around it.

    * Tied embeddings under 1F1B-flush: before the step, the first stage's input embedding and
      the last stage's output layer (two copies of one weight) sum their gradients over
      megatron-core's embedding group (on the V placement both copies are on rank 0: a local
      sum), so both copies take the same update and the model equals
      a non-pipelined tied one. Under the asynchronous schedules the two stages exchange the
      gradient and the weight point to point instead (optimizer/tied_embeddings.py).
    * --log-num-zeros-in-grad: zeros in the stage's gradient before the step (before the
      data-parallel average); --log-params-norm: the stage's squared parameter norm after it.
    * --log-timers-to-tensorboard: time spent in the step.
    """

    def __init__(self, step_func: StageOptimizerStep, model: torch.nn.Module, config):
        self.step_func = step_func
        sync_tied = config.pipeline.plan.flushes
        shared = [p for p in model.parameters() if getattr(p, "shared_embedding", False)]
        self.tied_weights = shared if sync_tied else []
        self.group = parallel_state.get_embedding_group() if self.tied_weights else None
        self.tied_exchange = None if sync_tied or not shared else _tied_exchange(
            shared[0], step_func, config
        )  # fmt: skip
        self.count_zeros, self.norm = (
            config.logging.log_num_zeros_in_grad,
            config.logging.log_params_norm,
        )
        self.moe_hooks = MoEStepHooks(model)
        moe = config.moe is not None and config.pipeline.emulated_forward_ms is None
        self.moe_stats = MoELoadStats(model) if moe else None
        self.mtp_losses = MTPLossLog(model) if config.model.mtp_num_layers else None
        self.indexer_losses = _indexer_loss_log(model, config)
        self.num_zeros, self.params_norm_squared = (0.0, 0.0), (0.0, 0.0)  # dense, experts
        self.step_seconds = 0.0
        self.validation: ResultValidation | None = None  # --rerun-mode validate_results
        # --paci-deferred-step: the schedule's step launches the reduction, the update lands
        # before the next step's last pass (or at a drain); the runtime counts the updates
        # not yet applied, so that drift is measured on the weights the passes really use
        self.deferred = config.pipeline.paci_deferred_step
        self.pending = False
        self.runtime = None

    def __call__(self):
        if self.validation is not None and not self.validation.at_step(
            self.step_func.gradient_of, self.step_func.params
        ):
            return self._drop_gradients()
        if len(self.tied_weights) == 2:  # both copies on this rank (the V placement)
            first, second = (self.step_func.gradient_of(w) for w in self.tied_weights)
            first.add_(second)
            second.copy_(first)
        for weight in self.tied_weights if len(self.tied_weights) == 1 else ():
            dist.all_reduce(self.step_func.gradient_of(weight), group=self.group)
        if self.tied_exchange is not None:
            self.tied_exchange.before_step()
        if self.count_zeros:
            self.num_zeros = _zeros_in_grad(self.step_func)
        self.moe_hooks.before_step()
        start = time.perf_counter()
        if self.deferred:
            self.step_func.launch()
            self.pending = True
            self.runtime.pending_updates += 1
            self.step_seconds += time.perf_counter() - start
            return self.step_func.last  # the last update applied
        report = self.step_func()
        self.step_seconds += time.perf_counter() - start
        return self._after_update(report)

    def _after_update(self, report: StepReport) -> StepReport:
        if self.tied_exchange is not None:  # sends or overwrites the updated tied weight
            self.step_func.finish_param_gather(only=[self.tied_exchange.weight])
            self.tied_exchange.after_step()
        if self.norm:
            self.step_func.finish_param_gather()
            self.params_norm_squared = _squared_norm(self.step_func.params)
        return report

    def land(self) -> None:
        """--paci-deferred-step: apply the update whose reduction is in flight (before the
        next step's last pass, and at a drain)."""
        if not self.pending:
            return
        start = time.perf_counter()
        report = self.step_func.land()
        self.step_seconds += time.perf_counter() - start
        self.pending = False
        self.runtime.pending_updates -= 1
        self._after_update(report)

    def before_gradient_pass(self, chunk: int, passes: int) -> None:  # a gradient sync
        """`passes`: the gradient passes since the step, this one included."""
        if passes >= self.deferred:
            self.land()

    def before_final_pass(self, chunk: int) -> None:
        self.land()

    def chunk_complete(self, chunk: int) -> None:
        pass

    def _drop_gradients(self) -> StepReport:
        """The iteration runs again (or the run ends): no update, no LR step, the MoE token
        counts of the dropped run forgotten."""
        self.step_func.drop_gradients()
        self.moe_hooks.forget_counts()
        learning_rate = logged_learning_rate(self.step_func.optimizer.param_groups)
        return StepReport(grad_norm=float("nan"), learning_rate=learning_rate, skipped=True)

    def at_drain(self) -> None:
        """The pipeline is empty: a deferred update lands, and the parameter gathers in flight
        (what follows a drain reads every weight: evaluation, the health check, a checkpoint,
        the end); the last stage's tied copy catches up with the first's."""
        self.land()
        self.step_func.finish_param_gather()
        if self.tied_exchange is not None:
            self.tied_exchange.catch_up()

    def __getattr__(self, name):  # optimizer, scheduler, last: the wrapped step's
        return getattr(self.step_func, name)


def _tied_exchange(weight, step_func: StageOptimizerStep, config) -> TiedEmbeddingExchange:
    """This rank's side of the tied-embedding exchange with its embedding-group peer. The lag
    is set for the fewest microbatches per step of the run (`tied_lag`)."""
    group = parallel_state.get_embedding_group()
    peer = next(r for r in dist.get_process_group_ranks(group) if r != dist.get_rank())
    return TiedEmbeddingExchange(
        weight,
        is_first=parallel_state.is_pipeline_first_stage(),
        channel=ProcessGroupChannel(peer, group),
        lag=tied_lag(config),
        gradient_of=step_func.gradient_of,
        refresh_main=getattr(step_func.optimizer, "refresh_from_model", None),
    )


def tied_lag(config) -> int:
    """The tied copy's lag bound, for the fewest microbatches per step of the run (a batch
    ramp's first, a step schedule's smallest batch, or the smallest a of
    --paci-accumulation-schedule)."""
    microbatches = BatchSchedule.of(config).fewest_microbatches()
    per_update = config.pipeline.plan.microbatches_per_update(microbatches)
    return lag_bound(config.parallel.pipeline_model_parallel_size, per_update)


def _counted_once(params, *, experts: bool = False):
    """Parameters as Megatron counts them for norms and zeros: the last stage's copy of a
    tied embedding and tensor-parallel duplicates (norm weights, ...) off TP rank 0 skipped.
    The routed experts (MoE) apart (`experts=True`): every rank's are its own (each expert
    sharded over expert tensor parallelism), counted over the expert groups."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for param in params:
        if getattr(param, "moe_expert", False) != experts or getattr(param, "shared", False):
            continue
        if experts or getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            yield param


def _zeros_in_grad(step_func) -> tuple[float, float]:
    """(dense, routed experts) zeros in the gradient (of each rank's rows, summed over the
    sharding groups, when the model is fully sharded)."""
    zeros = [0, 0]
    for index, experts in enumerate((False, True)):
        for param in _counted_once(step_func.params, experts=experts):
            gradient = step_func.gradient_of(param)
            zeros[index] += gradient.numel() - int(torch.count_nonzero(gradient))
    return fsdp.summed_over_shards(zeros, step_func.params)


def _squared_norm(params) -> tuple[float, float]:
    """(dense, routed experts) squared parameter norm."""
    squares = [
        sum(float(fsdp.local(p).detach().float().pow(2).sum())
            for p in _counted_once(params, experts=e))
        for e in (False, True)
    ]  # fmt: skip
    return fsdp.summed_over_shards(squares, params)


def megatron_log_fields(config, step_func: MegatronStep) -> dict:
    """'num zeros' and 'params norm' for the iteration line. 1F1B-flush sums the stages'
    values over the model-parallel group (the pipeline is flushed at every step anyway); PACI
    reports the logging (last) stage's own, since a sum over stages would synchronize them."""
    if not (config.logging.log_num_zeros_in_grad or config.logging.log_params_norm):
        return {}
    (dense_zeros, expert_zeros), (dense_norm, expert_norm) = (
        step_func.num_zeros,
        step_func.params_norm_squared,
    )
    dense = torch.tensor([dense_zeros, dense_norm], dtype=torch.float64)
    experts = torch.tensor([expert_zeros, expert_norm], dtype=torch.float64)
    if config.pipeline.plan.global_grad_norm:
        params = step_func.step_func.params
        device = params[0].device if params else torch.device("cpu")
        dense, experts = dense.to(device), experts.to(device)
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if config.moe is not None:  # MoE: each expert once
            group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            dist.all_reduce(experts, group=group)
    values = dense + experts
    fields = {}
    if config.logging.log_num_zeros_in_grad:
        fields["num zeros"] = float(values[0])
    if config.logging.log_params_norm:
        fields["params norm"] = math.sqrt(float(values[1]))
    return fields


def moe_log_fields(config, step_func: MegatronStep, iteration: int) -> dict:
    """MoE: the stage's aux losses and load statistics over the interval
    (moe/training_hooks.py), reduced over the stage's tensor x data-parallel ranks only. The
    logging stage's go into the iteration line and TensorBoard; every other stage's leader
    prints its own line."""
    stats = getattr(step_func, "moe_stats", None)
    if stats is None:
        return {}
    fields = stats.collect(parallel_state.get_tensor_and_data_parallel_group())
    if fields and is_stage_leader() and not is_logging_rank(config.pipeline.plan):
        stage = parallel_state.get_pipeline_model_parallel_rank()
        text = "".join(f"{name}: {value:.6E} | " for name, value in fields.items())
        print(f" stage {stage} MoE at iteration {iteration:8d} | {text}", flush=True)
    return fields if is_logging_rank(config.pipeline.plan) else {}


def _indexer_loss_log(model, config) -> IndexerLossLog | None:
    """DeepSeek sparse attention with a KL loss for its indexers: their loss, logged."""
    if not (uses_sparse_attention(config.model) and config.model.dsa_indexer_loss_coeff):
        return None
    device = next(model.parameters()).device
    return IndexerLossLog(model, config.model.num_layers, device)


def mtp_log_fields(config, step_func: MegatronStep) -> dict:
    """Multi-token prediction: each MTP layer's loss over the interval on the last stage, averaged
    over its data x context-parallel ranks, as Megatron logs it (`mtp_1 loss`, ...); with
    DeepSeek sparse attention, the indexer loss of the logging stage's layers the same way."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    fields = {}
    for losses in (step_func.mtp_losses, step_func.indexer_losses):  # DSA's indexer loss too
        if losses is not None:
            fields.update(losses.collect(group))
    return fields if is_logging_rank(config.pipeline.plan) else {}


def _eval_samples(training) -> int:
    """Validation samples the run reads (`training`: its `TrainingConfig`)."""
    evaluations = training.train_iters // training.eval_interval + int(training.skip_train)
    return training.eval_iters * training.eval_batch[0] if evaluations else 0


def stop_iteration(config, start_iteration: int) -> int:
    """--train-iters, or earlier the first iteration after the start that --exit-interval
    divides (Megatron saves with --save and exits there)."""
    training = config.training
    if training.exit_interval is None:
        return training.train_iters
    first_exit = (start_iteration // training.exit_interval + 1) * training.exit_interval
    return min(training.train_iters, first_exit)


def drain_points(config, start_iteration: int) -> list[int]:
    """Iterations after which the pipeline must be empty: evaluation, checkpoint, the end, and
    where the schedule or PACI's accumulation factor changes."""
    stop = stop_iteration(config, start_iteration)
    phase_ends = synchronous_phase_ends(config.pipeline, config.training.train_iters)
    phase_ends += accumulation_phase_ends(config)
    points = {stop, *(p for p in phase_ends if p <= stop)}
    evaluations = config.training.eval_interval if config.training.eval_iters else None
    for interval in (evaluations, config.checkpoint.save_interval):
        if interval:
            points.update(range(interval, stop + 1, interval))
    return sorted(p for p in points if p > start_iteration)


class IterationPlan:
    """What the loop knows ahead of each iteration: its global batch and number of
    microbatches (constant, or following --rampup-batch-size or --step-batch-size-schedule
    from the samples consumed, a resumed run's included), and the drain points
    (evaluation, checkpoint, the end, and an agreed early stop)."""

    def __init__(self, config, state: TrainingState):
        self.first = state.iteration + 1
        self.drains = drain_points(config, state.iteration)
        self.stop = self.drains[-1] if self.drains else state.iteration
        schedule = BatchSchedule.of(config)
        self.per_microbatch = schedule.per_microbatch
        self.sizes = schedule.batches(state.consumed_train_samples, self.stop - state.iteration,
                                      first_iteration=self.first)  # fmt: skip
        self.lr_in_samples = lr_in_samples(config.training)
        self.final_microbatches = config.training.num_microbatches
        # microbatches of the first i iterations, for O(1) sums over any range
        self.prefix = [0, *itertools.accumulate(b // self.per_microbatch for b in self.sizes)]

    def batch(self, iteration: int) -> int:
        return self.sizes[iteration - self.first]

    def microbatches(self, iteration: int) -> int:
        if iteration - self.first >= len(self.sizes):
            return self.final_microbatches  # past the end: only for the stop agreement
        return self.batch(iteration) // self.per_microbatch

    def cumulative(self, iteration: int) -> int:
        """Microbatches of this run's iterations up to `iteration` (0 before the first)."""
        done = iteration - self.first + 1
        if done < len(self.prefix):
            return self.prefix[max(done, 0)]
        return self.prefix[-1] + (done - len(self.prefix) + 1) * self.final_microbatches

    def next_drain(self, iteration: int) -> int:
        return next(p for p in self.drains if p >= iteration)

    def microbatches_before_drain(self, iteration: int) -> int:
        """This iteration's and the following ones' microbatches up to the next drain."""
        return self.cumulative(self.next_drain(iteration)) - self.cumulative(iteration - 1)

    def stop_after(self, iteration: int) -> None:
        """End training after `iteration` (a drain point from now on)."""
        if iteration < self.stop:
            self.drains = [p for p in self.drains if p < iteration] + [iteration]
            self.stop = iteration


def train(config, forward_step_func, model, runtime, step_func, train_iter, valid_iter, state,
          writer, audit, control=None) -> None:  # fmt: skip
    plan = IterationPlan(config, state)
    validation = step_func.validation
    training_step_func = forward_step_func
    if validation is not None:  # evaluation is not validated
        training_step_func = _checking_losses(forward_step_func, validation)
    interval_start, interval_losses = time.perf_counter(), []
    train_start = time.perf_counter()
    hash_interval = config.training.check_weight_hash_across_dp_replicas_interval
    if hash_interval is not None:  # as Megatron: once before the first iteration too
        _check_weight_hashes(state, model, state.iteration)
    while state.iteration < plan.stop:
        iteration = state.iteration + 1
        if control is not None:
            _agree_on_stop(control, plan, iteration, runtime, validation)
        loss_dicts = _train_iteration(config, training_step_func, model, train_iter, step_func,
                                      plan, iteration)  # fmt: skip
        if validation is not None and validation.exit is not None:
            _stop_for_validation(config, state, model, step_func, audit)
            break
        _account_iteration(config, state, plan, iteration, loss_dicts, interval_losses)
        if iteration % config.logging.log_interval == 0:
            elapsed = time.perf_counter() - interval_start
            fields = megatron_log_fields(config, step_func)
            fields.update(moe_log_fields(config, step_func, iteration))
            fields.update(mtp_log_fields(config, step_func))
            log_iteration(config, state, runtime, step_func, interval_losses, elapsed, writer,
                          fields)  # fmt: skip
            step_func.step_seconds = 0.0
            interval_start, interval_losses = time.perf_counter(), []
        if hash_interval is not None and iteration % hash_interval == 0:
            step_func.finish_param_gather()
            _check_weight_hashes(state, model, iteration)
        stopping = control is not None and control.stop_after(iteration)
        if iteration == plan.next_drain(iteration) or stopping:
            step_func.at_drain()
            with audit.paused():  # the pipeline is drained here: not a training step
                if not _check_health(config, state, model, step_func):
                    break
        if config.training.eval_iters and iteration % config.training.eval_interval == 0:
            evaluate(config, forward_step_func, model, valid_iter, state, writer)
            interval_start = time.perf_counter()  # evaluation time is not iteration time
        if (
            config.checkpoint.save
            and config.checkpoint.save_interval
            and iteration % config.checkpoint.save_interval == 0
        ):
            _save_checkpoint(config, state, model, step_func, audit)
        if stopping:
            state.exit_reason = control.reason
            break
    state.train_time_s = time.perf_counter() - train_start
    _end_of_training(config, state, model, step_func, audit)


def _check_weight_hashes(state, model, iteration: int) -> None:
    """--check-weight-hash-across-dp-replicas-interval: a gather within the stage's
    data-parallel group, the routed experts' within their expert data-parallel group when
    expert parallelism puts other experts on the stage's replicas (the collective audit stays
    on: neither crosses stages)."""
    group = parallel_state.get_data_parallel_group()
    expert_group = None
    replicas = f"{dist.get_world_size(group)} data-parallel replicas"
    if experts_apart_from_dense():
        expert_group = parallel_state.get_expert_data_parallel_group()
        replicas += f", {dist.get_world_size(expert_group)} of each expert"
    check_replicas_match(model, group, iteration, expert_group=expert_group)
    state.weight_hash_checks.append(iteration)
    if is_stage_leader():
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        print(f">>> Weight hashes match after {iteration} iterations... (stage {stage} of "
              f"{stages}, {replicas})", flush=True)  # fmt: skip


def _agree_on_stop(control, plan: IterationPlan, iteration: int, runtime, validation) -> None:
    """Before `iteration`: adopt an agreed early stop as the next drain point."""
    agreed = control.stop_before(iteration, plan.cumulative)
    if agreed is None or agreed >= plan.stop:
        return
    # microbatches this rank has started: its first chunk's forwards with virtual stages (an
    # iteration validated again forwarded its microbatches twice)
    started = getattr(runtime.state, "chunks", [runtime.state])[0].forwards
    started -= validation.replayed_microbatches if validation is not None else 0
    if agreed < iteration or started > plan.cumulative(agreed):
        # the agreement's margin rules this out: a bug if it happens
        raise RuntimeError(
            f"stop after iteration {agreed} agreed too late for iteration {iteration}: "
            f"{runtime.state.describe()}"
        )
    plan.stop_after(agreed)
    print_rank_0(f"> {control.reason}: training stops after iteration {agreed} (drained)")


def _train_iteration(config, forward_step_func, model, train_iter, step_func, plan, iteration):
    """One iteration (run again while --rerun-mode validate_results asks); the last stage's
    loss dicts."""
    validation = step_func.validation
    if validation is None:
        return _run_iteration(config, forward_step_func, model, train_iter, step_func, plan,
                              iteration)  # fmt: skip
    validation.begin(iteration)
    while True:
        loss_dicts = _run_iteration(config, forward_step_func, model, train_iter, step_func,
                                    plan, iteration)  # fmt: skip
        if not validation.again(plan.microbatches(iteration)):
            return loss_dicts


def _checking_losses(forward_step_func, validation: ResultValidation):
    """The forward step whose loss function hands each microbatch's loss to `validation`."""

    def forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def checked_loss_func(output_tensor):
            result = loss_func(output_tensor)
            validation.check_loss(result[0])
            return result

        return output, checked_loss_func

    return forward_step


def _stop_for_validation(config, state, model, step_func, audit) -> None:
    """The validation ends the run: save the state before the iteration if it asks (with its
    rerun state when a resume is to compare again), and exit with its code."""
    validation = step_func.validation
    code, why, save = validation.exit
    state.validation_exit = (code, why)
    if not (save and config.checkpoint.save):
        return
    saved = checkpointing.read_tracker(config.checkpoint.save, quiet=True)
    if saved != state.iteration:  # the iteration before, unless saved already
        _save_checkpoint(config, state, model, step_func, audit)
    if validation.phase is Phase.SAVE_TO_RESUME:
        validation.save(config.checkpoint.save, state.iteration)
        dist.barrier()
        print_rank_0(f"> saved the rerun state beside the checkpoint of iteration "
                     f"{state.iteration} in {config.checkpoint.save}")  # fmt: skip


def _run_iteration(config, forward_step_func, model, train_iter, step_func, plan, iteration):
    """One iteration of the schedule (flush during synchronous phases); the last stage's
    loss dicts."""
    pipeline = plan_of_iteration(config.pipeline, config.training.train_iters, iteration)
    if pipeline is config.pipeline.plan:  # Megatron's call: the plan attached to the model
        schedule_function = get_forward_backward_func()
    else:  # a synchronous phase of an asynchronous run
        schedule_function = forward_backward_func_for(pipeline.schedule)
    stage_step = getattr(step_func, "step_func", step_func)
    if synchronous_phase_ends(config.pipeline, config.training.train_iters):
        # fresh gradients in a synchronous phase: the delay corrections have nothing to correct
        set_synchronous_phase(stage_step.optimizer, pipeline is not config.pipeline.plan)
    if plan.lr_in_samples:  # Megatron's LR schedule of a ramp (or a step schedule) in samples
        stage_step.scheduler_increment = plan.batch(iteration)
    return schedule_function(
        forward_step_func=forward_step_func,
        data_iterator=train_iter,
        model=model,
        num_microbatches=plan.microbatches(iteration),
        seq_length=config.model.seq_length,
        micro_batch_size=config.training.micro_batch_size,
        optimizer_step_func=step_func,
        microbatches_before_drain=plan.microbatches_before_drain(iteration),
    )


def _account_iteration(config, state, plan, iteration, loss_dicts, interval_losses) -> None:
    batch = plan.batch(iteration)
    state.iteration = iteration
    state.global_batch_size = batch
    state.consumed_train_samples += batch
    state.tokens += batch * config.model.seq_length
    if holds_the_loss(config.pipeline.plan):
        loss = _average_loss(loss_dicts)
        state.losses.append(loss)
        interval_losses.append(loss)
        state.nan_iterations += 0 if math.isfinite(loss) else 1


def _end_of_training(config, state, model, step_func, audit) -> None:
    """Save unless the last iteration just did; say why training stopped early."""
    step_func.finish_param_gather()  # the run's final weights, whatever reads them next
    saved_last = (
        config.checkpoint.save_interval and state.iteration % config.checkpoint.save_interval == 0
    )
    ended = state.diverged or state.validation_exit
    if config.checkpoint.save and not saved_last and not ended:
        _save_checkpoint(config, state, model, step_func, audit)
    if state.iteration < config.training.train_iters and not ended:
        reason = state.exit_reason or "--exit-interval"
        print_rank_0(f"> exiting at iteration {state.iteration} ({reason})")


def _check_health(config, state, model, step_func) -> bool:
    """At a drain point: agree on divergence, roll back past the limit. False: stop training."""
    last_loss = state.losses[-1] if holds_the_loss(config.pipeline.plan) and state.losses else None
    health = divergence.agree_on_health(model, step_func, last_loss)
    state.fit_to_save = health.fit_to_save()
    if not health.must_roll_back(config.training.max_consecutive_skips):
        return True
    reason = divergence.describe(health, state.iteration)
    if state.iteration < config.training.train_iters:
        restored = divergence.roll_back(config.checkpoint, state, model, step_func)
        if restored is not None:
            state.rollbacks.append({"iteration": state.iteration, "to": restored})
            state.fit_to_save = True
            print_rank_0(
                f"> {reason} (--max-consecutive-skips {config.training.max_consecutive_skips}): "
                f"rolled back to the checkpoint of iteration {restored}; continuing at iteration "
                f"{state.iteration + 1} with the next data"
            )
            return True
        reason += "; there is no checkpoint to roll back to (--save)"
    elif state.rollbacks:
        reason += f" (after {len(state.rollbacks)} rollbacks)"
    state.diverged, state.fit_to_save = reason, False
    faults.finish_on_our_own()  # every rank agreed: each exits with the divergence's code
    return False


def _save_checkpoint(config, state, model, step_func, audit) -> None:
    """Save, unless some stage's state is not finite (then the last good checkpoint stays)."""
    if not state.fit_to_save:
        print_rank_0(
            f"> not saving at iteration {state.iteration}: a stage skipped its last step or "
            f"its loss or weights are not finite; {checkpointing.TRACKER} keeps naming the "
            f"last good checkpoint"
        )
        return
    step_func.finish_param_gather()  # the model's weights are saved with the update
    with audit.paused():  # the pipeline is drained here: not a training step
        _check_still_ours(config)
        checkpointing.save(
            config.checkpoint.save,
            state,
            model,
            step_func.optimizer,
            step_func.scheduler,
            config=config,
        )


def _check_still_ours(config) -> None:
    """Before a save, the owner record of --save still names this run (where flock is not
    honoured, another job may have taken the directory): else every rank stops, saving
    nothing."""
    problem = [None]
    if dist.get_rank() == 0:
        try:
            WriterLock(config.checkpoint.save, config.checkpoint.run_id).check()
        except UserError as error:
            problem = [str(error)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise UserError(problem[0])


def _average_loss(loss_dicts: list[dict]) -> float:
    """Mean 'lm loss' over the step's microbatches and the stage's data-parallel ranks; with
    Megatron's (loss sum, tokens) pairs (--calculate-per-token-loss), the mean per token."""
    # On the model's device, which is the one the data-parallel group's backend expects.
    if loss_dicts[0]["lm loss"].numel() == 2:
        pairs = [d["lm loss"].detach().float().view(-1) for d in loss_dicts]
        return _per_token_mean(torch.stack(pairs).sum(dim=0))
    local = torch.stack([d["lm loss"].detach().float() for d in loss_dicts]).mean()
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        with named_reduction("the data-parallel average of the loss", group):
            dist.all_reduce(local, group=group)
        local = local / dist.get_world_size(group)
    return float(local)


def _per_token_mean(sum_and_tokens: torch.Tensor) -> float:
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        with named_reduction("the data-parallel average of the loss", group):
            dist.all_reduce(sum_and_tokens, group=group)
    return float(sum_and_tokens[0] / sum_and_tokens[1].clamp(min=1.0))


def evaluate(config, forward_step_func, model, valid_iter, state, writer) -> None:
    # every rank counts, so that each stage's checkpoint holds where the next one reads
    state.consumed_valid_samples += config.training.eval_iters * config.training.eval_batch[0]
    if valid_iter is None:
        return
    model.eval()
    schedule_function = get_forward_backward_func()  # Megatron's call: the configured one
    # the stages' buffers hold training's micro-batch: evaluation's go through in pieces of it
    _, eval_micro_batch_size, num_microbatches = config.training.eval_batch
    pieces = eval_micro_batch_size // config.training.micro_batch_size
    pieces_iter = microbatch_pieces(valid_iter, pieces) if pieces > 1 else valid_iter
    losses = []
    for _ in range(config.training.eval_iters):
        loss_dicts = schedule_function(
            forward_step_func=forward_step_func,
            data_iterator=pieces_iter,
            model=model,
            num_microbatches=num_microbatches * pieces,
            seq_length=config.model.seq_length,
            micro_batch_size=config.training.micro_batch_size,
            forward_only=True,
        )
        if holds_the_loss(config.pipeline.plan):
            losses.append(_average_loss(loss_dicts))
    fsdp.reshard(model)  # FSDP: no backward frees what the forwards gathered
    model.train()
    if holds_the_loss(config.pipeline.plan):
        loss = sum(losses) / len(losses)
        ppl = math.exp(min(20.0, loss))  # Megatron caps the exponent at 20
        state.validation.append({"iteration": state.iteration, "lm loss": loss})
        line = (
            f" validation loss at iteration {state.iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |"
        )
        print_rank_last(
            config.pipeline.plan, "-" * len(line) + "\n" + line + "\n" + "-" * len(line)
        )
        if writer is not None and is_logging_rank(config.pipeline.plan):
            writer.add_scalar("lm loss validation", loss, state.iteration)
            if config.logging.log_validation_ppl_to_tensorboard:
                writer.add_scalar("lm loss validation ppl", ppl, state.iteration)
