"""Megatron's --defer-embedding-wgrad-compute: the last stage's output layer computes its weight
gradient later.

The output layer (megatron-core's ColumnParallelLinear, or the tied embedding it is given as
its weight) is the largest matrix product of the last stage. Its backward here computes the
input gradient only, which the stage needs to send upstream, and keeps (input, output
gradient) of the microbatch instead of the weight gradient. `drain()` then computes each kept
microbatch's weight gradient (output grad^T @ input, the same product as megatron-core's
backward) and accumulates it into the weight through autograd, microbatch by microbatch in
backward order, so every gradient hook (fp32 `main_grad`) sees what the immediate path gives.

When the drain runs: before every optimizer step of the stage (inside the schedule for PACI,
PipeDream and the other stage-own steps; at the end of the call for 1F1B-flush) and at the end
of each schedule call, i.e. before anything reads the gradient (data-parallel average, tied
embedding sum, grad norm, clipping). Numbers do not change (the sums are the same); memory
grows by the kept inputs and output gradients, at most `limit` microbatches (0: all of a
step's).

Megatron's `--wgrad-deferral-limit N` (0: no limit): a forward defers only while fewer than N
microbatches are deferred and not yet drained; later ones compute their weight gradient in
their own backward, as without the flag. The count is taken at the forward (a microbatch
forwarded before a stage's step and run backward after it is counted until the next drain).
"""

import functools

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class DeferredWeightGradients:
    """The kept (weight, input, output gradient) of the microbatches whose weight gradient is
    still to come, and their drain."""

    def __init__(self, limit: int = 0):
        if limit < 0:
            raise ValueError(f"the wgrad deferral limit must be >= 0, not {limit}")
        self.limit = limit  # 0: every microbatch
        self.kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.deferred = 0  # forwards that deferred, whose weight gradient is not drained yet
        self.total = 0  # forwards that deferred, over the run
        self.peak_kept = 0  # most microbatches kept at once
        self.peak_kept_bytes = 0  # most bytes (inputs and output gradients) kept at once

    def takes_another(self) -> bool:
        return self.limit == 0 or self.deferred < self.limit

    def defer(self) -> None:
        """A forward that defers its weight gradient (counted until the drain after it)."""
        self.deferred += 1
        self.total += 1

    def keep(self, weight: torch.Tensor, total_input: torch.Tensor, grad_output: torch.Tensor):
        self.kept.append((weight, total_input, grad_output))
        held = sum(x.numel() * x.element_size() + g.numel() * g.element_size()
                   for _, x, g in self.kept)  # fmt: skip
        self.peak_kept_bytes = max(self.peak_kept_bytes, held)
        self.peak_kept = max(self.peak_kept, len(self.kept))

    def report(self) -> dict:
        return {"microbatches": self.total, "peak_kept": self.peak_kept,
                "peak_kept_bytes": self.peak_kept_bytes}  # fmt: skip

    def drain(self) -> None:
        """Accumulate the kept weight gradients, oldest first, into their weights."""
        kept, self.kept = self.kept, []
        self.deferred -= len(kept)
        for weight, total_input, grad_output in kept:
            grad = _as_matrix(grad_output).t().matmul(_as_matrix(total_input))
            # through the weight's AccumulateGrad node: its hooks run as in a full backward
            torch.autograd.backward(weight, grad_tensors=grad)


def _as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [s * b, h], as megatron-core's weight-gradient product takes it."""
    return tensor.contiguous().view(-1, tensor.shape[-1])


class _LinearKeepingWeightGradient(torch.autograd.Function):
    """`input @ weight^T` whose backward returns the input gradient and hands what the weight
    gradient needs to `keep(input, output gradient)`. The weight comes in detached and the
    parameter only inside `keep`: the graph has no edge to the parameter, so the backward
    neither touches its `.grad` nor runs its hooks, and a split backward's W pass finds
    nothing to redo here."""

    @staticmethod
    def forward(ctx, total_input, weight, keep):
        ctx.save_for_backward(total_input, weight)
        ctx.keep = keep
        return torch.matmul(total_input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        total_input, weight = ctx.saved_tensors
        ctx.keep(total_input, grad_output)
        return grad_output.matmul(weight), None, None


def _deferring_forward_impl(layer, deferred: DeferredWeightGradients):
    """A replacement for `layer._forward_impl` (megatron-core's linear with its tensor-parallel
    communication) that defers the weight gradient while `deferred` takes another microbatch."""
    immediate = layer._forward_impl

    def forward_impl(input, weight, bias, *args, sequence_parallel=False, allreduce_dgrad=False,
                     tp_group=None, **kwargs):  # fmt: skip
        defers = (
            torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf
            and bias is None and deferred.takes_another()
        )  # fmt: skip
        if not defers:
            return immediate(input, weight, bias, *args, sequence_parallel=sequence_parallel,
                             allreduce_dgrad=allreduce_dgrad, tp_group=tp_group, **kwargs)  # fmt: skip
        deferred.defer()
        # The communication megatron-core's linear does inside its backward, as autograd
        # functions around ours: all-gather / reduce-scatter of the sequence, or the
        # all-reduce of the input gradient over the tensor-parallel ranks.
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        keep = functools.partial(deferred.keep, weight)
        return _LinearKeepingWeightGradient.apply(input, weight.detach(), keep)

    return forward_impl


def defer_output_layer_weight_gradient(model: torch.nn.Module, limit: int):
    """Make `model`'s output layer (megatron-core GPTModel's `output_layer` on the last stage)
    defer its weight gradient; returns its `DeferredWeightGradients`, None without one."""
    layer = getattr(model, "output_layer", None)
    if layer is None or not hasattr(layer, "_forward_impl") or not model.post_process:
        return None
    deferred = DeferredWeightGradients(limit)
    layer._forward_impl = _deferring_forward_impl(layer, deferred)
    layer.deferred_weight_gradients = deferred
    return deferred


def deferred_weight_gradients_of(model: torch.nn.Module) -> list[DeferredWeightGradients]:
    """Every deferral in `model` (one per output layer: a rank's chunks may hold several)."""
    found = (getattr(m, "deferred_weight_gradients", None) for m in model.modules())
    return [deferred for deferred in found if deferred is not None]


def deferral_report(model: torch.nn.Module) -> dict | None:
    """What `model`'s output layers deferred (summed over them), None without a deferral."""
    reports = [deferred.report() for deferred in deferred_weight_gradients_of(model)]
    if not reports:
        return None
    return {key: sum(report[key] for report in reports) for key in reports[0]}


def drain_weight_gradients(model: torch.nn.Module) -> None:
    for deferred in deferred_weight_gradients_of(model):
        deferred.drain()


def drained_before(optimizer_step_func, model: torch.nn.Module):
    """The step, after draining the deferred weight gradients of `model` (the step reads the
    gradient: averages, sums the tied copies, takes its norm)."""
    deferrals = deferred_weight_gradients_of(model)
    if optimizer_step_func is None or not deferrals:
        return optimizer_step_func

    def step():
        for deferred in deferrals:
            deferred.drain()
        return optimizer_step_func()

    step.__wrapped__ = optimizer_step_func
    return step
