"""`--use-distributed-optimizer`: fp32 main weights and optimizer state sharded over the
stage's data-parallel group (Megatron's distributed optimizer, ZeRO stage 1 with fp32
gradient accumulation).

The stage's trainable parameters are laid end to end in one flat fp32 gradient buffer
(main_params.GradBuffer), padded to a multiple of the data-parallel size D; rank r owns the
contiguous range [r S, (r + 1) S), S = padded / D. Each parameter's piece of that range is an
fp32 main weight of its own, and the optimizer steps only those pieces: element-wise
optimizers (adam, sgd, lion, adan) then give exactly the unsharded update.

One step:

1. gradients: the flat buffer is reduce-scattered (each rank receives its range, summed; NCCL
   and, since torch 2.x, gloo), then divided by D (or averaged by the collective itself with
   --ddp-average-in-collective);
2. gradient norm: the sum of squares of my range, all-reduced over the data-parallel group,
   then over the schedule's reach (tensor parallel, plus pipeline under 1F1B-flush);
3. the optimizer steps my pieces; each rank writes its updated range, in the model's dtype,
   into a flat buffer, `all_gather`s it, and copies every parameter out of it. With
   --overlap-param-gather the step only launches the gathers, one per bucket of the gradient
   reduction, and the forward waits for each bucket when it reads it (param_gather.py).

With --num-distributed-optimizer-instances I > 1 there are I copies, each sharded over D / I
ranks (megatron-core's partial data-parallel groups); step 1 then adds an all-reduce of my
range over the ranks that own it in the other copies.

All collectives stay inside the stage's data-parallel group: PACI keeps no cross-stage
collective. `state_dict()` gathers the shards into the unsharded optimizer's per-parameter
format (the same dict `ReplicatedMainOptimizer` or a plain fp32 optimizer writes), and
`load_state_dict()` takes this rank's slice of such a dict, so checkpoints do not depend on
the data-parallel size or on whether the optimizer was sharded.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.distributed.data_parallel import Bucket, BucketStrategy
from megatron.training.optimizer.main_params import MainParamsOptimizer, main_copy
from megatron.training.optimizer.suite import decay_groups, group_key


@dataclass(eq=False)  # hashed by identity
class Piece:
    """The part of parameter `index` that this rank owns."""

    index: int  # the parameter's position in the stage's trainable parameters
    param: torch.nn.Parameter
    start: int  # range in the flattened parameter
    end: int
    shard_offset: int  # where it starts in this rank's range of the flat buffer
    main: torch.nn.Parameter  # fp32, 1-D, what the optimizer steps


class ShardedMainOptimizer(MainParamsOptimizer):
    def __init__(self, model: torch.nn.Module, group, replica_group=None, decoupled_lr=None,
                 mup=None):  # fmt: skip
        """Sharded over `group`; `replica_group` (--num-distributed-optimizer-instances > 1)
        holds the ranks of the other optimizer copies that own the same range; `decoupled_lr`
        (suite.decoupled_lr_of) and `mup` (suite.mup_settings_of) group the parameters as the
        inner optimizer does."""
        self.group, self.replica_group = group, replica_group
        self.decoupled_lr, self.mup = decoupled_lr, mup
        self.shards, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
        super().__init__(model, shards=self.shards)
        self.shard_numel = self.buffer.padded_numel // self.shards
        self.low = self.rank * self.shard_numel
        self.high = self.low + self.shard_numel
        self.pieces = self._my_pieces()
        # --overlap-param-gather: the step's gathers in buckets (param_gather.py), set by
        # build.attach_reduction; None: one blocking all-gather in the step
        self.param_gather = None

    @property
    def norm_group(self):
        return self.group  # each rank's squared norm covers its range only

    def _my_pieces(self) -> list[Piece]:
        pieces = []
        for index, (param, offset) in enumerate(self.buffer.views()):
            first, last = max(offset, self.low), min(offset + param.numel(), self.high)
            if first >= last:
                continue
            start, end = first - offset, last - offset
            main = main_copy(param, param.detach().reshape(-1)[start:end].float().clone())
            pieces.append(Piece(index, param, start, end, first - self.low, main))
        return pieces

    @property
    def main_param_bytes(self) -> int:
        return sum(p.main.numel() * p.main.element_size() for p in self.pieces)

    def named_main(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(self.named[p.index][0], p.main) for p in self.pieces]

    @torch.no_grad()
    def refresh_from_model(self, only: torch.nn.Parameter | None = None) -> None:
        """My main pieces from the model's weights (after a load; `only`: one parameter's)."""
        if self.param_gather is not None and only is None:
            self.param_gather.discard()  # the loaded weights replace the step's update
        elif self.param_gather is not None:
            self.param_gather.check_landed([only])  # written before its gather landed: lost
        for piece in self.pieces:
            if only is None or piece.param is only:
                piece.main.copy_(piece.param.detach().reshape(-1)[piece.start : piece.end])

    # ------------------------------------------------------------------ gradients
    def _my_range(self) -> torch.Tensor:
        return self.buffer.flat[self.low : self.high]

    def _piece_gradient(self, piece: Piece) -> torch.Tensor:
        start = self.low + piece.shard_offset
        return self.buffer.flat[start : start + piece.main.numel()]

    def average_over(self, group, *, in_collective: bool = False) -> None:
        """My range of the gradients averaged over the data-parallel `group`: reduce-scattered
        over this copy's ranks, then all-reduced over the copies (summed, or averaged by the
        collectives with --ddp-average-in-collective)."""
        op = dist.ReduceOp.AVG if in_collective else dist.ReduceOp.SUM
        if self.shards > 1:
            mine = torch.empty_like(self._my_range())
            dist.reduce_scatter_tensor(mine, self.buffer.flat, op=op, group=self.group)
            self._my_range().copy_(mine)
        if self.replicas > 1:
            dist.all_reduce(self._my_range(), op=op, group=self.replica_group)
        if not in_collective:
            self._my_range().div_(self.shards * self.replicas)

    def squared_norm(self, counted) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.buffer.flat.device)
        for piece in self.pieces:
            if counted(piece.param):
                total += self._piece_gradient(piece).pow(2).sum()
        return total

    def scale(self, factor: float) -> None:
        self._my_range().mul_(factor)

    def first_gradient(self) -> torch.Tensor:
        return self._my_range()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        for piece in self.pieces:
            piece.main.grad = self._piece_gradient(piece)
        self.inner.step()
        if self.param_gather is None:
            self._gather_params()
        else:
            self.param_gather.launch()

    def finish_param_gather(self) -> None:
        """Every parameter holds the last step's update (--overlap-param-gather: the gathers
        still in flight land now)."""
        if self.param_gather is not None:
            self.param_gather.finish()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated range, in the model's dtype, into every rank's parameters."""
        flat = self.buffer.flat
        mine = torch.zeros(self.shard_numel, dtype=self.dtype, device=flat.device)
        for piece in self.pieces:
            mine[piece.shard_offset : piece.shard_offset + piece.main.numel()] = piece.main
        full = torch.empty(self.buffer.padded_numel, dtype=self.dtype, device=flat.device)
        dist.all_gather_into_tensor(full, mine, group=self.group)
        for param, offset in self.buffer.views():
            param.copy_(full[offset : offset + param.numel()].view_as(param))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Collective over the data-parallel group: the unsharded per-parameter format."""
        from megatron.training.optimizer.sharded_state import gather_state_dict

        self.finish_param_gather()  # a checkpoint holds the model's updated weights too
        state = gather_state_dict(self)
        state.update(self._extra_state())
        return state

    def _own_inner_state(self, inner: dict) -> dict:
        """This rank's slice of the unsharded per-parameter state (`load_state_dict`)."""
        from megatron.training.optimizer.sharded_state import slice_state_dict

        return slice_state_dict(self, inner)

    def _load_main_params(self, mains: dict[int, torch.Tensor]) -> None:
        for piece in self.pieces:
            piece.main.copy_(mains[piece.index].reshape(-1)[piece.start : piece.end])

    def state_index_params(self) -> list[torch.nn.Parameter]:
        """The model parameter of each entry number of `state_dict()["state"]` (the unsharded
        optimizer's numbering)."""
        from megatron.training.optimizer.sharded_state import _unsharded_numbering

        numbering, _ = _unsharded_numbering(self)
        by_number = {number: model_index for model_index, number in numbering.items()}
        return [self.params[by_number[k]] for k in range(len(by_number))]

    def global_groups(self) -> list[tuple[tuple, list[int]]]:
        """(`group_key`, parameter indices) of each optimizer group as the unsharded optimizer
        builds them (its state numbers parameters in this order)."""
        position = {id(p): i for i, p in enumerate(self.params)}
        groups = decay_groups(self.named, self.decoupled_lr, self.mup)
        return [(group_key(g), [position[id(p)] for p in g["params"]]) for g in groups]


class ShardedReduceScatter(BucketStrategy):
    """The distributed optimizer's buckets (distributed/data_parallel.py): each bucket's part of
    every rank's range reduce-scattered to that rank (uneven parts; one bucket is the whole
    buffer, the collective of `ShardedMainOptimizer.average_over`), into a buffer of its own,
    then over the other optimizer copies, divided and copied into this rank's range."""

    def __init__(self, optimizer: ShardedMainOptimizer, *, in_collective: bool = False):
        self.optimizer, self.in_collective = optimizer, in_collective
        self.flat_ranges: list[tuple[int, int]] = []
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def group(self):
        return self.optimizer.group

    def set_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """The buckets' parameter index ranges, as flat-buffer ranges (the padding at the end
        of the buffer goes with the bucket that holds the last parameter)."""
        buffer = self.optimizer.buffer
        ends = buffer.offsets[1:] + [buffer.padded_numel]
        self.flat_ranges = [(buffer.offsets[a], ends[b - 1]) for a, b in ranges]

    def _part(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        start, end = self.flat_ranges[bucket.index]
        size = self.optimizer.shard_numel
        low, high = max(start, rank * size), min(end, (rank + 1) * size)
        return low, max(low, high)

    def start(self, bucket: Bucket) -> list:
        opt = self.optimizer
        op = dist.ReduceOp.AVG if self.in_collective else dist.ReduceOp.SUM
        flat = opt.buffer.flat
        if len(self.flat_ranges) == 1:
            out = torch.empty_like(opt._my_range())
            self.outputs[bucket.index] = out
            if opt.shards == 1:
                out.copy_(opt._my_range())
                return []
            return [dist.reduce_scatter_tensor(out, flat, op=op, group=opt.group, async_op=True)]
        parts = [self._part(bucket, rank) for rank in range(opt.shards)]
        low, high = parts[opt.rank]
        out = torch.empty(high - low, dtype=flat.dtype, device=flat.device)
        self.outputs[bucket.index] = out
        if opt.shards == 1:
            out.copy_(flat[low:high])
            return []
        inputs = [flat[a:b] for a, b in parts]
        return [dist.reduce_scatter(out, inputs, op=op, group=opt.group, async_op=True)]

    def finish(self, bucket: Bucket) -> None:
        opt = self.optimizer
        out = self.outputs.pop(bucket.index)
        if opt.replicas > 1:
            op = dist.ReduceOp.AVG if self.in_collective else dist.ReduceOp.SUM
            dist.all_reduce(out, op=op, group=opt.replica_group)
        if not self.in_collective:
            out.div_(opt.shards * opt.replicas)
        if len(self.flat_ranges) == 1:
            opt._my_range().copy_(out)
        else:
            low, high = self._part(bucket, opt.rank)
            opt.buffer.flat[low:high].copy_(out)

    def discard(self, bucket: Bucket) -> None:
        self.outputs.pop(bucket.index, None)

    def bytes_of(self, bucket: Bucket) -> int:
        start, end = self.flat_ranges[bucket.index]
        return (end - start) * self.optimizer.buffer.flat.element_size()


# ---------------------------------------------------------------------------- MoE experts
class _SomeParameters:
    """What a main-params optimizer reads from a model, restricted to some parameters."""

    def __init__(self, model: torch.nn.Module, keep):
        self.model, self.keep = model, keep
        self.config = getattr(model, "config", None)

    def named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters() if self.keep(p))

    def register_load_state_dict_post_hook(self, hook):
        return self.model.register_load_state_dict_post_hook(hook)


def is_routed_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "moe_expert", False)


def dense_and_expert_views(model: torch.nn.Module):
    """(the model's dense parameters, its routed experts'), as models for the optimizers."""
    dense = _SomeParameters(model, lambda p: not is_routed_expert(p))
    return dense, _SomeParameters(model, is_routed_expert)


class ExpertShardedOptimizer:
    """--use-distributed-optimizer with expert parallelism: two sharded optimizers, the dense
    parameters' over the data-parallel group and the routed experts' over the expert-data-
    parallel group (megatron-core's layout: each expert's state lives on the ranks that hold
    the expert), seen by the step, the LR schedule and the memory report as one. `parts`
    tells the step which gradients reduce over which groups (optimizer/build.py)."""

    def __init__(self, dense: ShardedMainOptimizer, experts: ShardedMainOptimizer):
        self.dense, self.experts = dense, experts
        self.parts = (dense, experts)
        self.loss_scaler = dense.loss_scaler
        self.params = dense.params + experts.params
        self.dtype = dense.dtype

    norm_group = None  # each part's own (the step reduces them apart)

    @property
    def param_groups(self) -> list[dict]:
        return self.dense.param_groups + self.experts.param_groups

    @property
    def state(self) -> dict:
        return {**self.dense.state, **self.experts.state}

    @property
    def main_param_bytes(self) -> int:
        return self.dense.main_param_bytes + self.experts.main_param_bytes

    @staticmethod
    def gradient_of(param: torch.nn.Parameter) -> torch.Tensor:
        return param.main_grad

    def average_over(self, group, *, in_collective: bool = False) -> None:
        raise RuntimeError("the experts reduce over their own group: average_dense_and_experts")

    def squared_norm(self, counted) -> torch.Tensor:
        raise RuntimeError("each part has its own norm group: reduce `parts` apart")

    def average_dense_and_experts(self, data_parallel_group, data_parallel_size: int, *,
                                  in_collective: bool = False) -> None:  # fmt: skip
        """Dense: the mean over the data-parallel group; experts: the sum over the expert-data-
        parallel group over the data-parallel size (build.ExpertGroups)."""
        self.dense.average_over(data_parallel_group, in_collective=in_collective)
        self.experts.average_over(self.experts.group, in_collective=in_collective)
        expert_data_parallel_size = self.experts.shards * self.experts.replicas
        self.experts._my_range().mul_(expert_data_parallel_size / data_parallel_size)

    def scale(self, factor: float) -> None:
        for part in self.parts:
            part.scale(factor)

    def first_gradient(self) -> torch.Tensor:
        return self.dense.first_gradient()

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def refresh_from_model(self, only: torch.nn.Parameter | None = None) -> None:
        for part in self.parts:
            part.refresh_from_model(only)

    # ------------------------------------------------------------------ checkpoints
    # One unsharded per-parameter state dict, as one optimizer over `params` (the dense
    # parameters, then the experts) would write: the experts' entries, groups and main
    # weights numbered after the dense ones. Each part gathers over its own group.
    def state_dict(self) -> dict:
        dense, experts = self.dense.state_dict(), self.experts.state_dict()
        shift = len(self.dense.params)
        merged = dict(dense)
        merged["state"] = {**dense["state"],
                           **{k + shift: v for k, v in experts["state"].items()}}  # fmt: skip
        merged["param_groups"] = dense["param_groups"] + [
            {**g, "params": [i + shift for i in g["params"]]} for g in experts["param_groups"]
        ]
        if "main_params" in dense or "main_params" in experts:
            merged["main_params"] = {
                **dense.get("main_params", {}),
                **{i + shift: m for i, m in experts.get("main_params", {}).items()},
            }
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        shift, groups = len(self.dense.params), len(self.dense.global_groups())
        dense, experts = dict(state_dict), dict(state_dict)
        dense["state"] = {k: v for k, v in state_dict["state"].items() if k < shift}
        experts["state"] = {k - shift: v for k, v in state_dict["state"].items() if k >= shift}
        dense["param_groups"] = state_dict["param_groups"][:groups]
        experts["param_groups"] = [{**g, "params": [i - shift for i in g["params"]]}
                                   for g in state_dict["param_groups"][groups:]]  # fmt: skip
        if "main_params" in state_dict:
            mains = state_dict["main_params"]
            dense["main_params"] = {i: m for i, m in mains.items() if i < shift}
            experts["main_params"] = {i - shift: m for i, m in mains.items() if i >= shift}
        self.dense.load_state_dict(dense)
        self.experts.load_state_dict(experts)

    def state_index_params(self) -> list[torch.nn.Parameter]:
        return self.dense.state_index_params() + self.experts.state_index_params()
