"""What a run reports: iteration lines, TensorBoard scalars, summary.json, timelines.

Megatron's convention: the last pipeline stage has the loss, so its first tensor- and
data-parallel rank logs. Per-stage figures (drift, memory, time) are gathered once, when the
run ends and the pipeline is drained, for `summary.json`.
"""

import json
import math
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.pipeline.audit import audit_requested
from megatron.pipeline.trace import write_chrome_trace

from .checkpointing import atomic_write_text
from .errors import UserError


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


def log_iteration(args, state, runtime, step_func, losses, elapsed, writer) -> None:
    if not is_logging_rank():
        return
    per_iteration_ms = 1000.0 * elapsed / args.log_interval
    loss = sum(losses) / len(losses)
    drift = runtime.drift_by_stage()
    drift_text = " ".join(f"{mx}/{mean:.2f}" for mx, mean in drift)
    report = step_func.last
    skipped, nans = _interval_counts(state, step_func)
    print(
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {state.iteration:8d}/"
        f"{args.train_iters:8d} | consumed samples: {state.consumed_train_samples:12d} | "
        f"elapsed time per iteration (ms): {per_iteration_ms:.1f} | "
        f"learning rate: {report.learning_rate:.6E} | "
        f"global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} | "
        f"grad norm: {report.grad_norm:.3f} | weight drift max/mean by stage: {drift_text} | "
        f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |",
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


def _interval_counts(state, step_func) -> tuple[int, int]:
    """Skipped steps (this, the last, stage's) and non-finite losses since the last log line."""
    totals = (step_func.skipped_steps, state.nan_iterations)
    since = tuple(now - before for now, before in zip(totals, state.logged_counts))
    state.logged_counts = totals
    return since


def tensorboard_writer(args):
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
        skipped_steps=step_func.skipped_steps,
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


def write_summary(args, state, runtime, step_func, optimizer, wall_start) -> None:
    """Gather every rank's figures (the pipeline is drained: this is not a training step)."""
    mine = {
        "rank": dist.get_rank(),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "leader": is_stage_leader(),
        "report": _stage_report(args, runtime, step_func, optimizer),
        "losses": state.losses if is_logging_rank() else None,
        "validation": state.validation if is_logging_rank() else None,
        "nan_iterations": state.nan_iterations,
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
        "skipped_steps_by_stage": [g["report"]["skipped_steps"] for g in stages],
        "nan_iterations": logger["nan_iterations"],
        "rollbacks": state.rollbacks,
        "diverged": state.diverged,
        "elapsed_s": elapsed,
        "tokens_per_second": state.tokens / elapsed if elapsed > 0 else 0.0,
        "wall_s_including_setup": time.perf_counter() - wall_start,
        "stages": [g["report"] for g in stages],
    }
    if audit_requested():
        summary["cross_stage_collectives"] = sum(g["cross_stage_collectives"] for g in gathered)
    try:
        os.makedirs(args.metrics_dir, exist_ok=True)
    except OSError as error:
        raise UserError(f"--metrics-dir {args.metrics_dir}: {error.strerror}") from None
    text = json.dumps(finite_or_none(summary), indent=2, allow_nan=False)
    atomic_write_text(os.path.join(args.metrics_dir, "summary.json"), text)
    print(f"> wrote {os.path.join(args.metrics_dir, 'summary.json')}", flush=True)


def finite_or_none(value):
    """JSON has no NaN or Infinity: a non-finite number is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_timelines(args, runtime) -> None:
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
