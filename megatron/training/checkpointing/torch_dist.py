"""`--ckpt-format torch_dist`: megatron-core's distributed checkpoint format (Megatron's default).

    <dir>/iter_0000100/   metadata.json, common.pt, .metadata, __<rank>_<n>.distcp
    <dir>/latest_checkpointed_iteration.txt

Written and read by `megatron.core.dist_checkpointing` from the model's `sharded_state_dict()`:
every tensor is stored under its *global* key (global layer number, full unsharded shape, this
rank's tensor-parallel slice as an offset), so a checkpoint loads into any tensor x pipeline x
data-parallel layout of the same model. The optimizer's per-parameter state (Adam's `exp_avg`,
`exp_avg_sq`, ...) is stored the same way, each state tensor with its parameter's key and
sharding (`optimizer.state.<name>.<parameter key>`), so it reshards with the model. What cannot
reshard is stored per layout and loads only into the layout that saved it (see
docs/checkpoints.md): a parameter's state that is not parameter-shaped (SOAP's preconditioners),
state of tensors that are not model parameters (Muon's split QKV blocks), and the RNG state.

Saving is atomic: everything is written into `iter_N.tmp`, which rank 0 renames to `iter_N`
once every rank's part and the metadata are complete; the tracker file is written last.
"""

import os
import shutil
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint
from torch.distributed.checkpoint import CheckpointException

from megatron.common.errors import UserError
from megatron.model.moe import experts_apart_from_dense
from megatron.training.checkpointing import integrity

FORMAT = "torch_dist"
METADATA_FILE = "metadata.json"  # megatron-core's marker of a distributed checkpoint
STAGING_SUFFIX = ".tmp"
# Optimizer entries kept in parameter groups that are counters rather than hyperparameters
# (pytorch_optimizer's optimizers count steps per group); hyperparameters come from the flags.
GROUP_COUNTERS = ("step",)


def is_dist_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


# ---------------------------------------------------------------------------- ranks
def _layout() -> tuple[int, int, int, int, int, int]:
    """(pp size, pp rank, tp size, tp rank, dp size, dp rank) of this process; context-parallel
    ranks hold the same weights and optimizer state, so they count as data-parallel replicas."""
    ps = parallel_state
    return (
        ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )  # fmt: skip


def per_model_rank_object(key: str, data, *, per_data_parallel_rank: bool = False) -> ShardedObject:
    """Something each (pipeline, tensor) rank has its own of; data-parallel ranks are replicas
    (rank 0's is saved, every data-parallel rank loads it, as in the torch format). With
    `per_data_parallel_rank` every rank keeps its own: with expert parallelism the data-
    parallel ranks of a stage hold different experts."""
    pp, pp_rank, tp, tp_rank, dp, dp_rank = _layout()
    if per_data_parallel_rank:
        return ShardedObject(key, data, (pp, tp, dp), (pp_rank, tp_rank, dp_rank), replica_id=0)
    return ShardedObject(key, data, (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)


def expert_layout() -> tuple[int, int, int]:
    """(expert parallel, expert tensor parallel, data parallel) sizes of this run."""
    ps = parallel_state
    return (ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(), ps.get_data_parallel_world_size())  # fmt: skip


# ---------------------------------------------------------------------------- model
def model_sharded_state_dict(model) -> dict:
    if not hasattr(model, "sharded_state_dict"):
        raise UserError(
            f"--ckpt-format {FORMAT} needs megatron-core's model ({type(model).__name__} has no "
            "sharded_state_dict): pass --ckpt-format torch"
        )
    # One key per global layer ("decoder.layers.<global>.…"), as Megatron's current checkpoints.
    return model.sharded_state_dict(metadata={"non_homogeneous_layers": True})


def sharded_parameters(model_sharded: dict) -> dict[int, ShardedTensor]:
    """id(parameter) -> its ShardedTensor (the sharded state dict holds the parameters)."""
    return {
        id(value.data): value
        for value in model_sharded.values()
        if isinstance(value, ShardedTensor) and isinstance(value.data, torch.nn.Parameter)
    }


# ---------------------------------------------------------------------------- optimizer
def _state_owners(optimizer, parameters: dict[int, ShardedTensor], state_dict: dict) -> dict:
    """id(state tensor) -> (the parameter's ShardedTensor, the state's name), for state of
    model parameters. A torch optimizer's `state` maps parameters to their state. An optimizer
    over fp32 main weights (main_params.py) says whose state it holds: by identity
    (`state_owners`: the replicated one, whose state dict holds its live state), by entry
    number (`state_index_params`: the sharded one, whose state dict is gathered) or from the
    dict itself (`state_dict_owners`: the layer-wise one, gathered too); its main
    weights (`main_params`, in model order) are the parameters' state too."""
    owners = {}
    live_owners = getattr(optimizer, "state_owners", None)
    index_params = getattr(optimizer, "state_index_params", None)
    dict_owners = getattr(optimizer, "state_dict_owners", None)  # the layer-wise one's
    if dict_owners is not None:
        by_param = dict_owners(state_dict)
    elif live_owners is not None:
        by_param = live_owners()
    elif index_params is not None:
        numbered = index_params()
        by_param = [(numbered[i], entries) for i, entries in state_dict.get("state", {}).items()]
    else:
        by_param = list(getattr(optimizer, "state", {}).items())
    if live_owners is not None or index_params is not None:
        mains = state_dict.get("main_params", {})
        by_param += [(optimizer.params[i], {"main_param": m}) for i, m in mains.items()]
    for param, entries in by_param:
        sharded = parameters.get(id(param))
        if sharded is None or not isinstance(entries, dict):
            continue
        for name, value in entries.items():
            if torch.is_tensor(value):
                owners[id(value)] = (sharded, name)
    return owners


def _leaves(node, path=()):
    """(path, container, key, value) of every leaf of a nested dict/list, parameter groups
    excepted (yielded whole, as one leaf under their key); empty containers are no leaves."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if key == "param_groups" or not isinstance(value, (dict, list)):
            yield path + (key,), node, key, value
        elif value:
            yield from _leaves(value, path + (key,))


def _chunk_replica(sharded: ShardedTensor) -> tuple[tuple, tuple, tuple]:
    """Where a per-parameter object sits: (global shape, offset, replica id). One object per
    parameter, whatever its tensor-parallel split: the first chunk's rank holds the main copy.
    Tensors stacked along prepended axes (megatron-core's MoE experts: one axis over the
    global expert index) are as many parameters: one object per position on those axes."""
    prepended = sharded.prepend_axis_num
    chunk = sharded.local_chunk_offset_in_global()
    first_chunk = int(any(chunk[prepended:]))
    replica = sharded.replica_id if isinstance(sharded.replica_id, tuple) else (sharded.replica_id,)
    shape = (*sharded.global_shape[:prepended], 1)
    offset = (*sharded.global_offset[:prepended], 0)
    return shape, offset, (first_chunk, *replica)


def _bound_placement(sharded: ShardedTensor) -> tuple[tuple, tuple]:
    """(global shape, offset) of state tied to its parameter's split: one object per chunk."""
    return tuple(sharded.axis_fragmentations), sharded.local_chunk_offset_in_global()


def _param_entry(sharded: ShardedTensor, name: str, value, bound: bool):
    """The sharded form of one state entry of a parameter."""
    if not bound and torch.is_tensor(value) and tuple(value.shape) == tuple(sharded.local_shape):
        return replace(
            sharded, key=f"optimizer.state.{name}.{sharded.key}", data=value, dtype=value.dtype
        )
    if bound:
        shape, offset = _bound_placement(sharded)
        return ShardedObject(
            f"optimizer.bound.{name}.{sharded.key}", value, shape, offset, sharded.replica_id
        )
    shape, offset, replica = _chunk_replica(sharded)
    return ShardedObject(f"optimizer.object.{name}.{sharded.key}", value, shape, offset, replica)


class OptimizerMapping:
    """The optimizer's state_dict() as sharded entries, and the way back.

    Each leaf of the state dict is one of: a state tensor of a model parameter (mapped by
    identity through `optimizer.state`), a plain value in the same per-parameter dict (an int
    step), a counter of a parameter group, or anything else ("local": tied to the layout).
    """

    def __init__(self, optimizer, parameters: dict[int, ShardedTensor]):
        self.optimizer = optimizer
        self.state_dict = optimizer.state_dict()
        self.owners = _state_owners(optimizer, parameters, self.state_dict)
        self.parameters = parameters
        self.entries: dict[str, object] = {}  # sharded key -> ShardedTensor/ShardedObject
        self.slots: dict[str, list] = {}  # sharded key -> [(container, key)] to write back
        self.local: dict[str, object] = {}  # "path" -> value
        self.local_slots: dict[str, tuple] = {}
        self.layout_bound: list[str] = []  # keys of state stored per split (see _param_entry)
        # MoE with expert parallelism: the state tied to the layout differs between a stage's
        # data-parallel ranks (their experts), so each keeps its own
        self.per_rank_local = experts_apart_from_dense() and any(
            sharded.prepend_axis_num for sharded in parameters.values()
        )
        self._map()

    def _map(self) -> None:
        bound = self._layout_bound_parameters()
        groups_seen = 0
        for path, container, key, value in _leaves(self.state_dict):
            if key == "param_groups":
                groups_seen = self._map_groups(value, groups_seen)
                continue
            owner = self._owner(container, value)
            if owner is None:
                self._add_local(path, container, key, value)
                continue
            sharded, name = owner if torch.is_tensor(value) else (owner[0], key)
            entry = _param_entry(sharded, name, value, id(sharded) in bound)
            self._add(entry, container, key)
            if id(sharded) in bound:
                self.layout_bound.append(entry.key)

    def _owner(self, container, value):
        """(ShardedTensor, name) of a leaf that is a model parameter's state, else None."""
        if torch.is_tensor(value):
            return self.owners.get(id(value))
        if not isinstance(container, dict):
            return None
        found = {id(self.owners[id(v)][0]): self.owners[id(v)] for v in container.values()
                 if torch.is_tensor(v) and id(v) in self.owners}  # fmt: skip
        return next(iter(found.values())) if len(found) == 1 else None

    def _layout_bound_parameters(self) -> set[int]:
        """Parameters with a state tensor of another shape than theirs: their whole state
        stays with the split (a moment kept in the basis of such a tensor would be wrong
        resharded)."""
        tensors = {id(v): v for _, _, _, v in _leaves(self.state_dict) if torch.is_tensor(v)}
        bound = set()
        for value_id, (sharded, _) in self.owners.items():
            tensor = tensors.get(value_id)
            if tensor is not None and tensor.dim() > 0 and tensor.shape != sharded.local_shape:
                bound.add(id(sharded))
        return bound

    def _map_groups(self, groups: list, seen: int) -> int:
        """Counters of parameter groups, one object per model parameter of the group."""
        live = self.optimizer.param_groups
        for offset, group in enumerate(groups):
            params = live[seen + offset]["params"] if seen + offset < len(live) else []
            mapped = [self.parameters[id(p)] for p in params if id(p) in self.parameters]
            for counter in GROUP_COUNTERS:
                if counter not in group:
                    continue
                if not mapped:
                    self._add_local((seen + offset, counter), group, counter, group[counter])
                for sharded in mapped:
                    shape, offset_, replica = _chunk_replica(sharded)
                    entry = ShardedObject(f"optimizer.group.{counter}.{sharded.key}",
                                          group[counter], shape, offset_, replica)  # fmt: skip
                    self._add(entry, group, counter)
        return seen + len(groups)

    def _add(self, entry, container, key) -> None:
        if isinstance(entry, ShardedObject):
            unique = entry.unique_key
        elif entry.prepend_axis_num:  # a rank holds several pieces of it (MoE: local experts)
            unique = f"{entry.key}@{','.join(map(str, entry.global_offset))}"
        else:
            unique = entry.key
        self.entries.setdefault(unique, entry)
        self.slots.setdefault(unique, []).append((container, key))

    def _add_local(self, path, container, key, value) -> None:
        name = "/".join(map(str, path))
        self.local[name] = value
        self.local_slots[name] = (container, key)

    def sharded_state_dict(self, *, with_local: bool) -> dict:
        entries = dict(self.entries)
        if with_local:
            entries["local"] = per_model_rank_object(
                "optimizer.local", self.local, per_data_parallel_rank=self.per_rank_local
            )
        return entries

    def write_back(self, loaded: dict) -> None:
        """Put loaded values where they came from, then load the result into the optimizer."""
        for unique, slots in self.slots.items():
            value = loaded[unique]
            for container, key in slots:
                container[key] = value
        for name, value in loaded.get("local", {}).items():
            if name in self.local_slots:  # else saved by another optimizer kind: not ours
                container, key = self.local_slots[name]
                container[key] = value
        self.optimizer.load_state_dict(self.state_dict)


def ensure_optimizer_state(optimizer, model) -> None:
    """A new torch optimizer has no state until its first step, so there is nothing to load
    into: take one step with zero gradients and learning rate 0, then restore the weights
    (the loaded checkpoint overwrites every state entry)."""
    if getattr(optimizer, "state", None):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    with torch.no_grad():
        optimizer.step()
        for param, value in zip(params, saved):
            param.copy_(value)
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- writing
class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist format written by torch's own synchronous
    `FileSystemWriter`, in this process. megatron-core 0.16's writer starts a spawned manager
    process and forked writer processes per save and calls CUDA (`torch.cuda.synchronize`,
    a failure flag on the current CUDA device), which fails without CUDA. The files are
    the same format: megatron-core's planner decides what each rank writes (main replicas
    only) and megatron-core's loader reads them."""

    def __init__(self):
        super().__init__(FORMAT, 1)

    def save(self, sharded_state_dict: dict, checkpoint_dir) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        checkpoint.save(
            mcore_to_pyt_state_dict(flat, False),
            storage_writer=checkpoint.FileSystemWriter(str(checkpoint_dir), thread_count=1),
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


def write(directory: str, sharded_state_dict: dict, manifest: bool = False) -> None:
    """Write into `directory` + STAGING_SUFFIX, then rename it to `directory` (collective);
    `manifest`: hash the complete files into integrity.MANIFEST before the rename."""
    staging = directory + STAGING_SUFFIX
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        os.makedirs(staging)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict, staging, sharded_strategy=InProcessSaveStrategy())
    dist.barrier()  # every rank's files are complete
    if dist.get_rank() == 0:
        if manifest:
            integrity.write_manifest(staging)
        _replace_directory(staging, directory)
    dist.barrier()


def _replace_directory(staging: str, directory: str) -> None:
    """Rename the complete staging directory into place (an older save of the same
    iteration is moved aside first and removed after)."""
    aside = directory + ".old"
    if os.path.exists(directory):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(directory, aside)
    os.replace(staging, directory)
    shutil.rmtree(aside, ignore_errors=True)
    descriptor = os.open(os.path.dirname(directory) or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself reaches the disk before the tracker does
    finally:
        os.close(descriptor)


def remove_staging(directory: str) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(directory + STAGING_SUFFIX, ignore_errors=True)


# ---------------------------------------------------------------------------- reading
def check_files(directory: str) -> str | None:
    """None if the checkpoint's files are all there and long enough, else the problem."""
    if not is_dist_checkpoint(directory):
        return f"{directory} has no {METADATA_FILE} (not a complete {FORMAT} checkpoint)"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception as error:  # a damaged .metadata file, in any of torch's ways
        return f"{directory}: unreadable {FORMAT} metadata ({first_line(error)})"
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"missing {path}"
        if os.path.getsize(path) < size:
            return f"checkpoint file {path} is truncated or corrupt ({size} bytes expected)"
    return None


def read_common(directory: str) -> tuple[dict | None, str | None]:
    """(the checkpoint's common state, None) or (None, the problem in words)."""
    problem = check_files(directory)
    if problem is not None:
        return None, problem
    try:
        common = dist_checkpointing.load_common_state_dict(directory)
    except Exception as error:
        return None, f"checkpoint file {directory}/common.pt is truncated or corrupt " + (
            f"({first_line(error)})"
        )
    if not isinstance(common, dict) or "iteration" not in common:
        return None, f"checkpoint {directory} is not one of our checkpoints"
    return common, None


def load(directory: str, sharded_state_dict: dict, strict: str) -> dict:
    """megatron-core's load; its errors become one line naming the checkpoint."""
    try:
        loaded = dist_checkpointing.load(sharded_state_dict, directory, strict=strict)
    except Exception as error:
        raise UserError(
            f"--load {directory}: the checkpoint does not fit this model ({first_line(error)})"
        ) from None
    return loaded[0] if isinstance(loaded, tuple) else loaded


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(directory: str, common: dict, *, model, optimizer, checkpoint) -> None:
    """Model, optimizer (unless --no-save-optim) and RNG (unless --no-save-rng) under their
    global keys; `common` (iteration, samples, recorded arguments, LR schedule) in common.pt.
    `checkpoint` is the run's `CheckpointConfig`."""
    model_sharded = model_sharded_state_dict(model)
    sharded = {"model": model_sharded, **common, "format": FORMAT, "saved_parts": []}
    if not checkpoint.no_save_optim:
        mapping = OptimizerMapping(optimizer, sharded_parameters(model_sharded))
        sharded["optimizer"] = mapping.sharded_state_dict(with_local=True)
        sharded["saved_parts"].append("optimizer")
    if not checkpoint.no_save_rng:
        sharded["rng_state"] = per_model_rank_object("rng_state", torch.get_rng_state())
        sharded["saved_parts"].append("rng_state")
    write(directory, sharded, manifest=checkpoint.verify_integrity)


def saved_layout(payload: dict) -> tuple | None:
    """(tensor, pipeline) sizes the checkpoint was saved with, if recorded."""
    recorded = payload.get("args") or {}
    sizes = (
        recorded.get("tensor_model_parallel_size"),
        recorded.get("pipeline_model_parallel_size"),
    )
    return None if None in sizes else sizes


def same_layout(payload: dict) -> bool:
    pp, _, tp, _, _, _ = _layout()
    return saved_layout(payload) in (None, (tp, pp))


def restore_checkpoint(payload: dict, *, model, optimizer, load_optim, load_rng, strict) -> dict:
    """Load the model (and optimizer, RNG) from the checkpoint `payload` describes (its
    common state, from `read_common`); returns what was loaded besides the model."""
    directory = payload["directory"]
    model_sharded = model_sharded_state_dict(model)
    request = {"model": model_sharded}
    mapping = None
    if load_optim:
        ensure_optimizer_state(optimizer, model)
        mapping = OptimizerMapping(optimizer, sharded_parameters(model_sharded))
        _check_local_state_fits(mapping, payload)
        request["optimizer"] = mapping.sharded_state_dict(with_local=bool(mapping.local))
    if load_rng and same_layout(payload):
        request["rng_state"] = per_model_rank_object("rng_state", None)
    elif load_rng and dist.get_rank() == 0:
        print(f"> {directory} was saved with tensor x pipeline {saved_layout(payload)}: its "
              f"per-rank RNG state does not apply to this layout and is not loaded",
              flush=True)  # fmt: skip
    loaded = load(directory, request, strict)
    _load_model(model, loaded["model"], directory)
    if mapping is not None:
        mapping.write_back(loaded["optimizer"])
    if "rng_state" in loaded:
        torch.set_rng_state(loaded["rng_state"])
    return loaded


def _check_local_state_fits(mapping: OptimizerMapping, payload: dict) -> None:
    """State tied to the layout loads into the saving layout only: one line otherwise."""
    tied = list(mapping.local) + mapping.layout_bound
    recorded = payload.get("args") or {}
    saved_experts = tuple(recorded.get(name) for name in (
        "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size"))  # fmt: skip
    if tied and mapping.per_rank_local and saved_experts != expert_layout():
        raise UserError(
            f"--load {payload['directory']}: this optimizer keeps state that does not reshard "
            f"({tied[0]}, ...), saved with expert x expert tensor x data parallel "
            f"{saved_experts}: load it with that layout, or pass --no-load-optim"
        )
    if tied and not same_layout(payload):
        example = tied[0]
        raise UserError(
            f"--load {payload['directory']}: this optimizer keeps state that does not reshard "
            f"({example}, ...), saved with tensor x pipeline {saved_layout(payload)}: load it "
            f"with that layout, or pass --no-load-optim"
        )


def _load_model(model, state: dict, directory: str) -> None:
    try:
        model.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(
            f"--load {directory}: the checkpoint does not fit this model ({first_line(error)})"
        ) from None
