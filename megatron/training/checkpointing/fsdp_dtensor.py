"""`--ckpt-format fsdp_dtensor`: a fully sharded model's checkpoint (fsdp.py) as the ranks hold
it, written with torch.distributed.checkpoint, as Megatron-FSDP writes its own.

    <dir>/iter_0000100/   fsdp_dtensor.pt (common state), .metadata, __<rank>_0.distcp
    <dir>/latest_checkpointed_iteration.txt

Nothing is gathered: each rank writes its rows of the fp32 main weights (the model's sharded
parameters) and of the optimizer state, as DTensors over the data-parallel group, and reads
its rows back, so the data-parallel size may change between a save and a load (torch's
checkpoint reshards DTensors). Keys carry the model-parallel ranks (`tp0_pp1.decoder...`, the
routed experts `etp0_ep1_pp1.decoder...`): the tensor x pipeline x expert layout must stay.
Saving is atomic as for torch_dist: a staging directory renamed into place.
"""

import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.distributed import checkpoint
from torch.distributed.tensor import DTensor

from megatron.common.errors import UserError
from megatron.model.gpt import is_expert_parameter
from megatron.training.checkpointing import integrity
from megatron.training.checkpointing.torch_dist import (
    GROUP_COUNTERS,
    STAGING_SUFFIX,
    _replace_directory,
    ensure_optimizer_state,
    first_line,
)

FORMAT = "fsdp_dtensor"
COMMON_FILE = "fsdp_dtensor.pt"  # the common state; also the format's marker


def is_fsdp_dtensor_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, COMMON_FILE))


def _layout() -> dict:
    return {
        "tensor": ps.get_tensor_model_parallel_world_size(),
        "pipeline": ps.get_pipeline_model_parallel_world_size(),
        "expert": ps.get_expert_model_parallel_world_size(),
        "expert_tensor": ps.get_expert_tensor_parallel_world_size(),
    }


def _prefix(name: str) -> str:
    """The model-parallel ranks whose copy of `name` this is."""
    pp = ps.get_pipeline_model_parallel_rank()
    if is_expert_parameter(name):
        tp, ep = ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank()
        return f"etp{tp}_ep{ep}_pp{pp}"
    return f"tp{ps.get_tensor_model_parallel_rank()}_pp{pp}"


def _as_rows(param: DTensor, rows: torch.Tensor) -> DTensor:
    """This rank's `rows` of a tensor laid out as `param` (optimizer state), as a DTensor that
    shares their storage (a load writes into them)."""
    return DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)  # fmt: skip


def _state_dict(model, optimizer, *, with_optim: bool, with_rng: bool) -> dict:
    """Every entry as a tensor sharing the live storage (a load fills them in place), or an
    object (a load replaces it in the dict)."""
    state = {f"model.{_prefix(k)}.{k}": v for k, v in model.state_dict().items()}
    if with_optim:
        names = {id(p): n for n, p in model.named_parameters()}
        inner = optimizer.inner.state_dict()
        numbered = optimizer.state_index_params()
        for number, entries in inner["state"].items():
            param = numbered[number]
            name = names[id(param)]
            for key, value in entries.items():
                if torch.is_tensor(value) and value.shape == param.to_local().shape:
                    value = _as_rows(param, value)
                state[f"optimizer.{_prefix(name)}.{name}.{key}"] = value
        mp = _prefix("")
        state[f"optimizer.{mp}.param_groups"] = inner["param_groups"]
        if optimizer.loss_scaler is not None:
            state[f"optimizer.{mp}.loss_scaler"] = optimizer.loss_scaler.state_dict()
    if with_rng:
        state[f"rng_state.{_prefix('')}"] = torch.get_rng_state()
    return state


def save_checkpoint(directory: str, common: dict, *, model, optimizer, checkpoint) -> None:
    """Each rank's rows of the model (and optimizer, RNG state unless --no-save-optim /
    --no-save-rng); `common` beside them. Collective."""
    skipped = {"optimizer": checkpoint.no_save_optim, "rng_state": checkpoint.no_save_rng}
    parts = [name for name, skip in skipped.items() if not skip]
    state = _state_dict(model, optimizer, with_optim="optimizer" in parts,
                        with_rng="rng_state" in parts)  # fmt: skip
    staging = directory + STAGING_SUFFIX
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        os.makedirs(staging)
    dist.barrier()
    writer = _storage_writer(staging)
    torch.distributed.checkpoint.save(state, storage_writer=writer)
    if dist.get_rank() == 0:
        torch.save({**common, "format": FORMAT, "saved_parts": parts, "layout": _layout()},
                   os.path.join(staging, COMMON_FILE))  # fmt: skip
    dist.barrier()  # every rank's files are complete
    if dist.get_rank() == 0:
        if checkpoint.verify_integrity:
            integrity.write_manifest(staging)
        _replace_directory(staging, directory)
    dist.barrier()


def _storage_writer(path: str):
    return checkpoint.FileSystemWriter(path, thread_count=1)


def read_common(directory: str) -> tuple[dict | None, str | None]:
    """(the checkpoint's common state, None) or (None, the problem in words)."""
    try:
        common = torch.load(os.path.join(directory, COMMON_FILE), weights_only=False)
        checkpoint.FileSystemReader(directory).read_metadata()
    except Exception as error:
        return None, f"checkpoint {directory} is truncated or corrupt ({first_line(error)})"
    if not isinstance(common, dict) or "iteration" not in common:
        return None, f"checkpoint {directory} is not one of our checkpoints"
    return common, None


def restore_checkpoint(payload: dict, *, model, optimizer, load_optim, load_rng) -> None:
    """Every rank reads its rows of the checkpoint `payload` (from `read_common`) describes."""
    directory = payload["directory"]
    if payload.get("layout") != _layout():
        raise UserError(
            f"--load {directory}: an {FORMAT} checkpoint loads into the tensor x pipeline x "
            f"expert layout that saved it ({payload.get('layout')}; this run: {_layout()}); "
            "only the data-parallel size may change"
        )
    if load_optim:
        ensure_optimizer_state(optimizer, model)
    state = _state_dict(model, optimizer, with_optim=load_optim, with_rng=load_rng)
    try:
        checkpoint.load(state, storage_reader=checkpoint.FileSystemReader(directory))
    except Exception as error:
        raise UserError(
            f"--load {directory}: the checkpoint does not fit this model ({first_line(error)})"
        ) from None
    mp = _prefix("")
    if load_optim:
        _restore_optimizer_objects(optimizer, state, mp)
    if load_rng:
        torch.set_rng_state(state[f"rng_state.{mp}"])


def _restore_optimizer_objects(optimizer, state: dict, mp: str) -> None:
    """What the load replaced rather than filled: the scalars of each parameter's state (a
    step count), the groups' counters, the loss scaler."""
    inner = optimizer.inner.state_dict()  # the live tensors, already filled in place
    names = {id(p): n for n, p in optimizer.named}
    numbered = optimizer.state_index_params()
    for number, entries in inner["state"].items():
        name = names[id(numbered[number])]
        for key, value in entries.items():
            loaded = state[f"optimizer.{_prefix(name)}.{name}.{key}"]
            if not torch.is_tensor(value):
                entries[key] = loaded
    inner["param_groups"] = [  # hyperparameters come from the flags, counters from the save
        {**group, **{k: saved[k] for k in GROUP_COUNTERS if k in saved}}
        for group, saved in zip(inner["param_groups"], state[f"optimizer.{mp}.param_groups"])
    ]
    optimizer.inner.load_state_dict(inner)
    scaler = state.get(f"optimizer.{mp}.loss_scaler")
    if scaler is not None and optimizer.loss_scaler is not None:
        optimizer.loss_scaler.load_state_dict(scaler)
