"""Fully sharded data parallelism (ZeRO-3): `--use-torch-fsdp2`, and `--use-megatron-fsdp` with
`--data-parallel-sharding-strategy optim_grads_params` or `optim_grads`.

Built on torch's `fully_shard` (FSDP2). Each transformer layer of a stage (the decoder's and
the multi-token-prediction block's) is one unit, sharded over the stage's data-parallel x
context-parallel group; the stage's root module is the unit of everything else (embedding,
output layer, final norm), so that a tied embedding and output weight stay one parameter of one
unit. A MoE layer's routed experts are a unit of their own over the expert-data-parallel group,
whose ranks hold the same experts.

Between passes each rank holds 1/D of every unit's rows, in fp32: they are the main weights,
and the optimizer steps them in place (optimizer/fsdp_optimizer.py). A pass all-gathers a
unit's weights in the model's dtype just before it runs and frees them after it: after the
forward too unless reshard-after-forward is off (`--torch-fsdp2-no-reshard-after-forward`,
Megatron-FSDP's `optim_grads`), then the gathered weights stay from the forward to the backward.
Each layer's forward starts the next layer's all-gather (its backward the previous layer's), so
a gather can overlap a layer's compute (`_prefetch_neighbours`; `--no-fsdp-prefetch` leaves the
forward's out). The backward reduce-scatters each unit's gradient in fp32 onto the rank's rows,
averaged over
the unit's group (the step turns the experts' mean over the expert-data-parallel group into
their sum over it divided by the data-parallel size, as Megatron's DDP). Every backward
reduces, so the schedule may step a stage after any backward (PACI steps after its a-th) with
the gradients complete.

torch_dist and torch checkpoints stay those of an unsharded run (`unsharded_for_checkpoint`):
a save gathers each parameter for the write and a load writes the rows back, so a run may
resume with or without FSDP; fsdp_dtensor writes the rows as they are
(checkpointing/fsdp_dtensor.py).
"""

import itertools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

_FSDP_PACKAGE = "torch.distributed.fsdp"
_MESHES = itertools.count()


def is_fully_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _marks(model: torch.nn.Module) -> dict[str, dict]:
    """The marks on megatron-core's and our parameters (tensor_model_parallel, partition_dim,
    sequence_parallel, moe_expert, ...), which fully_shard's new parameters must keep."""
    return {name: dict(vars(param)) for name, param in model.named_parameters()}


def _restore_marks(model: torch.nn.Module, marks: dict[str, dict]) -> None:
    for name, param in model.named_parameters():
        for key, value in marks.get(name, {}).items():
            setattr(param, key, value)


def _mesh(group, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over `group`, named anew for each run of a process: meshes over
    the same ranks compare equal, and DTensor's caches would hand a later run (the functional
    tests run several per process) a mesh of destroyed groups."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=(f"shard{next(_MESHES)}",))


def _routed_experts(layer: torch.nn.Module) -> torch.nn.Module | None:
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None or not any(getattr(p, "moe_expert", False) for p in experts.parameters()):
        return None
    return experts


def shard_model(model: torch.nn.Module, *, group, expert_group=None,
                compute_dtype: torch.dtype = torch.float32,
                reshard_after_forward: bool = True,
                prefetch: bool = True) -> torch.nn.Module:  # fmt: skip
    """Shards `model` (a stage, or `ModelChunks`) in place over `group` (the routed experts over
    `expert_group`); the rows are fp32, the passes run in `compute_dtype`. The model's weights
    were already rounded to that dtype."""
    marks = _marks(model)
    for param in model.parameters():
        param.data = param.data.float()  # the rows are the fp32 main weights
    device = next(model.parameters()).device
    precision = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,  # RoPE and masks keep their dtypes, as without FSDP
    )
    mesh = _mesh(group, device)
    expert_mesh = None if expert_group is None else _mesh(expert_group, device)
    chunks = list(model.chunks) if hasattr(model, "chunks") else [model]
    for chunk in chunks:
        layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
        for layer in layers:
            experts = _routed_experts(layer)
            if experts is not None:
                fully_shard(experts, mesh=expert_mesh or mesh, mp_policy=precision,
                            reshard_after_forward=reshard_after_forward)  # fmt: skip
            fully_shard(layer, mesh=mesh, mp_policy=precision,
                        reshard_after_forward=reshard_after_forward)  # fmt: skip
        fully_shard(chunk, mesh=mesh, mp_policy=precision, reshard_after_forward=False)
        if prefetch:  # off only to measure what it buys (--no-fsdp-prefetch)
            _prefetch_neighbours(layers)
    _restore_marks(model, marks)
    model.fsdp_compute_dtype = compute_dtype  # what the optimizer's checkpoints write
    return model


def _prefetch_neighbours(layers: list[torch.nn.Module]) -> None:
    """Each layer's all-gather of the next layer's weights is issued when its own forward
    starts (of the previous layer's when its backward starts), so the gather runs while the
    layer computes: within one pass, so a step between two passes never finds a gather in
    flight. The gathered values are the same: no number changes."""
    for before, after in zip(layers, layers[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])


def reshard(model: torch.nn.Module) -> None:
    """Frees the gathered weights that forward-only passes leave (the root unit's, and every
    unit's without reshard-after-forward): only a backward frees them otherwise."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def sharding_groups(model: torch.nn.Module) -> tuple:
    """(the dense parameters' sharding group, the routed experts' where it has other ranks,
    else None)."""
    groups = {}
    for param in model.parameters():
        if isinstance(param, DTensor):
            groups.setdefault(getattr(param, "moe_expert", False), param.device_mesh.get_group())
    dense, experts = groups.get(False), groups.get(True)
    if experts is None or dense is None:
        return dense or experts, None
    same = dist.get_process_group_ranks(dense) == dist.get_process_group_ranks(experts)
    return dense, None if same else experts


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded parameter (or gradient), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def summed_over_shards(values: list[float], params) -> tuple[float, float]:
    """(dense, routed experts) sums of per-rank figures of each rank's rows, over the dense
    and the experts' sharding groups; the figures as they are when nothing is sharded."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return float(values[0]), float(values[1])
    groups = {}
    for param in sharded:
        groups.setdefault(getattr(param, "moe_expert", False), param.device_mesh.get_group())
    totals = []
    for index, value in enumerate(values):
        total = torch.tensor([float(value)], dtype=torch.float64, device=sharded[0].device)
        group = groups.get(bool(index), groups.get(False))
        dist.all_reduce(total, group=group)
        totals.append(float(total))
    return totals[0], totals[1]


# ---------------------------------------------------------------------------- rows
def row_range(param: DTensor) -> tuple[int, int]:
    """[start, end) of this rank's rows of `param` (dimension 0, torch.chunk's split)."""
    mesh = param.device_mesh
    shards, rank = mesh.size(), mesh.get_local_rank()
    rows = param.shape[0]
    per_rank = -(-rows // shards)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def full_of(param: DTensor, rows: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose rows (of `param`'s layout) this rank holds as `rows`: collective
    over `param`'s group."""
    return DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False).full_tensor()  # fmt: skip


def rows_of(param: DTensor, full: torch.Tensor) -> torch.Tensor:
    start, end = row_range(param)
    return full[start:end]


# ---------------------------------------------------------------------------- checkpoints
def _sharded_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, DTensor]]:
    """(module, name, parameter) of every sharded parameter, a shared one in each module."""
    return [
        (module, name, param)
        for module in model.modules()
        for name, param in module._parameters.items()
        if isinstance(param, DTensor)
    ]


@contextmanager
def unsharded_for_checkpoint(model: torch.nn.Module, optimizer, *, load: bool = False,
                             skip: bool = False):  # fmt: skip
    """A checkpoint's save or load of a fully sharded model sees whole parameters in the
    model's dtype (`full_parameters`) and the optimizer names them; after a load the rows take
    the model's values, then the optimizer's fp32 main weights where it has them. `skip`: a
    checkpoint of the rows themselves (fsdp_dtensor)."""
    if skip or not is_fully_sharded(model):
        yield
        return
    with full_parameters(model, model.fsdp_compute_dtype, load=load) as whole:
        optimizer.stand_ins = whole
        try:
            yield
        finally:
            optimizer.stand_ins = {}
    if load:
        optimizer.finish_load()


@contextmanager
def full_parameters(model: torch.nn.Module, dtype: torch.dtype, *, load: bool = False):
    """Within: the model holds whole parameters in `dtype` (every rank gathers them: a
    collective over the data-parallel groups), so a checkpoint reads and writes the model as
    an unsharded run does; yields {id(sharded parameter): whole parameter}. With `load`, each
    rank's rows take the whole parameters' values on the way out. A parameter shared by two
    modules stays one parameter."""
    slots, whole = _sharded_slots(model), {}
    fsdp_hooks = _without_fsdp_load_hooks(model)
    for module, name, param in slots:
        if id(param) not in whole:
            with torch.no_grad():
                values = full_of(param, param.to_local()).to(dtype)
            whole[id(param)] = torch.nn.Parameter(values, requires_grad=param.requires_grad)
            for key, value in vars(param).items():
                setattr(whole[id(param)], key, value)
        module._parameters[name] = whole[id(param)]
    try:
        yield whole
    finally:
        for module, name, param in slots:
            module._parameters[name] = param
        for module, hooks in fsdp_hooks:
            module._load_state_dict_post_hooks.update(hooks)
        if load:
            with torch.no_grad():
                for param in {id(p): p for _, _, p in slots}.values():
                    param.to_local().copy_(rows_of(param, whole[id(param)].detach().float()))


def _without_fsdp_load_hooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]]:
    """Takes fully_shard's load_state_dict post-hooks off the modules and returns them: they
    re-read each sharded parameter from its module, which holds the whole one meanwhile."""
    taken = []
    for module in model.modules():
        hooks = module._load_state_dict_post_hooks
        ours = {k: h for k, h in hooks.items() if h.__module__.startswith(_FSDP_PACKAGE)}
        for key in ours:
            del hooks[key]
        if ours:
            taken.append((module, ours))
    return taken


def sharded_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of sharded rows (the memory report)."""
    return sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()
               if isinstance(p, DTensor))  # fmt: skip
