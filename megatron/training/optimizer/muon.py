"""Muon with Megatron's settings: Newton-Schulz coefficient sets (`--muon-coefficient-type`)
and the full matrix of a tensor-parallel weight (`--muon-tp-mode duplicated`).

The update is torch's `torch.optim.Muon` (momentum `buf = lerp(buf, g, 1 - mu)`, Nesterov
`lerp(g, buf, mu)`, Newton-Schulz on bf16 operands after a Frobenius normalization, the wider
side orthogonalized, decoupled weight decay, LR times `sqrt(max(1, rows / cols))`) with one
change: each Newton-Schulz step may take its own coefficients. With `simple` (torch's single
set, every step) it is torch's Muon bit for bit (tested).

Coefficient sets, as published:
* `simple`: Keller Jordan's Muon (torch's default), repeated for every step;
* `quintic`: per-step coefficients of the modded-nanogpt medium record (Megatron's default),
  steps a multiple of 5;
* `polar_express`: Amsel et al., "The Polar Express" (2025), at least 8 steps, the last set
  repeated beyond;
* `aol`: Boissin's AOL-preconditioned Newton-Schulz coefficients, steps a multiple of 4.
"""

import math

import torch
import torch.distributed as dist

from megatron.training.optimizer.delay_lookahead import step_moment

COEFFICIENT_SETS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
TP_MODES = ("duplicated", "blockwise")  # Megatron's third, distributed: not supported yet


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` Newton-Schulz steps; ValueError naming the rule."""
    if kind not in COEFFICIENT_SETS:
        raise ValueError(
            f"unknown coefficient type {kind!r} (known: {', '.join(COEFFICIENT_SETS)})"
        )
    sets = COEFFICIENT_SETS[kind]
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise ValueError(f"polar_express needs at least {len(sets)} steps, got {steps}")
        return sets + sets[-1:] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"{kind} needs a multiple of {len(sets)} steps, got {steps}")
    return sets * (steps // len(sets))


def orthogonalize(matrix: torch.Tensor, coefficients, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz with bf16 operands, one (a, b, c) per step; as torch's Muon computes it."""
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for a, b, c in coefficients:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """torch's Muon update with per-step Newton-Schulz coefficients (module docstring). The
    momentum buffer is kept under torch's name, `momentum_buffer`, so torch Muon checkpoints
    load; the coefficients are the command line's, not part of the saved groups. A group's
    `lookahead_steps` (delay_lookahead.py) replaces Nesterov's one-step look-ahead."""

    def __init__(self, params, *, lr, weight_decay, momentum, nesterov, coefficients, eps=1e-7):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        eps=eps)  # fmt: skip
        super().__init__(params, defaults)
        self.coefficients = tuple(coefficients)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                steps = group.get("lookahead_steps")  # --async-nesterov-lookahead
                if steps is not None:
                    update = step_moment(buf, grad, momentum, steps)
                else:
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, self.coefficients, group.get("eps", 1e-7))
                rows, cols = param.shape[:2]
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * math.sqrt(max(1, rows / cols)))
        return None


class GatheredMatrix:
    """The full matrix of a tensor-parallel shard, stepped in its place (`--muon-tp-mode
    duplicated`): before the step the shards and their gradients are gathered over the
    tensor-parallel group, every rank steps the same full matrix (its momentum too), and each
    keeps its own slice after. The update is then the unsharded model's."""

    def __init__(self, weight: torch.nn.Parameter, group, dim: int):
        self.weight, self.group, self.dim = weight, group, dim
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.full = torch.nn.Parameter(self._gather(weight.detach()))

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def copy_in(self) -> None:
        self.full.data.copy_(self._gather(self.weight.detach()))
        grad = self.weight.grad
        self.full.grad = None if grad is None else self._gather(grad)

    def copy_out(self) -> None:
        self.weight.data.copy_(self.full.detach().chunk(self.size, dim=self.dim)[self.rank])


def tensor_parallel_dim(param: torch.nn.Parameter) -> int | None:
    """The dimension megatron-core shards `param` on (main copies carry the mark too)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim = getattr(param, "partition_dim", -1)
    return dim if dim >= 0 else None
