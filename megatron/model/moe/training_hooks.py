"""MoE in the training loop: the aux-loss gradient scale, the per-step work megatron-core's
finalize_model_grads does (expert bias, counters), and each stage's load statistics."""

from __future__ import annotations

import torch
import torch.distributed as dist


def experts_apart_from_dense() -> bool:
    """Whether the expert groups differ from the dense ones (MoE with EP > 1 or ETP != TP):
    then a stage's data-parallel ranks are no replicas of each other's experts."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() > 1 or (
        ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size()
    )


def set_aux_loss_scale(scale: float) -> None:
    """The gradient scale of the aux and z losses for the next backward pass: the main loss's
    (the rank runtime announces it before every backward pass, B and W: the stage's fp16 loss
    scale over the microbatches one update takes, 1/m for flush and 1/a for PACI, or the loss
    scale alone with --calculate-per-token-loss), as megatron-core's own forward_step sets it,
    but at backward time, where an asynchronous schedule's microbatches are."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32))


def _chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    chunks = getattr(model, "chunks", None)
    return list(chunks) if chunks is not None else [model]


def routing_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers that decide where a forward sends each token: every router's expert bias
    (`--moe-router-enable-expert-bias`; none otherwise). The weight-stashing schedules keep
    them with each weight version (`RankRuntime.versioned_buffers`): a forward on an older
    version routes with the bias of that version, and its backward, a recomputation included,
    routes as the forward did (docs/moe.md)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for c in _chunks(model) for m in c.modules() if isinstance(m, TopKRouter)]
    return [r.expert_bias for r in routers if getattr(r, "expert_bias", None) is not None]


class MoEStepHooks:
    """What megatron-core's finalize_model_grads does for MoE before each optimizer step:
    the aux-loss-free expert bias update from the step's token counts (summed over the
    stage's tensor x data-parallel ranks) and the reset of the per-step token counters
    (expert bias, global_aux_loss)."""

    def __init__(self, model: torch.nn.Module):
        self.chunks = _chunks(model)
        self.config = getattr(self.chunks[0], "config", None)

    @property
    def active(self) -> bool:
        return self.config is not None and bool(getattr(self.config, "num_moe_experts", None))

    def before_step(self) -> None:
        if not self.active:
            return
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias,
            reset_model_temporary_tensors,
        )

        if self.config.moe_router_enable_expert_bias:
            _update_router_expert_bias(self.chunks, self.config)
        reset_model_temporary_tensors(self.config, self.chunks)

    def forget_counts(self) -> None:
        """A step that is not taken (its iteration runs again): reset the counters unused."""
        if not self.active:
            return
        from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

        reset_model_temporary_tensors(self.config, self.chunks)


# ---------------------------------------------------------------------------- load statistics
# megatron-core's names in its aux-loss tracker -> ours in the log
TRACKED_LOSSES = {
    "load_balancing_loss": "load balancing loss",
    "seq_load_balancing_loss": "seq load balancing loss",
    "global_load_balancing_loss": "global load balancing loss",
    "z_loss": "z loss",
}
IMBALANCE = "tokens per expert max/mean"
DROPPED = "dropped tokens fraction"


class MoELoadStats:
    """This stage's MoE figures over a logging interval, with no collective across stages:
    the aux losses megatron-core's routers record (its tracker, without the reduction over
    the pipeline that its own logging does; the losses without their coefficients), averaged
    over the stage's MoE layers and training forwards, the load imbalance: for each layer
    the tokens routed to its busiest expert over the mean per expert (1.0 is perfectly
    balanced), the worst layer of the stage, and under a capacity factor the fraction of
    token-to-expert assignments dropped. Averaged (losses) or summed (token counts) over
    the stage's tensor x data-parallel ranks only."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        from megatron.core.transformer.moe.router import TopKRouter

        get_moe_layer_wise_logging_tracker().clear()  # a process-wide dict: a run starts empty
        self.routers = [m for c in _chunks(model) for m in c.modules() if isinstance(m, TopKRouter)]
        self.tokens = [None] * len(self.routers)
        self.forwards = [0] * len(self.routers)
        # (token-to-expert assignments wanted, kept) under a capacity factor
        self.capacity = any(r.config.moe_expert_capacity_factor is not None for r in self.routers)
        self.assignments = torch.zeros(2, dtype=torch.float64)
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._counter(index))
        self.history: list[dict] = []

    def _counter(self, index: int):
        def count(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            probs, routing_map = output[0].detach(), output[1].detach()
            counts = routing_map.reshape(-1, routing_map.shape[-1]).sum(dim=0).double()
            if self.capacity:  # kept: routed with a probability (padding slots have none)
                kept = torch.count_nonzero(probs * routing_map)
                wanted = probs.reshape(-1, probs.shape[-1]).shape[0] * module.topk
                self.assignments += torch.tensor([float(wanted), float(kept)], dtype=torch.float64)
            previous = self.tokens[index]
            self.tokens[index] = counts if previous is None else previous + counts
            self.forwards[index] += 1

        return count

    def collect(self, group=None) -> dict:
        """The interval's figures (empty on a stage without MoE layers); starts the next
        interval. `group`: the stage's tensor x data-parallel group (or None)."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        if not self.routers or not any(self.forwards):
            return {}
        tracker = get_moe_layer_wise_logging_tracker()
        losses = {}
        for name, label in TRACKED_LOSSES.items():
            if name not in tracker:
                continue
            values = tracker[name]["values"]
            per_layer = [float(values[r.layer_number - 1]) / max(n, 1)
                         for r, n in zip(self.routers, self.forwards)]  # fmt: skip
            losses[label] = sum(per_layer) / len(per_layer)
        figures = torch.tensor(list(losses.values()), dtype=torch.float64)
        counts = torch.stack([t for t in self.tokens if t is not None])
        assignments = self.assignments.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(figures, group=group)
            figures /= dist.get_world_size(group)
            dist.all_reduce(counts, group=group)
            if self.capacity:
                dist.all_reduce(assignments, group=group)
        result = dict(zip(losses, figures.tolist()))
        mean = counts.mean(dim=1).clamp(min=1e-12)
        result[IMBALANCE] = float((counts.max(dim=1).values / mean).max())
        if self.capacity:
            result[DROPPED] = 1.0 - float(assignments[1] / assignments[0].clamp(min=1.0))
        clear_aux_losses_tracker()
        self.tokens = [None] * len(self.routers)
        self.forwards = [0] * len(self.routers)
        self.assignments.zero_()
        self.history.append(result)
        return result

    def report(self) -> dict:
        """For summary.json: the last interval's figures and their mean over the run."""
        if not self.history:
            return {}
        names = self.history[-1].keys()
        return {
            "last": self.history[-1],
            "mean": {
                n: sum(h.get(n, 0.0) for h in self.history) / len(self.history) for n in names
            },
            "intervals": len(self.history),
            "history": self.history,  # every interval's figures, in order
        }
