"""The layer-wise distributed optimizer's checkpoint state (layer_wise.py) in the replicated
optimizer's format.

Its inner optimizer is the unsharded one, so the entry numbers of `inner.state_dict()` are
already the unsharded ones; each rank only lacks the entries of the parameters it does not own.
`gather_state_dict` collects them from their owners (the dense parameters' over the data-
parallel group, the routed experts' over the expert-data-parallel group: ranks of other
experts number their own experts the same way); `own_part` keeps this rank's of such a dict.
Entries of a tensor stepped in a weight's place (Muon's split QKV blocks, a matrix gathered
over tensor parallelism) belong to the weight's owner.
"""

import torch
import torch.distributed as dist


def _sub_optimizers(inner) -> dict:
    """name -> torch optimizer: the chain's members (suite.OptimizerChain), or the one."""
    return getattr(inner, "optimizers", None) or {None: inner}


def _numbered_model_indices(optimizer, sub) -> list[int]:
    """The model parameter index of each entry number of `sub`'s state dict."""
    index_of = {id(main): i for i, main in enumerate(optimizer.main)}
    weight_of = getattr(optimizer.inner, "stand_in_weights", {})
    for tensor_id, weight in weight_of.items():
        index_of[tensor_id] = index_of[id(weight)]
    return [index_of[id(p)] for group in sub.param_groups for p in group["params"]]


def _is_stand_in(optimizer, tensor) -> bool:
    return id(tensor) in getattr(optimizer.inner, "stand_in_weights", {})


def _parts(inner_dict: dict, inner) -> dict:
    return inner_dict if None not in _sub_optimizers(inner) else {None: inner_dict}


def _moved(value, device):
    if torch.is_tensor(value):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _merge_from_owners(optimizer, by_part: list[dict]) -> dict:
    """Each part's {key: value} merged over its group's ranks (objects, through the CPU)."""
    merged = {}
    device = optimizer.params[0].device
    for part, group in enumerate(optimizer.groups):
        local = _moved(by_part[part], "cpu")
        gathered = [local]
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, local, group=group)
        for rank_entries in gathered:
            merged.update(rank_entries)
    return _moved(merged, device)


def gather_state_dict(optimizer) -> dict:
    """Collective over the optimizer's groups: the unsharded inner state dict, with the fp32
    main weights (by model index) for a bf16/fp16 model."""
    inner = optimizer.inner
    local = _parts(inner.state_dict(), inner)
    by_part = [{} for _ in optimizer.groups]
    for name, sub in _sub_optimizers(inner).items():
        indices = _numbered_model_indices(optimizer, sub)
        for number, entries in local[name]["state"].items():
            by_part[optimizer.part_of[indices[number]]][(name, number)] = entries
    if optimizer.dtype != torch.float32:  # fp32 models hold their main weights themselves
        for index, main in enumerate(optimizer.main):
            if optimizer.owned[index]:
                by_part[optimizer.part_of[index]][("main_params", index)] = main
    merged = _merge_from_owners(optimizer, by_part)
    for name in local:
        numbers = sorted(number for kind, number in merged if kind == name)
        local[name]["state"] = {number: merged[(name, number)] for number in numbers}
    state = dict(local) if None not in local else dict(local[None])
    if optimizer.dtype != torch.float32:
        indices = sorted(i for kind, i in merged if kind == "main_params")
        state["main_params"] = {i: merged[("main_params", i)] for i in indices}
    return state


def own_part(optimizer, inner_dict: dict) -> dict:
    """The entries of an unsharded inner state dict whose parameters this rank owns."""
    inner = optimizer.inner
    parts = _parts(dict(inner_dict), inner)
    for name, sub in _sub_optimizers(inner).items():
        indices = _numbered_model_indices(optimizer, sub)
        saved = parts[name]
        saved = parts[name] = {**saved, "state": dict(saved["state"])}
        for number in list(saved["state"]):
            if not optimizer.owned[indices[number]]:
                del saved["state"][number]
    return parts if None not in parts else parts[None]


def entries_by_model_param(optimizer, state_dict: dict) -> list[tuple[torch.nn.Parameter, dict]]:
    """(model parameter, its entries) of a `state_dict()`; entries of stand-ins are no model
    parameter's (they stay with the layout, as in the replicated optimizer)."""
    inner = optimizer.inner
    parts = _parts(state_dict, inner)
    owners = []
    for name, sub in _sub_optimizers(inner).items():
        stepped = [p for group in sub.param_groups for p in group["params"]]
        indices = _numbered_model_indices(optimizer, sub)
        for number, entries in parts[name].get("state", {}).items():
            if not _is_stand_in(optimizer, stepped[number]):
                owners.append((optimizer.params[indices[number]], entries))
    return owners
