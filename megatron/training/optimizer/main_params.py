"""Where the optimizer's weights and gradients live: the model's own (fp32), or fp32 *main*
copies owned by the optimizer (mixed precision, Megatron's `--bf16` / `--fp16`).

* `ModelGradients`: fp32 runs without `--use-distributed-optimizer`. The optimizer steps the
  model's parameters and reads `param.grad`; exactly the arithmetic of before main weights
  existed, so fp32 numbers do not move.
* `GradBuffer`: gradients accumulated in fp32 across microbatches. One flat fp32 buffer per
  stage, padded to a multiple of the data-parallel size, each parameter's `main_grad` a view
  into it. A post-accumulate-grad hook adds `param.grad` (bf16/fp16/fp32) to `main_grad`,
  divided by the stage's fp16 loss scale when there is one, and frees `param.grad`; the
  data-parallel average then runs on the fp32 buffer (Megatron's
  `--accumulate-allreduce-grads-in-fp32`, which is what `--bf16` does here).
* `MainParamsOptimizer` (`ReplicatedMainOptimizer` here, the sharded one in
  distributed_optimizer.py): the optimizer steps fp32 copies and the result is copied back
  into the (bf16/fp16) model parameters.

Every class offers the gradient operations `StageOptimizerStep` needs: the gradient of a
parameter, the data-parallel average, the squared norm, scaling (clipping) and the step.
"""

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def reduce_as_one(tensors: list[torch.Tensor], reduce) -> None:
    """`reduce` (in place) on the tensors laid end to end, copied back: one collective for
    all of them instead of one each."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    reduce(flat)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def average_over_group(flat: torch.Tensor, group, *, in_collective: bool = False) -> None:
    """`flat` becomes its mean over the data-parallel `group`: a sum then a division, or
    the collective's own average (`--ddp-average-in-collective`, ReduceOp.AVG)."""
    if _group_size(group) == 1:
        return
    if in_collective:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
        return
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------- fp32, as before
class ModelGradients:
    """The optimizer steps the model's parameters; gradients are `param.grad`."""

    norm_group = None  # the squared norm covers whole parameters: no extra reduction
    main_param_bytes = 0

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params

    @staticmethod
    def gradient_of(param: torch.nn.Parameter) -> torch.Tensor:
        if param.grad is None:  # unused this step: its gradient is zero, not missing
            param.grad = torch.zeros_like(param)
        return param.grad

    def average_over(self, group, *, in_collective: bool = False) -> None:
        grads = [self.gradient_of(p) for p in self.params]
        if _group_size(group) > 1:
            reduce_as_one(
                grads, lambda flat: average_over_group(flat, group, in_collective=in_collective)
            )

    def squared_norm(self, counted) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for param in self.params:
            if counted(param):
                total += self.gradient_of(param).detach().float().pow(2).sum()
        return total

    def scale(self, factor: float) -> None:
        for param in self.params:
            self.gradient_of(param).mul_(factor)

    def first_gradient(self) -> torch.Tensor:
        return self.gradient_of(self.params[0])

    def set_aside(self) -> list:
        """The gradients as they are (PACI's deferred step: the next step's partial sums),
        taken out of the way; `bring_back` puts them back."""
        kept = [param.grad for param in self.params]
        for param in self.params:
            param.grad = None
        return kept

    def bring_back(self, kept: list) -> None:
        for param, grad in zip(self.params, kept):
            param.grad = grad


# ---------------------------------------------------------------------------- fp32 accumulation
class GradBuffer:
    """fp32 `main_grad` for every parameter, views into one flat buffer."""

    def __init__(self, params: list[torch.nn.Parameter], *, shards: int = 1):
        self.params = params
        self.offsets, total = [], 0
        for param in params:
            self.offsets.append(total)
            total += param.numel()
        self.numel = total
        self.padded_numel = -(-total // shards) * shards
        self.flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=params[0].device)
        self.loss_scaler = None  # fp16: gradients arrive multiplied by its scale
        for param, start in zip(params, self.offsets):
            param.main_grad = self.flat[start : start + param.numel()].view_as(param)
            param.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, param: torch.nn.Parameter) -> None:
        """After each backward: add this microbatch's gradient in fp32, unscaled, and free it."""
        grad = param.grad.float()
        if self.loss_scaler is None:
            param.main_grad.add_(grad)
        else:
            param.main_grad.add_(grad, alpha=1.0 / self.loss_scaler.scale)
        param.grad = None

    def views(self):
        """(parameter, start in the flat buffer) pairs."""
        return zip(self.params, self.offsets)

    def zero(self) -> None:
        self.flat.zero_()


# ---------------------------------------------------------------------------- main weights
def main_copy(param: torch.nn.Parameter, values: torch.Tensor) -> torch.nn.Parameter:
    """An fp32 main weight for `param`, with the marks the optimizer groups read."""
    main = torch.nn.Parameter(values)
    main.model_ndim = param.ndim  # weight decay follows the parameter's shape
    main.follows_first_stage = getattr(param, "follows_first_stage", False)
    main.decayed_norm = getattr(param, "decayed_norm", False)  # --apply-wd-to-qk-layernorm
    if getattr(param, "tensor_model_parallel", False):  # Muon gathers the full matrix
        main.tensor_model_parallel, main.partition_dim = True, param.partition_dim
    if getattr(param, "is_embedding_or_output_parameter", False):  # --decoupled-lr
        main.is_embedding_or_output_parameter = True
    return main


class _NamedParams:
    """What `build_suite_optimizer` reads from a model: named parameters and the config."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], config):
        self.named, self.config = named, config

    def named_parameters(self):
        return iter(self.named)


class SuiteOptimizerWrapper:
    """An optimizer that steps the suite's optimizer (`inner`) over fp32 weights of its own
    (`named_main()`), seen by the scheduler and checkpoints as that optimizer."""

    inner = None

    def main_view(self, config) -> _NamedParams:
        return _NamedParams(self.named_main(), config)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state


class MainParamsOptimizer(SuiteOptimizerWrapper):
    """An optimizer over fp32 main weights, seen by the scheduler, the step, checkpoints and
    the memory report as one optimizer. Subclasses decide where the main weights live."""

    def __init__(self, model: torch.nn.Module, *, shards: int = 1):
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.dtype = self.params[0].dtype
        self.buffer = GradBuffer(self.params, shards=shards)
        self.inner = None  # the suite's optimizer over the main weights (build_optimizer)
        self.loss_scaler = None
        # Loading a checkpoint into the model must reach the main weights too.
        model.register_load_state_dict_post_hook(lambda module, keys: self.refresh_from_model())

    def attach(self, inner, loss_scaler=None) -> None:
        self.inner, self.loss_scaler = inner, loss_scaler
        self.buffer.loss_scaler = loss_scaler

    @staticmethod
    def gradient_of(param: torch.nn.Parameter) -> torch.Tensor:
        return param.main_grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        self.buffer.zero()

    def set_aside(self) -> torch.Tensor:
        """The fp32 gradient buffer as it is (PACI's deferred step: the next step's partial
        sums), copied out and zeroed; `bring_back` restores it."""
        kept = self.buffer.flat.clone()
        self.buffer.zero()
        return kept

    def bring_back(self, kept: torch.Tensor) -> None:
        self.buffer.flat.copy_(kept)

    def _extra_state(self) -> dict:
        """What a checkpoint needs besides the optimizer's own state."""
        extra = {}
        if self.loss_scaler is not None:
            extra["loss_scaler"] = self.loss_scaler.state_dict()
        return extra

    def _load_extra_state(self, state_dict: dict) -> dict:
        """The optimizer's own part of `state_dict`; restores the scaler."""
        inner = dict(state_dict)
        scaler = inner.pop("loss_scaler", None)
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        return inner

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """The scaler, the inner optimizer's state and the fp32 main weights of a
        `state_dict()`; without "main_params" the model's weights (refresh_from_model) stand.
        Subclasses say which part is theirs: `_own_inner_state`, `_load_main_params`."""
        inner = self._load_extra_state(state_dict)
        mains = inner.pop("main_params", None)
        self.inner.load_state_dict(self._own_inner_state(inner))
        if mains is not None:
            self._load_main_params(mains)

    def _own_inner_state(self, inner: dict) -> dict:
        """The part of the inner optimizer's checkpointed state this optimizer holds: all."""
        return inner


class ReplicatedMainOptimizer(MainParamsOptimizer):
    """fp32 main weights, one full copy on every data-parallel rank (`--bf16` / `--fp16`
    without the distributed optimizer)."""

    norm_group = None

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.main = [main_copy(p, p.detach().float().clone()) for p in self.params]

    @property
    def main_param_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.main)

    def named_main(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, main) for (name, _), main in zip(self.named, self.main)]

    @torch.no_grad()
    def refresh_from_model(self, only: torch.nn.Parameter | None = None) -> None:
        """The main weights from the model's (after a load; `only`: of one parameter)."""
        for main, param in zip(self.main, self.params):
            if only is None or param is only:
                main.copy_(param)

    def average_over(self, group, *, in_collective: bool = False) -> None:
        average_over_group(self.buffer.flat, group, in_collective=in_collective)

    def squared_norm(self, counted) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.buffer.flat.device)
        for param in self.params:
            if counted(param):
                total += param.main_grad.pow(2).sum()
        return total

    def scale(self, factor: float) -> None:
        self.buffer.flat.mul_(factor)

    def first_gradient(self) -> torch.Tensor:
        return self.params[0].main_grad

    @torch.no_grad()
    def step(self) -> None:
        for main, param in zip(self.main, self.params):
            main.grad = param.main_grad
        self.inner.step()
        for main, param in zip(self.main, self.params):
            param.copy_(main)  # rounded to the model's dtype

    def state_owners(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """(model parameter, its state entries) for each main weight with optimizer state. The
        inner optimizer's `state_dict()` holds these very tensors, numbered per optimizer when
        it is a chain (Muon's matrices beside AdamW), so they are found by identity, not by
        number. A stand-in that Muon steps in a weight's place (a split QKV block, a gathered
        matrix) is no model parameter: its state stays with the layout, as in fp32 runs."""
        model_param = {id(main): param for main, param in zip(self.main, self.params)}
        return [
            (model_param[id(main)], entries)
            for main, entries in self.inner.state.items()
            if id(main) in model_param
        ]

    def state_dict(self) -> dict:
        """The inner optimizer's per-parameter state, plus the fp32 main weights by
        parameter index (model order) and the loss scaler."""
        state = self.inner.state_dict()
        state["main_params"] = {i: main.detach().clone() for i, main in enumerate(self.main)}
        state.update(self._extra_state())
        return state

    def _load_main_params(self, mains: dict[int, torch.Tensor]) -> None:
        for index, main in enumerate(self.main):
            main.copy_(mains[index])
