"""The distributed optimizer's checkpoint state in the unsharded optimizer's format.

A torch optimizer's `state_dict()` numbers parameters in the order of its groups (weight-decay
group first, then the one without, each in model order, see optimizers.decay_groups) and keeps
per-parameter tensors at the parameter's shape. The sharded optimizer's inner optimizer knows
only this rank's pieces; `gather_state_dict` puts every rank's pieces back together (one
`all_gather` per state entry over the data-parallel group) and renumbers them the unsharded
way; `slice_state_dict` does the reverse for this rank. Element-wise entries are recognised by
their shape (the piece's); others (Adam's step count) are the same on every piece.
"""

import torch
import torch.distributed as dist

from megatron.training.optimizer.suite import group_key


def _unsharded_numbering(optimizer) -> tuple[dict[int, int], list[tuple[tuple, list[int]]]]:
    """(model index -> unsharded optimizer index, each group's (group_key, model indices))."""
    groups = optimizer.global_groups()
    numbering = {}
    for model_index in (i for _, indices in groups for i in indices):
        numbering[model_index] = len(numbering)
    return numbering, groups


def _local_pieces(optimizer) -> list:
    """The pieces in the inner optimizer's numbering (its groups' order)."""
    by_main = {id(piece.main): piece for piece in optimizer.pieces}
    return [by_main[id(p)] for group in optimizer.inner.param_groups for p in group["params"]]


def _is_elementwise(value, piece) -> bool:
    return torch.is_tensor(value) and value.shape == piece.main.shape


def _gather_flat(optimizer, tensors_by_piece: dict, dtype) -> torch.Tensor:
    """The whole flat buffer of one state entry, from every rank's pieces."""
    device = optimizer.buffer.flat.device
    mine = torch.zeros(optimizer.shard_numel, dtype=dtype, device=device)
    for piece, tensor in tensors_by_piece.items():
        mine[piece.shard_offset : piece.shard_offset + tensor.numel()] = tensor.reshape(-1)
    full = torch.empty(optimizer.buffer.padded_numel, dtype=dtype, device=device)
    dist.all_gather_into_tensor(full, mine, group=optimizer.group)
    return full


def _unflatten(optimizer, full: torch.Tensor) -> dict[int, torch.Tensor]:
    return {
        index: full[offset : offset + param.numel()].view_as(param).clone()
        for index, (param, offset) in enumerate(optimizer.buffer.views())
    }


def _all_ranks(optimizer, value) -> list:
    gathered = [None] * optimizer.shards
    dist.all_gather_object(gathered, value, group=optimizer.group)
    return gathered


def _gather_entries(optimizer, local_state: dict, pieces: list) -> dict[int, dict]:
    """Per model index: every state entry, whole."""
    elementwise, scalars = {}, {}
    for local_index, piece in enumerate(pieces):
        for key, value in local_state.get(local_index, {}).items():
            if _is_elementwise(value, piece):
                elementwise.setdefault(key, {})[piece] = value
            else:
                scalars.setdefault(piece.index, {})[key] = value
    keys = {k: str(v[next(iter(v))].dtype) for k, v in elementwise.items()}
    merged_keys, merged_scalars = {}, {}
    for rank_keys, rank_scalars in _all_ranks(optimizer, (keys, scalars)):
        merged_keys.update(rank_keys)
        for index, entries in rank_scalars.items():
            merged_scalars.setdefault(index, {}).update(entries)
    whole = {index: dict(entries) for index, entries in merged_scalars.items()}
    for key in sorted(merged_keys):
        dtype = getattr(torch, merged_keys[key].replace("torch.", ""))
        full = _gather_flat(optimizer, elementwise.get(key, {}), dtype)
        for index, tensor in _unflatten(optimizer, full).items():
            whole.setdefault(index, {})[key] = tensor
    return whole


def _gathered_groups(optimizer, local_groups: list[dict], groups: list[list[int]], numbering):
    """The unsharded optimizer's param_groups: settings from a rank that has the group (they
    are the same on all), indices in the unsharded numbering."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in local_groups]
    by_key = {}
    for rank_settings in _all_ranks(optimizer, settings):
        for group in rank_settings:
            by_key.setdefault(group_key(group), group)
    return [{**by_key[key], "params": [numbering[i] for i in indices]} for key, indices in groups]


def gather_state_dict(optimizer) -> dict:
    """Collective over the data-parallel group."""
    numbering, groups = _unsharded_numbering(optimizer)
    local = optimizer.inner.state_dict()
    pieces = _local_pieces(optimizer)
    whole = _gather_entries(optimizer, local["state"], pieces)
    state = {
        "state": {numbering[index]: entries for index, entries in sorted(whole.items())},
        "param_groups": _gathered_groups(optimizer, local["param_groups"], groups, numbering),
    }
    if optimizer.dtype != torch.float32:  # fp32 models hold their main weights themselves
        mains = {piece: piece.main.detach() for piece in optimizer.pieces}
        state["main_params"] = _unflatten(optimizer, _gather_flat(optimizer, mains, torch.float32))
    return state


def slice_state_dict(optimizer, state_dict: dict) -> dict:
    """This rank's part of an unsharded optimizer state dict, for the inner optimizer."""
    numbering, _ = _unsharded_numbering(optimizer)
    saved_groups = {group_key(group): group for group in state_dict["param_groups"]}
    by_main = {id(piece.main): piece for piece in optimizer.pieces}
    state, param_groups, local_index = {}, [], 0
    for group in optimizer.inner.param_groups:
        saved = saved_groups[group_key(group)]
        indices = []
        for main in group["params"]:
            piece = by_main[id(main)]
            entries = state_dict["state"].get(numbering[piece.index])
            if entries is not None:
                state[local_index] = {k: _slice(v, piece) for k, v in entries.items()}
            indices.append(local_index)
            local_index += 1
        param_groups.append({**saved, "params": indices})
    return {"state": state, "param_groups": param_groups}


def _slice(value, piece):
    if torch.is_tensor(value) and value.shape == piece.param.shape:
        return value.reshape(-1)[piece.start : piece.end].clone()
    return value
