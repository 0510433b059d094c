"""`--use-distributed-optimizer` with `--optimizer muon`: the layer-wise distributed optimizer
(Megatron's LayerWiseDistributedOptimizer, written here for torch optimizers on every device).

Muon orthogonalizes whole matrices, so its state cannot be cut into the flat byte ranges of
distributed_optimizer.py. Instead each data-parallel rank *owns whole parameters*:

1. gradients: the stage's fp32 gradient buffer is averaged over the data-parallel group, as
   without the distributed optimizer (every rank holds the full gradient, so the gradient norm
   and clipping are the replicated optimizer's, with no extra collective);
2. each rank holds fp32 main weights and optimizer state only for the parameters it owns and
   steps only those (the others get no gradient, which torch optimizers skip);
3. every rank's updated parameters, in the model's dtype, are all-gathered over the group.

Ownership is Megatron's: the parameters sorted by size and dealt to the ranks back and forth
(0, 1, .., D-1, D-1, .., 0), so the ranks' shares are balanced. With expert parallelism the
routed experts are dealt over the expert-data-parallel group (the ranks holding the same
experts), the dense parameters over the data-parallel group. All collectives stay in those
groups: under PACI each stage steps on its own. Every parameter is owned whole, the AdamW ones
too: Megatron's `--no-use-layer-wise-param-layout` path; its default layout, which shards the
AdamW parameters byte-wise instead, gives the same arithmetic and is not separate here.

The inner optimizer is the unsharded one (the suite's, over a main weight or placeholder for
every parameter), so its numbering is the unsharded optimizer's: `state_dict()` gathers the
owners' entries into exactly the dict `ReplicatedMainOptimizer` writes, and `load_state_dict()`
keeps this rank's part of such a dict. Checkpoints do not depend on the data-parallel size nor
on whether the optimizer was distributed.
"""

import torch
import torch.distributed as dist

from megatron.training.optimizer.main_params import (
    MainParamsOptimizer,
    ReplicatedMainOptimizer,
    main_copy,
)


def _group_rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def deal_owners(params: list[torch.nn.Parameter], size: int) -> list[int]:
    """The owning rank of each parameter: sorted by size (ties in model order), dealt back and
    forth over `size` ranks."""
    order = sorted(range(len(params)), key=lambda i: (params[i].numel(), i))
    cycle = list(range(size)) + list(range(size))[::-1]
    owners = [0] * len(params)
    for position, index in enumerate(order):
        owners[index] = cycle[position % len(cycle)]
    return owners


def is_routed_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "moe_expert", False)


class LayerWiseMainOptimizer(ReplicatedMainOptimizer):
    """Whole parameters owned by data-parallel ranks (module docstring). `group`: the stage's
    data-parallel group; `expert_group`: the expert-data-parallel group the routed experts are
    dealt over (None: the experts are dealt with the dense parameters)."""

    def __init__(self, model: torch.nn.Module, group, expert_group=None):
        MainParamsOptimizer.__init__(self, model)
        self.group, self.expert_group = group, expert_group
        experts_apart = expert_group is not None
        self.groups = [group, expert_group] if experts_apart else [group]
        self.part_of = [int(experts_apart and is_routed_expert(p)) for p in self.params]
        self.owner = [0] * len(self.params)
        for part, part_group in enumerate(self.groups):
            indices = [i for i, p in enumerate(self.params) if self.part_of[i] == part]
            dealt = deal_owners(
                [self.params[i] for i in indices], _group_rank_and_size(part_group)[1]
            )
            for index, owner in zip(indices, dealt):
                self.owner[index] = owner
        self.owned = [
            self.owner[i] == _group_rank_and_size(self.groups[self.part_of[i]])[0]
            for i in range(len(self.params))
        ]
        # A parameter owned elsewhere gets no main weight of its own: the optimizer sees the
        # model's tensor (no gradient, so never stepped) to build the unsharded groups.
        self.main = [
            main_copy(p, p.detach().float().clone() if mine else p.detach())
            for p, mine in zip(self.params, self.owned)
        ]

    @property
    def main_param_bytes(self) -> int:
        mains = [m for m, mine in zip(self.main, self.owned) if mine]
        return sum(m.numel() * m.element_size() for m in mains)

    @torch.no_grad()
    def refresh_from_model(self, only: torch.nn.Parameter | None = None) -> None:
        for main, param, mine in zip(self.main, self.params, self.owned):
            if mine and (only is None or param is only):
                main.copy_(param)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        for main, param, mine in zip(self.main, self.params, self.owned):
            main.grad = param.main_grad if mine else None
        self.inner.step()
        for main, param, mine in zip(self.main, self.params, self.owned):
            if mine:
                param.copy_(main)  # rounded to the model's dtype
        for part, group in enumerate(self.groups):
            self._gather_part(part, group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for main in self.main:
            main.grad = None

    @torch.no_grad()
    def _gather_part(self, part: int, group) -> None:
        """Every owner's parameters of this part into every rank: one all-gather of equal
        blocks (each rank's owned parameters end to end, padded to the largest share)."""
        rank, size = _group_rank_and_size(group)
        if size == 1:
            return
        indices = [i for i in range(len(self.params)) if self.part_of[i] == part]
        by_rank = [[i for i in indices if self.owner[i] == r] for r in range(size)]
        block = max(sum(self.params[i].numel() for i in share) for share in by_rank)
        device = self.params[0].device
        mine = torch.zeros(block, dtype=self.dtype, device=device)
        offset = 0
        for index in by_rank[rank]:
            param = self.params[index]
            mine[offset : offset + param.numel()] = param.reshape(-1)
            offset += param.numel()
        full = torch.empty(block * size, dtype=self.dtype, device=device)
        dist.all_gather_into_tensor(full, mine, group=group)
        for owner, share in enumerate(by_rank):
            offset = owner * block
            for index in share:
                param = self.params[index]
                param.copy_(full[offset : offset + param.numel()].view_as(param))
                offset += param.numel()

    # ------------------------------------------------------------------ checkpoints
    def state_owners(self) -> list[tuple[torch.nn.Parameter, dict]]:
        return []  # the state dict is gathered: `state_dict_owners` reads it instead

    def state_dict(self) -> dict:
        """Collective over the groups: the replicated optimizer's dict (main_params.py)."""
        from megatron.training.optimizer.layer_wise_state import gather_state_dict

        state = gather_state_dict(self)
        state.update(self._extra_state())
        return state

    def state_dict_owners(self, state_dict: dict) -> list[tuple[torch.nn.Parameter, dict]]:
        """(model parameter, its entries) of a `state_dict()`, for torch_dist."""
        from megatron.training.optimizer.layer_wise_state import entries_by_model_param

        return entries_by_model_param(self, state_dict)

    def _own_inner_state(self, inner: dict) -> dict:
        from megatron.training.optimizer.layer_wise_state import own_part

        return own_part(self, inner)

    def _load_main_params(self, mains: dict[int, torch.Tensor]) -> None:
        for index, (main, mine) in enumerate(zip(self.main, self.owned)):
            if mine:
                main.copy_(mains[index])
