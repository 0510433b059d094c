"""Single-process reference for delayed updates: the gradient of step t's batch is taken at
the weights of `delay` steps earlier and applied to the current ones,

    x(t+1) = x(t) - U(grad f_t(x(max(t - delay, 0))))

With delay 1 this is PipeDream-2BW's constant one-step delay (two weight versions, the
update of batch t computed with version t-1): `--pipeline-schedule 2bw` on any number of
stages gives these numbers when no clipping happens (docs/weight_stashing.md); delay 0 is synchronous training, the same
arithmetic as a non-pipelined 1F1B-flush run. Each batch is used exactly once, at its own
step. `sync_warmup_iters` / `sync_cooldown_iters` run the first / last K steps with delay 0
(a synchronous start and cooldown), the delay corrections there stepping as with no delay.

Everything else is the project's own: megatron-core's GPT built by `build_gpt_stage` (one
stage, the layout-independent initialization), the data iterators, `build_optimizer` (so
every `--optimizer`, `--async-error-feedback` and `--delay-compensation-lambda`), the LR
schedule and `StageOptimizerStep` (clipping over the whole model). The reported training
loss of a step is the loss the step's gradient came from, i.e. at the stale weights. With MoE
the aux losses take the main loss's gradient scale, the expert bias is updated before each
step, and a version holds the expert bias with the weights (a stale gradient is taken with the
bias of its weights, as 2BW's weight stash keeps it).

    from megatron.studies.delayed_reference import run_delayed
    result = run_delayed(args, delay=1)   # args: validated pretrain_gpt.py flags
"""

import os
import socket
from collections import deque
from dataclasses import dataclass, field

import torch

from megatron.model.mtp import set_mtp_loss_scale
from megatron.training.optimizer.delay_mitigation import set_synchronous_phase


@dataclass
class DelayedRun:
    losses: list[float] = field(default_factory=list)  # training lm loss per step
    validation_loss: float | None = None  # after the last step, over --eval-iters batches
    wall_s: float = 0.0


def ensure_single_process_groups() -> None:
    """torch.distributed (gloo, world size 1) and megatron-core's parallel state, once."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def prepare_host(config, device) -> None:
    """What `pretrain` sets up for megatron-core's CUDA-minded parts on a CPU run: with MoE
    layers or --sequence-parallel, host buffers, streams and RNG tracker (one tensor rank)."""
    from megatron.model.gpt import run_sequence_parallel_on_host

    moe = config.moe is not None
    if (config.parallel.sequence_parallel or moe) and device.type == "cpu":
        run_sequence_parallel_on_host(config.training.seed, 0, moe=moe)


def build_local_stage(config, layout, device):
    """One stage's model (`layout`) and its optimizer step with no process group, so that one
    process can train it: what `pretrain` builds on a rank (the same builder, `build_chunk`),
    less the groups."""
    from megatron.model.build import build_chunk, transformer_config
    from megatron.training.optimizer.build import (
        StageOptimizerStep,
        build_lr_scheduler,
        build_optimizer,
        stage_lr_scale,
    )
    from megatron.training.optimizer.delay_lookahead import for_stage
    from megatron.training.optimizer.lr_per_iteration import per_iteration

    model = build_chunk(config, transformer_config(config, device), layout, device)
    stage_config = for_stage(config.optimizer, config.pipeline, config.training,
                             layout.pipeline_rank)  # fmt: skip
    optimizer = build_optimizer(model, stage_config)
    # --paci-stage-lr-scale
    scale = stage_lr_scale(config.pipeline, config.training, layout.pipeline_rank)
    scheduler = build_lr_scheduler(optimizer, config.lr, lr_scale=scale)
    plan, microbatches = config.pipeline.plan, config.training.num_microbatches
    step = StageOptimizerStep(
        model,
        optimizer,
        per_iteration(scheduler, plan, microbatches),  # PipeDream steps m times per iteration
        data_parallel_group=None,
        grad_norm_group=None,
        tensor_parallel_rank=0,
        clip_grad=config.training.clip_grad,
    )
    return model, step


def _build(config):
    """Model, optimizer step and data iterators, as `pretrain` builds them on one stage."""
    from megatron.model.build import stage_layout
    from megatron.training.data.datasets import data_iterators_of_run
    from megatron.training.tokenizer.tokenizer import build_tokenizer_of_run

    ensure_single_process_groups()
    torch.manual_seed(config.training.seed)
    device = torch.device("cpu")
    prepare_host(config, device)
    tokenizer = build_tokenizer_of_run(config.data)
    config = config.with_vocabulary(tokenizer.vocab_size)
    model, step = build_local_stage(config, stage_layout(config), device)
    training = config.training
    train, valid = data_iterators_of_run(
        config,
        tokenizer,
        train_samples=training.train_iters * training.global_batch_size,
        valid_samples=(
            training.eval_iters * training.global_batch_size if training.eval_iters else 0
        ),
    )
    return model, step, train, valid


def _microbatch_losses(model, data_iterator, count: int, *, backward: bool) -> float:
    """Mean lm loss over `count` microbatches; with backward, gradients of the mean."""
    from megatron.training.gpt_step import forward_step

    total = 0.0
    for _ in range(count):
        output, loss_func = forward_step(data_iterator, model)
        loss, reduced = loss_func(output)
        if backward:
            (loss / count).backward()
        total += float(reduced["lm loss"])
    return total / count


def _swap_in(params: list[torch.Tensor], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Put `values` into the parameters; return what was there."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)
    return saved


def synchronous_at(step: int, train_iters: int, warmup: int, cooldown: int) -> bool:
    """Whether `step` (0-based) is in the synchronous start or cooldown."""
    return step < warmup or step >= train_iters - cooldown


def delay_at(step: int, train_iters: int, delay: int, warmup: int, cooldown: int) -> int:
    """The delay of `step` (0-based): 0 during the synchronous start and cooldown."""
    return 0 if synchronous_at(step, train_iters, warmup, cooldown) else delay


def run_delayed(args, *, delay: int, sync_warmup_iters: int = 0, sync_cooldown_iters: int = 0,
                evaluate: bool = True) -> DelayedRun:  # fmt: skip
    """Train --train-iters steps with gradients `delay` steps stale (see module doc); `args`:
    the validated flags (`parse_reference_args`), read once into the run's configuration."""
    import time

    from megatron.training.config import RunConfig

    start = time.perf_counter()
    config = RunConfig.from_args(args)
    model, step, train, valid = _build(config)
    iterations, microbatches = config.training.train_iters, config.training.num_microbatches
    moe = _MoE(model, config.moe is not None, microbatches)
    if config.model.mtp_num_layers:  # the MTP loss's gradient scale is the main loss's
        set_mtp_loss_scale(1.0 / microbatches)
    # a version: the trainable weights and, with MoE, the expert bias that routes (as the
    # weight stash of 2BW keeps it)
    params = [p for p in model.parameters() if p.requires_grad] + moe.routing_buffers
    versions = deque([[p.detach().clone() for p in params]], maxlen=delay + 1)
    result = DelayedRun()
    for t in range(iterations):
        stale = delay_at(t, iterations, delay, sync_warmup_iters, sync_cooldown_iters)
        synchronous = synchronous_at(t, iterations, sync_warmup_iters, sync_cooldown_iters)
        set_synchronous_phase(step.optimizer, synchronous)  # the corrections: nothing to correct
        stale = min(stale, len(versions) - 1)  # x(max(t - delay, 0))
        current = _swap_in(params, versions[-1 - stale]) if stale else None
        loss = _microbatch_losses(model, train, microbatches, backward=True)
        if current is not None:
            _swap_in(params, current)  # gradients stay in .grad; the update hits x(t)
        moe.before_step()
        step()
        result.losses.append(loss)
        if delay:
            versions.append([p.detach().clone() for p in params])
    if evaluate and valid is not None and config.training.eval_iters:
        model.eval()
        with torch.no_grad():
            count = config.training.eval_iters * microbatches
            result.validation_loss = _microbatch_losses(model, valid, count, backward=False)
        model.train()
    result.wall_s = time.perf_counter() - start
    return result


class _MoE:
    """MoE in one process, as the training loop has it: the aux and z losses' gradient scale
    is the main loss's, 1 / microbatches per step; before each step the expert bias is updated
    from the step's token counts and the per-step counters are reset."""

    def __init__(self, model, active: bool, microbatches: int):
        self.active = active
        self.routing_buffers, self.hooks = [], None
        if self.active:
            from megatron.model.moe import MoEStepHooks, routing_buffers, set_aux_loss_scale

            set_aux_loss_scale(1.0 / microbatches)
            self.routing_buffers, self.hooks = routing_buffers(model), MoEStepHooks(model)

    def before_step(self) -> None:
        if self.hooks is not None:
            self.hooks.before_step()


def parse_reference_args(argv: list[str]):
    """pretrain_gpt.py flags, validated for one process (parallel sizes are set to 1: the
    reference is the whole model on one rank)."""
    from megatron.training.arguments import build_parser

    args = build_parser().parse_args(argv)
    args.tensor_model_parallel_size = 1
    as_one_stage(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return args


def as_one_stage(args) -> None:
    """The flags of the whole model on one pipeline stage (the layer-split flags cleared),
    validated again for one process."""
    from megatron.training.arguments import validate_args

    args.pipeline_model_parallel_size = 1
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    args.account_for_embedding_in_pipeline_split = False
    args.account_for_loss_in_pipeline_split = False
    args.pipeline_model_parallel_layout = None
    validate_args(args, world_size=1)
