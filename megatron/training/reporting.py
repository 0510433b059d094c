"""What a run reports: iteration lines, TensorBoard scalars, summary.json, timelines.

Megatron's convention: the last pipeline stage has the loss, so its first tensor- and
data-parallel rank logs. Per-stage figures (drift, memory, time) are gathered once, when the
run ends and the pipeline is drained, for `summary.json`.
"""

import hashlib
import json
import math
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.common.errors import UserError
from megatron.distributed import fsdp
from megatron.pipeline.audit import audit_requested
from megatron.pipeline.deferred_wgrad import deferral_report
from megatron.pipeline.trace import SpanEvent, write_chrome_trace
from megatron.training.checkpointing.save_load import atomic_write_text


def holds_the_loss(plan) -> bool:
    """Whether this rank runs the model's last (virtual) stage, which computes the loss: the
    last pipeline rank, except on the V placement (ZB-V, DualPipeV), where it is rank 0.
    `plan`: the run's `PipelinePlan`."""
    placement = plan.placement
    rank = parallel_state.get_pipeline_model_parallel_rank()
    if placement is None:
        return rank == plan.num_stages - 1
    return placement.locate(placement.num_virtual_stages - 1)[0] == rank


def is_logging_rank(plan) -> bool:
    """Megatron logs from the rank with the loss (`holds_the_loss`); its first TP/CP/DP rank."""
    return holds_the_loss(plan) and is_stage_leader()


def is_stage_leader() -> bool:
    """The first tensor-, context- and data-parallel rank of its stage."""
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def print_rank_last(plan, message: str) -> None:
    if is_logging_rank(plan):
        print(message, flush=True)


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


# ---------------------------------------------------------------------------- the loop


def log_iteration(config, state, runtime, step_func, losses, elapsed, writer, fields=None) -> None:
    """Megatron's iteration line; `fields` ('num zeros', 'params norm') come after the grad
    norm, where Megatron prints them."""
    if not is_logging_rank(config.pipeline.plan):
        return
    per_iteration_ms = 1000.0 * elapsed / config.logging.log_interval
    loss = sum(losses) / len(losses)
    drift = runtime.drift_by_stage()
    drift_text = " ".join(f"{mx}/{mean:.2f}" for mx, mean in drift)
    report = step_func.last
    fields = fields or {}
    skipped, nans = _interval_counts(state, step_func)
    batch = (
        getattr(state, "global_batch_size", 0) or config.training.global_batch_size
    )  # ramps change it
    throughput = ""
    if config.logging.log_throughput:
        tflops = floating_point_operations(config, batch) / (per_iteration_ms / 1000.0) / 1e12
        throughput = (
            f"throughput per GPU (TFLOP/s/GPU): {tflops / config.parallel.world_size:.1f} | "
        )
    known = (("num zeros", ".1f"), ("params norm", ".3f"))
    extra = "".join(f"{name}: {fields[name]:{form}} | " for name, form in known if name in fields)
    # other fields (MoE: this stage's aux losses and load imbalance, moe/training_hooks.py)
    extra += "".join(f"{name}: {value:.6E} | " for name, value in fields.items()
                     if name not in dict(known))  # fmt: skip
    reduction = ""
    times = getattr(step_func, "reduction_times", None)
    if times is not None and config.parallel.data_parallel_size > 1:
        reduce_s, exposed_s = times.take()
        per_iteration = 1000.0 / config.logging.log_interval
        reduction = (f"dp reduce/exposed per iteration (ms): {reduce_s * per_iteration:.1f}/"
                     f"{exposed_s * per_iteration:.1f} | ")  # fmt: skip
    # Megatron's field order; our data-parallel reduction and per-stage weight drift come last.
    print(
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {state.iteration:8d}/"
        f"{config.training.train_iters:8d} | consumed samples: {state.consumed_train_samples:12d} | "
        f"elapsed time per iteration (ms): {per_iteration_ms:.1f} | {throughput}"
        f"learning rate: {report.learning_rate:.6E} | "
        f"global batch size: {batch:5d} | lm loss: {loss:.6E} | "
        f"loss scale: {step_func.loss_scale:.1f} | grad norm: {report.grad_norm:.3f} | {extra}"
        f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} | "
        f"{reduction}weight drift max/mean by stage: {drift_text} |",
        flush=True,
    )
    if writer is not None:
        _write_scalars(config, writer, state.iteration, loss, report, per_iteration_ms, drift,
                       step_func.loss_scale)  # fmt: skip
        for name, value in fields.items():
            writer.add_scalar(name.replace(" ", "-"), value, state.iteration)
        if config.logging.log_timers_to_tensorboard:
            _write_timers(config, writer, state.iteration, per_iteration_ms, step_func)
        if config.logging.log_memory_to_tensorboard:
            _write_memory(writer, state.iteration, runtime)


def floating_point_operations(config, global_batch_size: int | None = None) -> float:
    """Model FLOPs of one iteration (forward and backward, global batch), Megatron's formula
    for a dense GPT: 3 passes x 2 FLOPs per multiply-add x 2 (QKV/proj, MLP, logits) terms."""
    heads, groups = (
        config.model.num_attention_heads,
        config.model.num_query_groups or config.model.num_attention_heads,
    )
    h, s, layers = config.model.hidden_size, config.model.seq_length, config.model.num_layers
    query_ratio = config.model.kv_channels * heads / h
    gated = 1.5 if config.model.swiglu else 1.0
    per_layer = (
        (1 + groups / heads + s / h) * query_ratio
        + (config.model.ffn_hidden_size / h) * gated
        + config.model.padded_vocab_size / (2 * layers * h)
    )
    batch = global_batch_size or config.training.global_batch_size
    return 12.0 * batch * s * layers * h * h * per_layer


def _write_scalars(config, writer, step, loss, report, per_iteration_ms, drift, loss_scale) -> None:
    writer.add_scalar("lm loss", loss, step)
    writer.add_scalar("learning-rate", report.learning_rate, step)
    writer.add_scalar("grad-norm", report.grad_norm, step)
    writer.add_scalar("loss-scale", loss_scale, step)
    writer.add_scalar("iteration-time", per_iteration_ms / 1000.0, step)
    for stage, (max_drift, mean_drift) in enumerate(drift):
        writer.add_scalar(f"drift/stage{stage}/max", max_drift, step)
        writer.add_scalar(f"drift/stage{stage}/mean", mean_drift, step)


def _write_timers(config, writer, step, per_iteration_ms, step_func) -> None:
    """The logging stage's time per iteration in its optimizer step and outside it."""
    optimizer_s = step_func.step_seconds / config.logging.log_interval
    writer.add_scalar("optimizer-time", optimizer_s, step)
    writer.add_scalar("forward-backward-time", per_iteration_ms / 1000.0 - optimizer_s, step)


def _write_memory(writer, step, runtime) -> None:
    """The logging stage's memory: CUDA allocator figures on a GPU, peak RSS on a CPU."""
    device = next(runtime.model.parameters()).device
    if device.type == "cuda":
        writer.add_scalar("mem-allocated-bytes", torch.cuda.memory_allocated(device), step)
        writer.add_scalar("mem-max-allocated-bytes", torch.cuda.max_memory_allocated(device), step)
        writer.add_scalar("mem-reserved-bytes", torch.cuda.memory_reserved(device), step)
        return
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    writer.add_scalar("mem-max-rss-bytes", peak_kib * 1024, step)


def _interval_counts(state, step_func) -> tuple[int, int]:
    """Skipped steps (this, the last, stage's) and non-finite losses since the last log line."""
    totals = (step_func.skipped_steps, state.nan_iterations)
    since = tuple(now - before for now, before in zip(totals, state.logged_counts))
    state.logged_counts = totals
    return since


def tensorboard_writer(config):
    """The logging rank's scalar writer: TensorBoard (--tensorboard-dir), W&B
    (--wandb-project, wandb_run.py), both, or None."""
    from megatron.training.tracking.wandb_run import ScalarWriters, WandbWriter, wandb_enabled

    if not is_logging_rank(config.pipeline.plan):
        return None
    writers = []
    if config.logging.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writers.append(SummaryWriter(log_dir=config.logging.tensorboard_dir))
    if wandb_enabled(config.logging):
        writers.append(WandbWriter(config.logging, config.checkpoint.save))
    if len(writers) > 1:
        return ScalarWriters(writers)
    return writers[0] if writers else None


# ---------------------------------------------------------------------------- metrics
def _stage_report(config, runtime, step_func, optimizer) -> dict:
    params = [p for p in runtime.model.parameters()]
    report = runtime.stats.to_dict()
    report.update(
        param_bytes=_param_bytes(params),  # this rank's rows of a fully sharded model
        grad_bytes=_param_bytes([p for p in params if p.requires_grad]),
        optimizer_state_bytes=_optimizer_state_bytes(optimizer),
        main_param_bytes=step_func.gradients.main_param_bytes,  # fp32 main weights, this rank
        loss_scale=step_func.loss_scale,
        skipped_steps=step_func.skipped_steps,
        runtime_overhead_us_per_action=runtime.overhead_per_action_us(),
    )
    times = getattr(step_func, "reduction_times", None)  # the data-parallel reduction
    if times is not None:
        report.update(times.report())
    decoder = getattr(getattr(runtime.model, "decoder", None), "layers", None)
    if decoder is not None:  # the stage's transformer layers: count, first global index
        report["layers"] = len(decoder)
        report["first_layer"] = decoder[0].layer_number - 1 if len(decoder) else None
    chunks = getattr(runtime.model, "chunks", None)
    if chunks is not None:  # virtual stages: per chunk, its global layer indices (GPT chunks)
        if hasattr(chunks[0], "decoder"):
            report["chunk_layers"] = [[layer.layer_number - 1 for layer in chunk.decoder.layers]
                                      for chunk in chunks]  # fmt: skip
            report["layers"] = sum(len(layers) for layers in report["chunk_layers"])
        report["chunk_max_drift"] = [max(h, default=0) for h in runtime.chunk_drift]
    tied = [p for p in params if getattr(p, "shared_embedding", False)]
    if tied:  # this stage's copy of the tied embedding: equal on both stages at a drain
        report["tied_weight_sha256"] = _digest(tied[0])
    exchange = getattr(step_func, "tied_exchange", None)  # tied embeddings, asynchronous
    if exchange is not None:
        report["tied_embedding"] = exchange.report()
    moe_stats = getattr(step_func, "moe_stats", None)  # MoE: aux losses, load imbalance
    if moe_stats is not None and moe_stats.report():
        report["moe"] = moe_stats.report()
    deferred = deferral_report(runtime.model)  # --defer-embedding-wgrad-compute
    if deferred is not None:
        report["deferred_wgrad"] = deferred
    mtp_losses = getattr(step_func, "mtp_losses", None)  # multi-token prediction, by interval
    if mtp_losses is not None and mtp_losses.history:
        report["mtp_losses"] = mtp_losses.history
    indexer_losses = getattr(step_func, "indexer_losses", None)  # DeepSeek sparse attention
    if indexer_losses is not None and indexer_losses.history:
        report["indexer_losses"] = indexer_losses.history
    return report


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _param_bytes(params) -> int:
    return sum(fsdp.local(p).numel() * fsdp.local(p).element_size() for p in params)


def _optimizer_state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                total += value.numel() * value.element_size()
    return total


def write_summary(config, state, runtime, step_func, optimizer, wall_start) -> None:
    """Gather every rank's figures (the pipeline is drained: this is not a training step)."""
    mine = {
        "rank": dist.get_rank(),
        "optimizer_state_bytes": _optimizer_state_bytes(optimizer),
        "param_bytes": _param_bytes(list(runtime.model.parameters())),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "leader": is_stage_leader(),
        "report": _stage_report(config, runtime, step_func, optimizer),
        "losses": state.losses if is_logging_rank(config.pipeline.plan) else None,
        "validation": state.validation if is_logging_rank(config.pipeline.plan) else None,
        "nan_iterations": state.nan_iterations,
        "train_time_s": state.train_time_s,
        "cross_stage_collectives": state.cross_stage_collectives,
        "weight_hash_checks": state.weight_hash_checks,
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0 or not config.logging.metrics_dir:
        return
    logger = next(g for g in gathered if g["losses"] is not None)
    stages = sorted((g for g in gathered if g["leader"]), key=lambda g: g["stage"])
    elapsed = max(g["train_time_s"] for g in gathered)
    summary = {
        "schedule": config.pipeline.plan.name,
        "pipeline_stages": config.parallel.pipeline_model_parallel_size,
        "tensor_parallel": config.parallel.tensor_model_parallel_size,
        "data_parallel": config.parallel.data_parallel_size,
        "num_microbatches": config.training.num_microbatches,
        "micro_batch_size": config.training.micro_batch_size,
        "global_batch_size": config.training.global_batch_size,
        "seq_length": config.model.seq_length,
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
        # iterations whose --check-weight-hash-across-dp-replicas-interval check passed
        "weight_hash_checks_by_stage": [g["weight_hash_checks"] for g in stages],
        # every rank's (the stage figures above are its first TP/DP rank's)
        "optimizer_state_bytes_by_rank": [g["optimizer_state_bytes"] for g in gathered],
        "param_bytes_by_rank": [g["param_bytes"] for g in gathered],
    }
    if audit_requested():
        summary["cross_stage_collectives"] = sum(g["cross_stage_collectives"] for g in gathered)
    try:
        os.makedirs(config.logging.metrics_dir, exist_ok=True)
    except OSError as error:
        raise UserError(f"--metrics-dir {config.logging.metrics_dir}: {error.strerror}") from None
    text = json.dumps(finite_or_none(summary), indent=2, allow_nan=False)
    atomic_write_text(os.path.join(config.logging.metrics_dir, "summary.json"), text)
    print(f"> wrote {os.path.join(config.logging.metrics_dir, 'summary.json')}", flush=True)


def finite_or_none(value):
    """JSON has no NaN or Infinity: a non-finite number is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_timelines(config, runtime, step_func=None) -> None:
    """The stage leaders' actions, and their data-parallel reductions and the waits for them
    (a second track per stage), in one Chrome trace."""
    gathered: list = [None] * dist.get_world_size()
    times = getattr(step_func, "reduction_times", None)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    spans = [SpanEvent(stage, f"data-parallel {name}", start, end)
             for name, start, end in (times.events or [])] if times is not None else []  # fmt: skip
    mine = (runtime.trace, spans) if is_stage_leader() else ([], [])
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        merged = [event for events, _ in gathered for event in events]
        merged_spans = [span for _, spans in gathered for span in spans]
        origin = min((e.start_s for e in merged), default=0.0)  # one host's monotonic clock
        shifted = [replace(e, start_s=e.start_s - origin, end_s=e.end_s - origin) for e in merged]
        shifted_spans = [replace(s, start_s=s.start_s - origin, end_s=s.end_s - origin)
                         for s in merged_spans]  # fmt: skip
        write_chrome_trace(
            config.logging.timeline_file,
            shifted,
            process_name=f"{config.pipeline.plan.name} run",
            spans=shifted_spans,
        )
        print(f"> wrote timeline {config.logging.timeline_file}", flush=True)
