"""The pretraining loop: set-up, iterations, evaluation, logging, metrics, checkpoints.

`pretrain(args, forward_step_func)` is what `pretrain_gpt.py` calls. The loop is the same for
every schedule; the schedule function (from `get_forward_backward_func`) steps each stage's
optimizer itself when a step is due.
"""

import contextlib
import json
import os
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.pipeline.audit import (
    CollectiveAudit,
    audit_requested,
    record_cross_stage_collectives,
)
from megatron.pipeline.forward_backward import attach_stage_runtime, get_forward_backward_func
from megatron.pipeline.parallel import build_pipeline_context, ranks_of_my_stage
from megatron.pipeline.runtime import StageRuntime
from megatron.pipeline.trace import write_chrome_trace

from . import checkpointing
from .data import build_data_iterators
from .emulation import EmulatedStage
from .model import StageLayout, build_gpt_stage
from .optimizer import StageOptimizerStep, build_lr_scheduler, build_optimizer
from .tokenizer import build_tokenizer


# ---------------------------------------------------------------------------- set-up
def initialize_distributed(args) -> torch.device:
    """Process groups (torch.distributed + megatron-core's parallel_state) and the device."""
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = __import__("datetime").timedelta(minutes=args.distributed_timeout_minutes)
        dist.init_process_group(backend=backend, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    return device


def padded_vocab_size(vocab_size: int, args) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by x tensor-parallel size."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(args, device: torch.device) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=True,  # draws on CPU; our layout-independent init overwrites it
        perform_initialization=True,  # (it also tags tensor-parallel attributes on weights)
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def stage_layout(args) -> StageLayout:
    return StageLayout(
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pipeline_size=args.pipeline_model_parallel_size,
        tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
        tensor_size=args.tensor_model_parallel_size,
        num_layers=args.num_layers,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
    )


def build_stage_model(args, vocab_size: int, device: torch.device) -> torch.nn.Module:
    if args.emulated_forward_ms is not None:
        return EmulatedStage(args.emulated_forward_ms, args.emulated_backward_ms, args.hidden_size)
    config = transformer_config(args, device)
    return build_gpt_stage(
        config,
        stage_layout(args),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        device=device,
        seed=args.seed,
    )


# ---------------------------------------------------------------------------- state
@dataclass
class TrainingState:
    iteration: int = 0
    consumed_train_samples: int = 0
    losses: list = field(default_factory=list)  # lm loss per iteration (last stage)
    validation: list = field(default_factory=list)
    tokens: int = 0
    train_time_s: float = 0.0
    cross_stage_collectives: int | None = None  # counted when MEGATRON_AUDIT_COLLECTIVES=1


def is_logging_rank() -> bool:
    """Megatron logs from the last pipeline stage (it has the loss); its first TP/DP rank."""
    return (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def is_stage_leader() -> bool:
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def print_rank_last(message: str) -> None:
    if is_logging_rank():
        print(message, flush=True)


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


# ---------------------------------------------------------------------------- the loop
def pretrain(args, forward_step_func) -> TrainingState:
    wall_start = time.perf_counter()
    device = initialize_distributed(args)
    print_rank_0(
        f"> world size {args.world_size}: tensor {args.tensor_model_parallel_size} x pipeline "
        f"{args.pipeline_model_parallel_size} x data {args.data_parallel_size}, backend "
        f"{dist.get_backend()}, schedule {args.pipeline_schedule}, {args.num_microbatches} "
        f"microbatches per step"
    )
    tokenizer = build_tokenizer(
        args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
    model = build_stage_model(args, args.padded_vocab_size, device)
    optimizer = build_optimizer(model, args)
    scheduler = build_lr_scheduler(optimizer, args)
    step_func = StageOptimizerStep(
        model,
        optimizer,
        scheduler,
        data_parallel_group=parallel_state.get_data_parallel_group(),
        grad_norm_group=(
            parallel_state.get_model_parallel_group()
            if args.pipeline_schedule == "1f1b"
            else parallel_state.get_tensor_model_parallel_group()
        ),
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        clip_grad=args.clip_grad,
    )
    state = TrainingState()
    if args.load:
        state.iteration, state.consumed_train_samples = checkpointing.load(
            args.load, model=model, optimizer=optimizer, scheduler=scheduler
        )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    runtime = StageRuntime(
        build_pipeline_context(device),
        model,
        tensor_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
        dtype=dtype,
        record_trace=args.timeline_file is not None,
        deterministic=args.deterministic_mode,
    )
    attach_stage_runtime(model, runtime)
    train_iter, valid_iter, _ = build_data_iterators(
        data_path=None if args.mock_data else args.data_path,
        mock_data=args.mock_data,
        split=args.split,
        seq_length=args.seq_length,
        seed=args.seed,
        tokenizer=tokenizer,
        data_cache_path=args.data_cache_path,
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=args.data_parallel_size,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=_eval_samples(args),
        test_samples=0,
        consumed_train_samples=state.consumed_train_samples,
    )
    writer = _tensorboard_writer(args)
    dist.barrier()  # everyone built; from here on only the schedule's own traffic
    print_rank_0(f"> setup done in {time.perf_counter() - wall_start:.1f} s, training ...")

    with _maybe_audit() as audit:
        train(args, forward_step_func, model, runtime, step_func, train_iter, valid_iter, state,
              writer, audit)  # fmt: skip
    if audit_requested():
        state.cross_stage_collectives = len(audit.violations)

    if args.timeline_file:
        _write_timelines(args, runtime)
    _write_summary(args, state, runtime, step_func, optimizer, wall_start)
    if writer is not None:
        writer.close()
    parallel_state.destroy_model_parallel()
    return state


@contextlib.contextmanager
def _maybe_audit():
    if not audit_requested():
        yield CollectiveAudit()  # records nothing: no collective is wrapped
        return
    with record_cross_stage_collectives(ranks_of_my_stage()) as audit:
        yield audit


def _eval_samples(args) -> int:
    evaluations = args.train_iters // args.eval_interval
    return args.eval_iters * args.global_batch_size if evaluations and args.eval_iters else 0


def drain_points(args, start_iteration: int) -> list[int]:
    """Iterations after which the pipeline must be empty: evaluation, checkpoint, the end."""
    points = {args.train_iters}
    for interval in (args.eval_interval if args.eval_iters else None, args.save_interval):
        if interval:
            points.update(range(interval, args.train_iters + 1, interval))
    return sorted(p for p in points if p > start_iteration)


def train(args, forward_step_func, model, runtime, step_func, train_iter, valid_iter, state,
          writer, audit) -> None:  # fmt: skip
    schedule_function = get_forward_backward_func(args.pipeline_schedule)
    drains = drain_points(args, state.iteration)
    m = args.num_microbatches
    interval_start, interval_losses = time.perf_counter(), []
    train_start = time.perf_counter()
    while state.iteration < args.train_iters:
        iteration = state.iteration + 1
        next_drain = next(p for p in drains if p >= iteration)
        loss_dicts = schedule_function(
            forward_step_func=forward_step_func,
            data_iterator=train_iter,
            model=model,
            num_microbatches=m,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            optimizer_step_func=step_func,
            microbatches_before_drain=(next_drain - iteration + 1) * m,
        )
        state.iteration = iteration
        state.consumed_train_samples += args.global_batch_size
        state.tokens += args.global_batch_size * args.seq_length
        if parallel_state.is_pipeline_last_stage():
            loss = _average_loss(loss_dicts)
            state.losses.append(loss)
            interval_losses.append(loss)
        if iteration % args.log_interval == 0:
            elapsed = time.perf_counter() - interval_start
            _log_iteration(args, state, runtime, step_func, interval_losses, elapsed, writer)
            interval_start, interval_losses = time.perf_counter(), []
        if args.eval_iters and iteration % args.eval_interval == 0:
            evaluate(args, forward_step_func, model, valid_iter, state, writer)
            interval_start = time.perf_counter()  # evaluation time is not iteration time
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            with audit.paused():  # the pipeline is drained here: not a training step
                checkpointing.save(
                    args.save, state, model, step_func.optimizer, step_func.scheduler
                )
    state.train_time_s = time.perf_counter() - train_start
    if args.save and not (args.save_interval and state.iteration % args.save_interval == 0):
        with audit.paused():
            checkpointing.save(args.save, state, model, step_func.optimizer, step_func.scheduler)


def _average_loss(loss_dicts: list[dict]) -> float:
    """Mean 'lm loss' over the step's microbatches and the stage's data-parallel ranks."""
    local = torch.stack([d["lm loss"].detach().float().cpu() for d in loss_dicts]).mean()
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        local = local.to(_group_device(group))
        dist.all_reduce(local, group=group)
        local = local.cpu() / dist.get_world_size(group)
    return float(local)


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def evaluate(args, forward_step_func, model, valid_iter, state, writer) -> None:
    if valid_iter is None:
        return
    model.eval()
    schedule_function = get_forward_backward_func(args.pipeline_schedule)
    losses = []
    for _ in range(args.eval_iters):
        loss_dicts = schedule_function(
            forward_step_func=forward_step_func,
            data_iterator=valid_iter,
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=True,
        )
        if parallel_state.is_pipeline_last_stage():
            losses.append(_average_loss(loss_dicts))
    model.train()
    if parallel_state.is_pipeline_last_stage():
        loss = sum(losses) / len(losses)
        state.validation.append({"iteration": state.iteration, "lm loss": loss})
        line = f" validation loss at iteration {state.iteration} | lm loss value: {loss:.6E} |"
        print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        if writer is not None and is_logging_rank():
            writer.add_scalar("lm loss validation", loss, state.iteration)


def _log_iteration(args, state, runtime, step_func, losses, elapsed, writer) -> None:
    if not is_logging_rank():
        return
    per_iteration_ms = 1000.0 * elapsed / args.log_interval
    loss = sum(losses) / len(losses)
    drift = runtime.drift_by_stage()
    drift_text = " ".join(f"{mx}/{mean:.2f}" for mx, mean in drift)
    report = step_func.last
    print(
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {state.iteration:8d}/"
        f"{args.train_iters:8d} | consumed samples: {state.consumed_train_samples:12d} | "
        f"elapsed time per iteration (ms): {per_iteration_ms:.1f} | "
        f"learning rate: {report.learning_rate:.6E} | "
        f"global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} | "
        f"grad norm: {report.grad_norm:.3f} | weight drift max/mean by stage: {drift_text} | "
        f"number of skipped iterations:   0 | number of nan iterations:   0 |",
        flush=True,
    )
    if writer is not None:
        step = state.iteration
        writer.add_scalar("lm loss", loss, step)
        writer.add_scalar("learning-rate", report.learning_rate, step)
        writer.add_scalar("grad-norm", report.grad_norm, step)
        writer.add_scalar("iteration-time", per_iteration_ms / 1000.0, step)
        for stage, (max_drift, mean_drift) in enumerate(drift):
            writer.add_scalar(f"drift/stage{stage}/max", max_drift, step)
            writer.add_scalar(f"drift/stage{stage}/mean", mean_drift, step)


def _tensorboard_writer(args):
    if not args.tensorboard_dir or not is_logging_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir)


# ---------------------------------------------------------------------------- metrics
def _stage_report(args, runtime, step_func, optimizer) -> dict:
    params = [p for p in runtime.model.parameters()]
    report = runtime.stats.to_dict()
    report.update(
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        optimizer_state_bytes=_optimizer_state_bytes(optimizer),
        extra_weight_versions=0,
        runtime_overhead_us_per_action=runtime.overhead_per_action_us(),
    )
    return report


def _optimizer_state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                total += value.numel() * value.element_size()
    return total


def _write_summary(args, state, runtime, step_func, optimizer, wall_start) -> None:
    """Gather every rank's figures (the pipeline is drained: this is not a training step)."""
    mine = {
        "rank": dist.get_rank(),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "leader": is_stage_leader(),
        "report": _stage_report(args, runtime, step_func, optimizer),
        "losses": state.losses if is_logging_rank() else None,
        "validation": state.validation if is_logging_rank() else None,
        "train_time_s": state.train_time_s,
        "cross_stage_collectives": state.cross_stage_collectives,
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0 or not args.metrics_dir:
        return
    logger = next(g for g in gathered if g["losses"] is not None)
    stages = sorted((g for g in gathered if g["leader"]), key=lambda g: g["stage"])
    elapsed = max(g["train_time_s"] for g in gathered)
    summary = {
        "schedule": args.pipeline_schedule,
        "pipeline_stages": args.pipeline_model_parallel_size,
        "tensor_parallel": args.tensor_model_parallel_size,
        "data_parallel": args.data_parallel_size,
        "num_microbatches": args.num_microbatches,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "seq_length": args.seq_length,
        "iterations": state.iteration,
        "loss": logger["losses"],
        "final_loss": logger["losses"][-1] if logger["losses"] else None,
        "validation": logger["validation"],
        "elapsed_s": elapsed,
        "tokens_per_second": state.tokens / elapsed if elapsed > 0 else 0.0,
        "wall_s_including_setup": time.perf_counter() - wall_start,
        "stages": [g["report"] for g in stages],
    }
    if audit_requested():
        summary["cross_stage_collectives"] = sum(g["cross_stage_collectives"] for g in gathered)
    os.makedirs(args.metrics_dir, exist_ok=True)
    checkpointing.atomic_write_text(
        os.path.join(args.metrics_dir, "summary.json"), json.dumps(summary, indent=2)
    )
    print(f"> wrote {os.path.join(args.metrics_dir, 'summary.json')}", flush=True)


def _write_timelines(args, runtime) -> None:
    gathered: list = [None] * dist.get_world_size()
    events = runtime.trace if is_stage_leader() else []
    dist.all_gather_object(gathered, events)
    if dist.get_rank() == 0:
        merged = [event for events in gathered for event in events]
        origin = min((e.start_s for e in merged), default=0.0)  # one host's monotonic clock
        shifted = [replace(e, start_s=e.start_s - origin, end_s=e.end_s - origin) for e in merged]
        write_chrome_trace(
            args.timeline_file, shifted, process_name=f"{args.pipeline_schedule} run"
        )
        print(f"> wrote timeline {args.timeline_file}", flush=True)
