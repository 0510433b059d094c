"""The optimizer of a fully sharded model (fsdp.py): it steps each rank's rows of every
parameter, the fp32 main weights that the model's sharded parameters hold between passes.

The inner (suite) optimizer sees one fp32 parameter per model parameter that is a view of this
rank's rows, so its update is written straight into the rows that the next pass all-gathers:
no copy back, no gather after the step. Element-wise optimizers only (adam, sgd, lion, adan):
the update of a row does not depend on the other rows.

Gradients arrive already reduced: the backward reduce-scattered them onto the rows (fsdp.py),
so the data-parallel average is done when the step begins; what is left is fp16's unscaling.
The gradient norm is each rank's rows' sum of squares, summed over the sharding group.

Checkpoints hold the unsharded optimizer's format (each state entry whole, numbered as an
optimizer over the model's parameters numbers them, the fp32 main weights by parameter index
for a bf16/fp16 model), so they load into runs with or without FSDP alike.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.distributed import fsdp
from megatron.training.optimizer.main_params import SuiteOptimizerWrapper, main_copy


class FullyShardedOptimizer(SuiteOptimizerWrapper):
    """The stage's optimizer over the rows of a model sharded by `fsdp.shard_model`. The
    gradient norm sums over the dense parameters' sharding group; where the routed experts are
    sharded over other ranks, they are a part of their own (`parts`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sharded = [p for _, p in self.named]
        if not all(isinstance(p, DTensor) for p in self.sharded):
            raise ValueError("FullyShardedOptimizer needs a model sharded by fsdp.shard_model")
        self.rows = [main_copy(p, p.to_local().detach()) for p in self.sharded]  # the rows
        self.stand_ins = {}  # id(sharded) -> the whole parameter a checkpoint sees (fsdp.py)
        self.dtype = model_dtype_of(model)
        self.inner, self.loss_scaler = None, None
        self._pending_mains = None  # main weights of a load, applied after the model's
        group, expert_group = fsdp.sharding_groups(model)
        self.norm_group = group
        if expert_group is not None:
            self.parts = (_Part(self, group, expert=False), _Part(self, expert_group, expert=True))
            self.norm_group = None  # each part reduces its own norm

    def attach(self, inner, loss_scaler=None) -> None:
        self.inner, self.loss_scaler = inner, loss_scaler

    def named_main(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, rows) for (name, _), rows in zip(self.named, self.rows)]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The model's parameters as a checkpoint sees them (whole while it reads or writes)."""
        return [self.stand_ins.get(id(p), p) for p in self.sharded]

    @property
    def main_param_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows)

    # ------------------------------------------------------------------ gradients
    @staticmethod
    def gradient_of(param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's rows of the parameter's (reduced) gradient."""
        if param.grad is None:  # unused this step: its gradient is zero, not missing
            param.grad = torch.zeros_like(param)
        return param.grad.to_local()

    def average_over(self, group, *, in_collective: bool = False) -> None:
        """The backward averaged the gradients already; fp16's are still scaled."""
        if self.loss_scaler is not None:
            self.scale(1.0 / self.loss_scaler.scale)

    def average_dense_and_experts(self, data_parallel_group, data_parallel_size: int, *,
                                  in_collective: bool = False) -> None:  # fmt: skip
        """The backward averaged the routed experts' gradients over their expert-data-parallel
        group: as Megatron's DDP, they are the sum over it divided by the data-parallel size."""
        self.average_over(data_parallel_group)
        expert_group = self.parts[1].norm_group
        factor = dist.get_world_size(expert_group) / data_parallel_size
        for param in self.sharded:
            if getattr(param, "moe_expert", False):
                self.gradient_of(param).mul_(factor)

    def squared_norm(self, counted) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.rows[0].device)
        for param in self.sharded:
            if counted(param):
                total += self.gradient_of(param).float().pow(2).sum()
        return total

    def scale(self, factor: float) -> None:
        for param in self.sharded:
            self.gradient_of(param).mul_(factor)

    def first_gradient(self) -> torch.Tensor:
        return self.gradient_of(self.sharded[0])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        for rows, param in zip(self.rows, self.sharded):
            rows.grad = self.gradient_of(param)
        self.inner.step()
        # Weights still gathered (a unit kept from its forward, an asynchronous schedule's
        # microbatch in flight) are the old ones: free them, so that every later pass gathers
        # the new rows, as the schedule's passes read the live weights without FSDP.
        fsdp.reshard(self.model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=True)
        for param in self.sharded:
            param.grad = None

    def refresh_from_model(self, only: torch.nn.Parameter | None = None) -> None:
        """The rows are the model's own: nothing to refresh."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Collective over the sharding groups: every entry whole, the unsharded numbering."""
        state = self.inner.state_dict()
        numbered = self._numbered()
        state["state"] = {  # new dicts: the inner state_dict's are the live state
            number: {key: fsdp.full_of(numbered[number], value)
                     if _is_rows(value, numbered[number]) else value
                     for key, value in entries.items()}
            for number, entries in state["state"].items()
        }  # fmt: skip
        if self.dtype != torch.float32:
            pairs = enumerate(zip(self.sharded, self.rows))
            state["main_params"] = {i: fsdp.full_of(p, rows.detach()) for i, (p, rows) in pairs}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """This rank's rows of every entry; the main weights wait for `finish_load` (the
        model's values are written into the rows when the checkpoint's model part ends)."""
        inner = dict(state_dict)
        scaler = inner.pop("loss_scaler", None)
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self._pending_mains = inner.pop("main_params", None)
        numbered = self._numbered()
        inner["state"] = {
            number: {key: fsdp.rows_of(numbered[number], value)
                     if _is_whole(value, numbered[number]) else value
                     for key, value in entries.items()}
            for number, entries in inner["state"].items()
        }  # fmt: skip
        self.inner.load_state_dict(inner)

    @torch.no_grad()
    def finish_load(self) -> None:
        """After the model's weights reached the rows: the fp32 main weights of the load."""
        mains, self._pending_mains = self._pending_mains, None
        for index, (param, rows) in enumerate(zip(self.sharded, self.rows)):
            if mains is not None and index in mains:
                rows.copy_(fsdp.rows_of(param, mains[index].float()))

    def _numbered(self) -> list[DTensor]:
        """The sharded parameter of each entry number of the inner optimizer's state dict."""
        position = {id(r): i for i, r in enumerate(self.rows)}
        return [self.sharded[position[id(r)]] for g in self.inner.param_groups
                for r in g["params"]]  # fmt: skip

    def state_index_params(self) -> list[torch.nn.Parameter]:
        """The model parameter of each entry number of `state_dict()["state"]`."""
        return [self.stand_ins.get(id(p), p) for p in self._numbered()]


class _Part:
    """The dense or the expert parameters' gradients, with their own norm group."""

    def __init__(self, optimizer: FullyShardedOptimizer, norm_group, *, expert: bool):
        self.optimizer, self.norm_group, self.expert = optimizer, norm_group, expert

    def squared_norm(self, counted) -> torch.Tensor:
        def mine(param) -> bool:
            return getattr(param, "moe_expert", False) == self.expert and counted(param)

        return self.optimizer.squared_norm(mine)


def _is_rows(value, param: DTensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.to_local().shape and value.ndim > 0


def _is_whole(value, param: DTensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape and value.ndim > 0


def model_dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype the passes run in (the model's dtype before sharding)."""
    return getattr(model, "fsdp_compute_dtype", torch.float32)
