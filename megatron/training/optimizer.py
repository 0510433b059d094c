"""Optimizer, learning-rate schedule and the per-stage step callable handed to the schedules.

Torch optimizers on every device (megatron-core's wrappers are CUDA-only). The step does what
Megatron's does, in this order: average gradients over the stage's data-parallel group, clip
by the gradient norm, step, advance the LR schedule, clear gradients.

The gradient norm's reach is the one difference between schedules: 1F1B-flush reduces it over
the whole model (tensor x pipeline ranks), like Megatron; PACI only over the stage's tensor-
parallel ranks, because a pipeline-wide norm would be a global synchronization every step.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim < 2 or name.endswith("bias") or "norm" in name


def build_optimizer(model: torch.nn.Module, args):
    """`--optimizer`'s optimizer (optimizers.py), with the delay mitigations asked for."""
    from .delay_mitigation import with_delay_mitigation
    from .optimizers import build_suite_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    return with_delay_mitigation(build_suite_optimizer(model, args), params, args)


def _schedule_lengths(args) -> tuple[float, float]:
    """(warmup, decay) in iterations. A sample-based run (--train-samples) gives them in
    samples; with a constant global batch, samples / batch is Megatron's sample schedule.
    With --rampup-batch-size they stay in samples, and each step advances the schedule by
    its iteration's global batch (the training loop sets `scheduler_increment`), as Megatron."""
    if getattr(args, "rampup_batch_size", None) is not None:
        decay = args.lr_decay_samples or args.train_samples
        fraction = args.lr_warmup_fraction
        return (fraction * decay if fraction is not None else args.lr_warmup_samples), decay
    if getattr(args, "train_samples", None) is not None:
        batch = args.global_batch_size
        decay = (args.lr_decay_samples or args.train_samples) / batch
        warmup = args.lr_warmup_samples / batch
    else:
        decay = args.lr_decay_iters or args.train_iters
        warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
        warmup = warmup if getattr(args, "train_samples", None) is not None else int(warmup)
    return warmup, decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args) -> OptimizerParamScheduler:
    warmup_iters, decay_iters = _schedule_lengths(args)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        # Weight decay is constant here, so its increment length has no effect; it is the LR
        # decay length rather than --train-iters so that the checkpoint check below does not
        # reject a resumed run with another --train-iters for a setting that changes nothing.
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=getattr(
            args, "use_checkpoint_opt_param_scheduler", False
        ),
        override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
    )


@dataclass
class StepReport:
    grad_norm: float
    learning_rate: float
    skipped: bool = False  # the gradient norm was not finite: no update


class StageOptimizerStep:
    """The `optimizer_step_func` a schedule calls when this stage's step is due."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: OptimizerParamScheduler,
        *,
        data_parallel_group,
        grad_norm_group,
        tensor_parallel_rank: int,
        clip_grad: float,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data_parallel_group = data_parallel_group
        self.grad_norm_group = grad_norm_group
        self.tensor_parallel_rank = tensor_parallel_rank
        self.clip_grad = clip_grad
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.last = StepReport(grad_norm=0.0, learning_rate=0.0)
        self.skipped_steps = 0  # steps this stage skipped, over the run
        self.consecutive_skips = 0  # ... in a row, up to the last step
        self.scheduler_increment = 1  # iterations; samples of the iteration with a batch ramp

    def __call__(self) -> StepReport:
        grads = [self._grad(p) for p in self.params]
        self._average_over_data_parallel(grads)
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm):
            return self._skip(grad_norm)
        self.consecutive_skips = 0
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            scale = self.clip_grad / (grad_norm + 1e-6)
            for grad in grads:
                grad.mul_(scale)
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step(increment=self.scheduler_increment)
        self.optimizer.zero_grad(set_to_none=True)
        self.last = StepReport(grad_norm=grad_norm, learning_rate=learning_rate)
        return self.last

    def forget_skips(self) -> None:
        """After a rollback the skips in a row start again from zero."""
        self.consecutive_skips = 0

    def _skip(self, grad_norm: float) -> StepReport:
        """A non-finite gradient norm: no update, and (as in Megatron) the LR schedule does not
        advance. Every rank of the stage sees the same norm, so they all skip."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.last = StepReport(grad_norm=grad_norm, learning_rate=learning_rate, skipped=True)
        return self.last

    @staticmethod
    def _grad(param: torch.nn.Parameter) -> torch.Tensor:
        if param.grad is None:  # unused this step: its gradient is zero, not missing
            param.grad = torch.zeros_like(param)
        return param.grad

    def _average_over_data_parallel(self, grads: list[torch.Tensor]) -> None:
        group = self.data_parallel_group
        if group is None or dist.get_world_size(group) == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _grad_norm(self) -> float:
        """L2 norm over `grad_norm_group`; a parameter replicated over tensor-parallel ranks
        is counted once (on TP rank 0)."""
        device = self.params[0].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for param in self.params:
            if getattr(param, "shared", False):
                continue  # the last stage's copy of a tied embedding: counted on the first stage
            if getattr(param, "tensor_model_parallel", False) or self.tensor_parallel_rank == 0:
                total += param.grad.detach().float().pow(2).sum()
        group = self.grad_norm_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return math.sqrt(total.item())
