"""The optimizer suite behind `--optimizer`: AdamW, SGD, Muon, Lion, Adan, SOAP and MARS.

Libraries, not our own update rules: torch's AdamW and SGD, and `pytorch_optimizer`'s Lion,
Adan, SOAP and MARS; Muon is torch's update (`torch.optim.Muon`) with Megatron's per-step
Newton-Schulz coefficients (muon.py; with `simple` coefficients it is torch's bit for bit).

Which parameters each one steps:

* element-wise optimizers (adam, sgd, lion, adan, mars) step every parameter;
* matrix optimizers (muon, soap) step the hidden 2-D weights (attention and MLP linears); the
  embeddings, the output layer and every 1-D parameter (biases, norms) go to AdamW with the
  `--adam-*` settings, as in Megatron's Muon.

Weight decay follows Megatron's rule (`no_weight_decay`: none on 1-D parameters, biases, norms) and is
decoupled for every optimizer except SGD (torch's SGD adds it to the gradient).

Muon, as Megatron's flags describe it (`--muon-momentum`, `--muon-nesterov`,
`--muon-num-ns-steps`, `--muon-coefficient-type`, `--muon-scale-mode`,
`--muon-extra-scale-factor`, `--muon-split-qkv` by default, `--muon-tp-mode`,
`--muon-scalar-optimizer`; the update itself in muon.py):

* **What is orthogonalized under tensor parallelism**: by default (Megatron's `duplicated`)
  the full matrix: the shards and gradients are gathered over the tensor-parallel group and
  every rank steps the whole matrix, so TP = 2 gives TP = 1's update (tested); the full
  momentum is then held on every rank (TP times the Muon state). With `blockwise` each rank's
  *local shard* is orthogonalized on its own, so TP = 2 differs from TP = 1, and the scale
  factor uses the local shard's shape, as Megatron's blockwise mode does.
* **The other parameters** (embeddings, output layer, 1-D) go to AdamW, or to Lion with
  `--muon-scalar-optimizer lion` (`--lion-beta1`, `--lion-beta2`).
* **Fused QKV** is split into its query, key and value blocks (per query group, Megatron's
  layout) and each block is orthogonalized on its own, unless `--muon-no-split-qkv`.
* **Scale**: torch scales each update by `sqrt(max(1, rows / cols))`; Megatron's modes
  (`spectral`: `sqrt(max(rows, cols))`, `shape_scaling`: torch's, `unit_rms_norm`:
  `sqrt(rows / cols)`) times `--muon-extra-scale-factor` are obtained with a per-group LR
  multiplier on top; weight decay is not multiplied (the group's `wd_mult` divides it out).
* Newton-Schulz runs with bf16 operands (torch's implementation), which is Megatron's default
  `--muon-fp32-matmul-prec medium`; other precisions are rejected.
"""

import math
from collections import defaultdict
from typing import Callable

import torch

from megatron.training.optimizer.config import OptimizerConfig

OPTIMIZERS = ("adam", "sgd", "muon", "lion", "adan", "soap", "mars")
MATRIX_OPTIMIZERS = ("muon", "soap")


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    if getattr(param, "decayed_norm", False):  # --apply-wd-to-qk-layernorm
        return False
    # A distributed optimizer's flat piece of a matrix keeps the matrix's rule (model_ndim).
    ndim = getattr(param, "model_ndim", param.ndim)
    return ndim < 2 or name.endswith("bias") or "norm" in name


def decay_qk_layernorms(model: torch.nn.Module) -> None:
    """--apply-wd-to-qk-layernorm: the q/k layernorms' weights and biases take weight decay
    (Megatron's rule then: none on other 1-D parameters and biases)."""
    for name, param in model.named_parameters():
        if "q_layernorm." in name or "k_layernorm." in name:
            param.decayed_norm = True


def is_hidden_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """A 2-D weight inside the transformer layers: not an embedding, not the output layer (nor
    their rows split over the ranks by --enable-vocab-parallel, marked as they are)."""
    if param.ndim != 2 or is_embedding_or_output(param):
        return False
    return "embedding" not in name and "output_layer" not in name


def is_fused_qkv(name: str) -> bool:
    return name.endswith("linear_qkv.weight")


# ---------------------------------------------------------------------------- composite
class OptimizerChain:
    """Several optimizers over disjoint parameters, seen as one by the LR scheduler, the step,
    checkpoints and the memory report. `param_groups[0]` is the first optimizer's first group
    (the one the log's learning rate reads)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], before_step=None):
        self.optimizers = optimizers
        self.before_step, self.after_step = before_step, None
        self.stand_ins: dict = {}  # model parameter -> the copy stepped in its place
        self.stand_in_weights: dict = {}  # id(any such copy) -> its model parameter

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict:
        merged = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self) -> None:
        if self.before_step is not None:
            self.before_step()
        for opt in self.optimizers.values():
            opt.step()
        if self.after_step is not None:
            self.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)
        # A weight stepped through a stand-in is in no optimizer's groups: its own gradient
        # would otherwise add up over the steps.
        for weight in self.stand_ins:
            weight.grad = None

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


# ---------------------------------------------------------------------------- groups
def named_trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def follows_first_stage(param: torch.nn.Parameter) -> bool:
    """The last stage's copy of a tied embedding under an asynchronous schedule: the first
    stage steps the weight and this copy adopts it (tied_embeddings.py), so no optimizer here
    may move it."""
    return getattr(param, "follows_first_stage", False)


def is_embedding_or_output(param: torch.nn.Parameter) -> bool:
    """megatron-core marks the word embedding and the output layer's weight (main copies keep
    the mark); --decoupled-lr gives them a learning-rate schedule of their own."""
    return getattr(param, "is_embedding_or_output_parameter", False)


def decoupled_lr_of(config: OptimizerConfig) -> dict | None:
    """The embedding's and output layer's schedule under --decoupled-lr (peak) and
    --decoupled-min-lr (floor; --min-lr when not given), as megatron-core's param-group
    overrides set it; None without --decoupled-lr."""
    if config.decoupled_lr is None:
        return None
    floor = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
    return {"max_lr": config.decoupled_lr, "min_lr": floor}


def decay_groups(
    named: list[tuple[str, torch.nn.Parameter]],
    decoupled_lr: dict | None = None,
    mup: Callable[[str, torch.nn.Parameter], dict] | None = None,
) -> list[dict]:
    """Weight decay on matrices, none on 1-D parameters, biases and norms; with `decoupled_lr`
    (`decoupled_lr_of`), the embedding and output layer in groups of their own with that
    schedule; with `mup` (`mup_settings_of`), the parameters whose settings muP changes in
    groups of their own; last, a group with learning rate and weight decay 0 for a copy that
    follows the first stage. `group_key` tells the groups apart in checkpoints."""
    frozen = [p for _, p in named if follows_first_stage(p)]
    own_settings = {"is_decoupled_lr": True, **(decoupled_lr or {})}
    members: dict[tuple, list] = {}
    for name, param in named:
        if follows_first_stage(param):
            continue
        own = bool(decoupled_lr) and is_embedding_or_output(param)
        wd_mult = 0.0 if no_weight_decay(name, param) else 1.0
        scaled = tuple(sorted(mup(name, param).items())) if mup else ()
        members.setdefault((own, -wd_mult, scaled), []).append(param)
    groups = [
        {"params": params, "wd_mult": -negative_wd, **(own_settings if own else {}), **dict(scaled)}
        for (own, negative_wd, scaled), params in sorted(members.items(), key=lambda kv: kv[0])
    ] or [{"params": [], "wd_mult": 1.0}]
    if frozen:  # the LR scheduler reads max_lr / min_lr per group: 0 throughout
        groups.append(
            {"params": frozen, "wd_mult": 0.0, "max_lr": 0.0, "min_lr": 0.0, "frozen": True}
        )
    return groups


def mup_settings_of(config: OptimizerConfig):
    """--use-mup: each parameter's optimizer settings under muP (mup.py), for `decay_groups`;
    None at width multiplier 1."""
    if config.mup_width_mult == 1.0:
        return None
    from megatron.model.mup import group_overrides

    def settings(name: str, param: torch.nn.Parameter) -> dict:
        ndim = getattr(param, "model_ndim", param.ndim)  # a distributed optimizer's piece: 1-D
        outer = is_embedding_or_output(param) or "embedding" in name or "output_layer" in name
        return group_overrides(config, matrix=ndim == 2, vector_like=ndim <= 1 or outer,
                               embedding_or_output=is_embedding_or_output(param))  # fmt: skip

    return settings


def group_key(group: dict) -> tuple:
    """What identifies a `decay_groups` group across ranks and checkpoints."""
    return (group["wd_mult"], group.get("is_decoupled_lr", False), group.get("frozen", False),
            group.get("mup"))  # fmt: skip


def adamw(groups: list[dict], config: OptimizerConfig) -> torch.optim.AdamW:
    # torch's multi-tensor (foreach) step, its default on CUDA, allocates temporaries for all
    # of the stage's parameters at once; where the step runs beside in-flight activations
    # they would add to the activation peak, so the step goes parameter by parameter there
    # (on CPU torch steps that way anyway). docs/memory_report.md.
    from megatron.training.optimizer.delay_lookahead import (
        LookaheadAdamW,
        stage_lookahead_steps,
        stage_momentum,
    )

    betas = (stage_momentum(config.adam_beta1, config), config.adam_beta2)
    if config.async_nesterov_lookahead:
        return LookaheadAdamW(
            groups, lr=config.lr, betas=betas, eps=config.adam_eps,
            weight_decay=config.weight_decay, lookahead_steps=stage_lookahead_steps(config),
        )  # fmt: skip
    foreach = False if config.steps_with_microbatches_in_flight else None
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        foreach=foreach,
    )


def lion(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """pytorch_optimizer's Lion with Megatron's --lion-beta1 (sign of the update's mix) and
    --lion-beta2 (the momentum's average)."""
    import pytorch_optimizer

    betas = (config.lion_beta1, config.lion_beta2)
    return pytorch_optimizer.Lion(
        groups, lr=config.lr, betas=betas, weight_decay=config.weight_decay
    )


def elementwise_optimizer(named, config: OptimizerConfig) -> torch.optim.Optimizer:
    """adam, sgd, lion, adan, mars over every parameter."""
    import pytorch_optimizer

    groups = decay_groups(named, decoupled_lr_of(config), mup_settings_of(config))
    name, lr, wd = config.optimizer, config.lr, config.weight_decay
    beta1 = config.optimizer_beta1  # set by the delay study's momentum sweep
    if name == "adam" and config.use_precision_aware_optimizer:
        from megatron.training.optimizer.precision_aware import DTYPES, PrecisionAwareAdamW

        return PrecisionAwareAdamW(
            groups, lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=wd,
            moment_dtypes=(DTYPES[config.exp_avg_dtype], DTYPES[config.exp_avg_sq_dtype]),
        )  # fmt: skip
    if name == "adam":
        return adamw(groups, config)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=config.sgd_momentum, weight_decay=wd)
    if name == "lion":
        return lion(groups, config)
    if name == "adan":
        betas = (0.98 if beta1 is None else beta1, 0.92, 0.99)
        return pytorch_optimizer.Adan(
            groups, lr=lr, betas=betas, weight_decay=wd, weight_decouple=True
        )
    if name == "mars":
        for group in groups:  # its AdamW path for 1-D parameters: same LR, no extra decay
            group["weight_decay_1d"] = 0.0 if group["wd_mult"] == 0.0 else wd
        betas = (0.95 if beta1 is None else beta1, 0.99)
        return pytorch_optimizer.MARS(groups, lr=lr, lr_1d=lr, betas=betas, weight_decay=wd)
    raise ValueError(f"unknown optimizer {name!r}")


# ---------------------------------------------------------------------------- muon
def muon_scale(mode: str, rows: int, cols: int) -> float:
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown Muon scale mode {mode!r}")


def muon_lr_multiplier(config: OptimizerConfig, shape: torch.Size) -> float:
    """Turns torch's built-in sqrt(max(1, rows/cols)) into Megatron's scale mode."""
    rows, cols = shape
    wanted = muon_scale(config.muon_scale_mode, rows, cols) * config.muon_extra_scale_factor
    return wanted / math.sqrt(max(1.0, rows / cols))


class QKVSplit:
    """Query, key and value blocks of a fused QKV weight as three 2-D tensors of their own
    (Megatron's layout: per query group, the group's query heads, then its key, then its
    value), so Muon orthogonalizes each block separately. Copied in before a step and out
    after it; the momentum of each block lives on its tensor."""

    def __init__(self, weight: torch.nn.Parameter, num_query_groups: int, queries_per_group: int):
        self.weight, self.groups = weight, num_query_groups
        head_dim = weight.shape[0] // (num_query_groups * (queries_per_group + 2))
        self.split = (queries_per_group * head_dim, head_dim, head_dim)
        self.blocks = [torch.nn.Parameter(b) for b in self._blocks(weight.detach())]

    def _blocks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        grouped = tensor.view(self.groups, sum(self.split), tensor.shape[-1])
        return [b.reshape(-1, tensor.shape[-1]).clone() for b in grouped.split(self.split, 1)]

    def copy_in(self) -> None:
        values = self._blocks(self.weight.detach())
        grads = self._blocks(self.weight.grad) if self.weight.grad is not None else None
        for index, block in enumerate(self.blocks):
            block.data.copy_(values[index])
            block.grad = None if grads is None else grads[index]

    def copy_out(self) -> None:
        grouped = [b.detach().view(self.groups, -1, self.weight.shape[-1]) for b in self.blocks]
        self.weight.data.copy_(torch.cat(grouped, dim=1).view_as(self.weight))


def muon_groups(matrices, config: OptimizerConfig, qkv_splits) -> list[dict]:
    """One group per Megatron scale multiplier (they depend on the shape only)."""
    by_shape = defaultdict(list)
    for name, param in matrices:
        if name in qkv_splits:
            for block in qkv_splits[name].blocks:
                by_shape[tuple(block.shape)].append(block)
        else:
            by_shape[tuple(param.shape)].append(param)
    groups = []
    for shape, params in sorted(by_shape.items()):
        multiplier = muon_lr_multiplier(config, torch.Size(shape))
        groups.append(
            {
                "params": params,
                "max_lr": config.lr * multiplier,
                "min_lr": config.min_lr * multiplier,
                "wd_mult": 1.0 / multiplier,  # decoupled decay uses the group's LR: undo it
            }
        )
    return groups


class StandIns:
    """The copies Muon steps in place of some model weights, in the order they are filled:
    full matrices gathered over tensor parallelism first, then the split QKV blocks."""

    def __init__(self, gathered: list, splits: list):
        self.gathered, self.splits = gathered, splits

    def copy_in(self) -> None:
        for stand_in in self.gathered + self.splits:
            stand_in.copy_in()

    def copy_out(self) -> None:
        for stand_in in self.splits + self.gathered:
            stand_in.copy_out()

    def by_model_weight(self) -> dict:
        """model parameter -> one tensor stepped in its place (for its group's settings)."""
        stepped = {split.weight: split.blocks[0] for split in self.splits}
        mapping = {g.weight: stepped.get(g.full, g.full) for g in self.gathered}
        return {**stepped, **mapping}

    def model_weight_of(self) -> dict[int, torch.nn.Parameter]:
        """id(every tensor stepped in a weight's place) -> that model weight (the layer-wise
        distributed optimizer's ownership follows the weight)."""
        weight_of = {id(g.full): g.weight for g in self.gathered}
        for split in self.splits:
            weight = weight_of.get(id(split.weight), split.weight)
            weight_of.update({id(block): weight for block in split.blocks})
        return weight_of


def _gathered_matrices(matrices, config: OptimizerConfig, tp_group):
    """--muon-tp-mode duplicated: each tensor-parallel matrix replaced by its full matrix."""
    from megatron.training.optimizer.muon import GatheredMatrix, tensor_parallel_dim

    if config.muon_tp_mode != "duplicated" or config.tensor_model_parallel_size == 1:
        return matrices, []
    replaced, gathered = [], []
    for name, param in matrices:
        dim = tensor_parallel_dim(param)
        if dim is None:
            replaced.append((name, param))
            continue
        gathered.append(GatheredMatrix(param, tp_group, dim))
        replaced.append((name, gathered[-1].full))
    return replaced, gathered


def build_muon(matrices, config: OptimizerConfig, query_groups: tuple[int, int], tp_group=None):
    """query_groups: (local query groups, query heads per group) of the attention layers;
    tp_group: the tensor-parallel group (--muon-tp-mode duplicated)."""
    from megatron.training.optimizer.delay_lookahead import stage_lookahead_steps, stage_momentum
    from megatron.training.optimizer.muon import Muon, coefficient_schedule

    matrices, gathered = _gathered_matrices(matrices, config, tp_group)
    if gathered:  # the fused QKV is whole: every rank's query groups
        query_groups = (query_groups[0] * config.tensor_model_parallel_size, query_groups[1])
    qkv_splits = {}
    if config.muon_split_qkv:
        for name, param in matrices:
            if is_fused_qkv(name):
                qkv_splits[name] = QKVSplit(param, *query_groups)
    muon = Muon(
        muon_groups(matrices, config, qkv_splits),
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=stage_momentum(config.muon_momentum, config),
        nesterov=config.muon_nesterov,
        coefficients=coefficient_schedule(config.muon_coefficient_type, config.muon_num_ns_steps),
    )
    if (steps := stage_lookahead_steps(config)) is not None:  # a group key only when asked
        for group in muon.param_groups:
            group["lookahead_steps"] = steps
    return muon, StandIns(gathered, list(qkv_splits.values()))


def build_soap(matrices, config: OptimizerConfig):
    import pytorch_optimizer

    beta1 = config.optimizer_beta1
    return pytorch_optimizer.SOAP(
        [{"params": [p for _, p in matrices], "wd_mult": 1.0}],
        lr=config.lr,
        betas=(0.95 if beta1 is None else beta1, 0.95),
        weight_decay=config.weight_decay,
    )


def matrix_optimizer(
    named, config: OptimizerConfig, query_groups: tuple[int, int], tp_group=None
) -> OptimizerChain:
    """muon or soap for hidden matrices, AdamW (listed first) for everything else."""
    matrices = [(n, p) for n, p in named if is_hidden_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
    rest_groups = decay_groups(rest, decoupled_lr_of(config))
    if config.optimizer == "muon" and config.muon_scalar_optimizer == "lion":
        optimizers = {"lion": lion(rest_groups, config)}
    else:
        optimizers = {"adamw": adamw(rest_groups, config)}
    if config.optimizer == "soap":
        optimizers["soap"] = build_soap(matrices, config)
        return OptimizerChain(optimizers)
    optimizers["muon"], stand_ins = build_muon(matrices, config, query_groups, tp_group)
    chain = OptimizerChain(optimizers)
    if stand_ins.gathered or stand_ins.splits:
        chain.stand_ins = stand_ins.by_model_weight()
        chain.stand_in_weights = stand_ins.model_weight_of()
        chain.before_step, chain.after_step = stand_ins.copy_in, stand_ins.copy_out
    return chain


def query_groups_of(model: torch.nn.Module, config: OptimizerConfig) -> tuple[int, int]:
    """(query groups on this tensor-parallel rank, query heads per group)."""
    model_config = getattr(model, "config", None)
    heads = getattr(model_config, "num_attention_heads", None) or config.num_attention_heads
    groups = getattr(model_config, "num_query_groups", None) or heads
    return groups // config.tensor_model_parallel_size, heads // groups


def build_suite_optimizer(model: torch.nn.Module, config: OptimizerConfig):
    """The optimizer `--optimizer` names, over the model's trainable parameters."""
    named = named_trainable(model)
    if config.optimizer in MATRIX_OPTIMIZERS:
        return matrix_optimizer(named, config, query_groups_of(model, config), tp_group_of(config))
    return elementwise_optimizer(named, config)


def tp_group_of(config: OptimizerConfig):
    """megatron-core's tensor-parallel group, where Muon needs it (duplicated mode, TP > 1)."""
    if config.tensor_model_parallel_size == 1 or config.muon_tp_mode != "duplicated":
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
