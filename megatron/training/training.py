"""The pretraining loop: set-up, iterations, evaluation, logging, metrics, checkpoints.

`pretrain(args, forward_step_func)` is what `pretrain_gpt.py` calls. The loop is the same for
every schedule; the schedule function (from `get_forward_backward_func`) steps each stage's
optimizer itself when a step is due.
"""

import contextlib
import os
import time
from dataclasses import dataclass, field

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
from megatron.pipeline.schedules import get_schedule

from . import checkpointing
from .data import build_data_iterators
from .emulation import EmulatedStage
from .model import StageLayout, build_gpt_stage
from .optimizer import StageOptimizerStep, build_lr_scheduler, build_optimizer
from .reporting import (
    is_logging_rank,
    log_iteration,
    print_rank_0,
    print_rank_last,
    tensorboard_writer,
    write_summary,
    write_timelines,
)
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
        return EmulatedStage(
            args.emulated_forward_ms, args.emulated_backward_ms, args.hidden_size,
            noise_cv=args.emulated_noise_cv, seed=args.seed,
        )  # fmt: skip
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
            if get_schedule(args.pipeline_schedule).global_grad_norm
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
    writer = tensorboard_writer(args)
    dist.barrier()  # everyone built; from here on only the schedule's own traffic
    print_rank_0(f"> setup done in {time.perf_counter() - wall_start:.1f} s, training ...")

    with _maybe_audit() as audit:
        train(args, forward_step_func, model, runtime, step_func, train_iter, valid_iter, state,
              writer, audit)  # fmt: skip
    if audit_requested():
        state.cross_stage_collectives = len(audit.violations)

    if args.timeline_file:
        write_timelines(args, runtime)
    write_summary(args, state, runtime, step_func, optimizer, wall_start)
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
    schedule_function = get_forward_backward_func(args.pipeline_schedule, args.paci_arrival_rule)
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
            log_iteration(args, state, runtime, step_func, interval_losses, elapsed, writer)
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
    # On the model's device, which is the one the data-parallel group's backend expects.
    local = torch.stack([d["lm loss"].detach().float() for d in loss_dicts]).mean()
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
        local = local / dist.get_world_size(group)
    return float(local)


def evaluate(args, forward_step_func, model, valid_iter, state, writer) -> None:
    if valid_iter is None:
        return
    model.eval()
    schedule_function = get_forward_backward_func(args.pipeline_schedule, args.paci_arrival_rule)
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
