"""Optimizer, learning-rate schedule and the per-stage step callable handed to the schedules.

Torch optimizers on every device (megatron-core's wrappers are CUDA-only). The step does what
Megatron's does, in this order: average gradients over the stage's data-parallel group, clip
by the gradient norm, step, advance the LR schedule, clear gradients. Where weights and
gradients live (the model's own in fp32; fp32 main weights and gradients for `--bf16` /
`--fp16`; sharded over data parallelism for `--use-distributed-optimizer`) is main_params.py's
and distributed_optimizer.py's business; fp16 loss scaling is loss_scaling.py's.

The gradient norm's reach is the one difference between schedules: 1F1B-flush reduces it over
the whole model (tensor x pipeline ranks), like Megatron; PACI only over the stage's tensor-
parallel ranks, because a pipeline-wide norm would be a global synchronization every step.
A non-finite norm (an fp16 overflow, or divergence) skips the step; under 1F1B-flush every
stage sees the same norm, so all skip together, as Megatron's model-wide found-inf does.
"""

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.distributed.data_parallel import (
    BucketedReduction,
    CopiedAllReduce,
    ReductionTimes,
    bucket_ranges,
)
from megatron.distributed.fsdp import is_fully_sharded
from megatron.training.optimizer.config import LRScheduleConfig, OptimizerConfig
from megatron.training.optimizer.main_params import (
    ModelGradients,
    ReplicatedMainOptimizer,
    average_over_group,
    reduce_as_one,
)

# Optimizers whose update needs whole matrices: distributed by whole parameters (layer_wise.py)
LAYER_WISE_OPTIMIZERS = ("muon",)


def _optimizer_shard_groups(config: OptimizerConfig):
    """(the ranks one optimizer copy is sharded over, the ranks holding the same shard in the
    other copies): the stage's data-parallel group and none, or with
    --num-distributed-optimizer-instances megatron-core's partial data-parallel groups."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return dist.group.WORLD, None
    if config.num_distributed_optimizer_instances == 1:
        return parallel_state.get_data_parallel_group(), None
    return (
        parallel_state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        parallel_state.get_inter_distributed_optimizer_instance_group(),
    )


def _expert_shard_groups(config: OptimizerConfig, expert_group):
    """The routed experts' (shard group, replica group): the expert-data-parallel group and
    none, or with --num-distributed-optimizer-instances its partial groups; the copies span the
    same ranks as the dense parameters' copies (megatron-core builds one inter-copy group)."""
    from megatron.core import parallel_state

    if config.num_distributed_optimizer_instances == 1:
        return expert_group, None
    return (
        parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        parallel_state.get_inter_distributed_optimizer_instance_group(),
    )


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig, *, expert_group=None):
    """`--optimizer`'s optimizer (suite.py), with the delay mitigations asked for; over
    fp32 main weights when the model is bf16/fp16 or the optimizer is distributed.
    `expert_group`: with the distributed optimizer, the expert-data-parallel group that the
    routed experts (MoE) shard over when it is not the data-parallel group."""
    from megatron.training.optimizer.delay_mitigation import with_delay_mitigation
    from megatron.training.optimizer.suite import build_suite_optimizer, decay_qk_layernorms

    if config.apply_wd_to_qk_layernorm:
        decay_qk_layernorms(model)
    if is_fully_sharded(model):
        return build_fully_sharded_optimizer(model, config)
    if config.use_distributed_optimizer and config.optimizer in LAYER_WISE_OPTIMIZERS:
        return build_layer_wise_optimizer(model, config, expert_group)
    if config.needs_main_params and config.use_distributed_optimizer and expert_group is not None:
        return build_expert_sharded_optimizer(model, config, expert_group)
    if config.needs_main_params:
        return build_main_params_optimizer(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    return with_delay_mitigation(build_suite_optimizer(model, config), params, config)


def build_layer_wise_optimizer(model: torch.nn.Module, config: OptimizerConfig, expert_group):
    """Muon's distributed optimizer: whole parameters owned by the data-parallel ranks, the
    routed experts by the expert-data-parallel ranks when `expert_group` (layer_wise.py)."""
    from megatron.training.optimizer.layer_wise import LayerWiseMainOptimizer
    from megatron.training.optimizer.loss_scaling import build_loss_scaler
    from megatron.training.optimizer.suite import build_suite_optimizer

    dense_group, _ = _optimizer_shard_groups(config)
    wrapper = LayerWiseMainOptimizer(model, dense_group, expert_group)
    inner = build_suite_optimizer(wrapper.main_view(getattr(model, "config", None)), config)
    wrapper.attach(inner, build_loss_scaler(config))
    return wrapper


def build_fully_sharded_optimizer(model: torch.nn.Module, config: OptimizerConfig):
    """A model sharded by fsdp.py: the suite's optimizer over each rank's rows."""
    from megatron.training.optimizer.fsdp_optimizer import FullyShardedOptimizer
    from megatron.training.optimizer.loss_scaling import build_loss_scaler
    from megatron.training.optimizer.suite import build_suite_optimizer

    wrapper = FullyShardedOptimizer(model)
    inner = build_suite_optimizer(wrapper.main_view(getattr(model, "config", None)), config)
    wrapper.attach(inner, build_loss_scaler(config))
    return wrapper


def build_main_params_optimizer(model: torch.nn.Module, config: OptimizerConfig):
    from megatron.training.optimizer.delay_mitigation import with_delay_mitigation
    from megatron.training.optimizer.distributed_optimizer import ShardedMainOptimizer
    from megatron.training.optimizer.loss_scaling import build_loss_scaler
    from megatron.training.optimizer.suite import (
        build_suite_optimizer,
        decoupled_lr_of,
        mup_settings_of,
    )

    if config.use_distributed_optimizer:
        groups = _optimizer_shard_groups(config)
        wrapper = ShardedMainOptimizer(
            model, *groups, decoupled_lr=decoupled_lr_of(config), mup=mup_settings_of(config)
        )
    else:
        wrapper = ReplicatedMainOptimizer(model)
    inner = build_suite_optimizer(wrapper.main_view(getattr(model, "config", None)), config)
    mains = [main for _, main in wrapper.named_main()]
    wrapper.attach(with_delay_mitigation(inner, mains, config), build_loss_scaler(config))
    return wrapper


def build_expert_sharded_optimizer(model: torch.nn.Module, config: OptimizerConfig, expert_group):
    """The distributed optimizer with expert parallelism: the dense parameters sharded over the
    data-parallel group, the routed experts over `expert_group` (distributed_optimizer.py)."""
    from megatron.training.optimizer.distributed_optimizer import (
        ExpertShardedOptimizer,
        ShardedMainOptimizer,
        dense_and_expert_views,
    )
    from megatron.training.optimizer.loss_scaling import build_loss_scaler
    from megatron.training.optimizer.suite import (
        build_suite_optimizer,
        decoupled_lr_of,
        mup_settings_of,
    )

    scaler = build_loss_scaler(config)
    parts = []
    groups = (_optimizer_shard_groups(config), _expert_shard_groups(config, expert_group))
    for view, (group, replica_group) in zip(dense_and_expert_views(model), groups):
        part = ShardedMainOptimizer(
            view,
            group,
            replica_group,
            decoupled_lr=decoupled_lr_of(config),
            mup=mup_settings_of(config),
        )
        part.attach(build_suite_optimizer(part.main_view(view.config), config), scaler)
        parts.append(part)
    return ExpertShardedOptimizer(*parts)


def stage_lr_scale(pipeline, training, stage: int) -> float:
    """`--paci-stage-lr-scale C`: pipeline stage `stage`'s LR factor 1 / (1 + C (N - 1 - s) / a),
    N stages, a microbatches per optimizer step. (N - 1 - s) / a is the mean number of optimizer
    steps a PACI gradient of stage s is stale (in steady state a microbatch's backward reaches
    stage s N - 1 - s microbatch slots after its forward, and a step takes a slots); it is also
    the fraction of the stage's microbatches that cross a step when a >= N - 1. The last stage
    (no delay) keeps its LR; 1 without the flag. `pipeline` and `training` are the run's
    `PipelineConfig` and `TrainingConfig`."""
    c = pipeline.paci_stage_lr_scale
    if not c:
        return 1.0
    stages = pipeline.plan.num_stages
    return 1.0 / (1.0 + c * (stages - 1 - stage) / training.num_microbatches)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: LRScheduleConfig, *, lr_scale: float = 1.0
) -> OptimizerParamScheduler:
    """megatron-core's scheduler over `optimizer`; `lr_scale` (`stage_lr_scale`) multiplies its
    max and min LR and those of every param group that sets its own (Muon's per-shape ones), in
    place: call it once per optimizer."""
    if lr_scale != 1.0:
        for group in optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group:
                    group[key] *= lr_scale
    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.warmup_init * lr_scale,
        max_lr=config.max_lr * lr_scale,
        min_lr=config.min_lr * lr_scale,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=config.decay_steps,
        lr_decay_style=config.decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        # Weight decay is constant here, so its increment length has no effect; it is the LR
        # decay length rather than --train-iters so that the checkpoint check below does not
        # reject a resumed run with another --train-iters for a setting that changes nothing.
        wd_incr_steps=config.decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
    )


def logged_learning_rate(param_groups: list[dict]) -> float:
    """The learning rate the log shows: the first group on the --lr schedule (Megatron's
    canonical LR), not an embedding group of --decoupled-lr nor a frozen copy."""
    for group in param_groups:
        if not (group.get("is_decoupled_lr") or group.get("frozen")):
            return group["lr"]
    return param_groups[0]["lr"]


@dataclass
class ExpertGroups:
    """Where the routed experts' gradients go (MoE, megatron-core's expert process groups).
    An expert's gradient already holds the contributions of every token routed to it from
    its expert-parallel peers, so (as Megatron's DDP) it is summed over the expert-data-
    parallel group and divided by the (dense) data-parallel size; its norm is counted once
    per expert over the expert tensor x expert x pipeline ranks (the schedule's reach)."""

    data_parallel_group: object
    grad_norm_group: object
    data_parallel_size: int


def _same_ranks(group_a, group_b) -> bool:
    if group_a is None or group_b is None:
        return group_a is group_b
    return sorted(dist.get_process_group_ranks(group_a)) == sorted(
        dist.get_process_group_ranks(group_b)
    )


@dataclass
class StepReport:
    grad_norm: float
    learning_rate: float
    skipped: bool = False  # the gradient norm was not finite: no update


def _summed_over_tensor_parallel(model: torch.nn.Module, group) -> list[torch.nn.Parameter]:
    """Parameters replicated over the tensor-parallel ranks whose gradient each rank computes
    from its own part only, so the full gradient is the sum over the ranks (as Megatron's
    finalize_model_grads does): the q/k layernorms (--qk-layernorm) normalize each rank's own
    heads; under --sequence-parallel the norms (tagged `sequence_parallel`) see each rank's own
    part of the sequence; Gated DeltaNet's output norm normalizes each rank's own heads."""
    if group is None or dist.get_world_size(group) == 1:
        return []
    return [
        param
        for name, param in model.named_parameters()
        if param.requires_grad
        and (
            "q_layernorm" in name
            or "k_layernorm" in name
            or getattr(param, "sequence_parallel", False)
            or getattr(param, "partial_over_tensor_ranks", False)  # GDN's output norm
        )
    ]


class StageOptimizerStep:
    """The `optimizer_step_func` a schedule calls when this stage's step is due."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: OptimizerParamScheduler,
        *,
        data_parallel_group,
        grad_norm_group,
        tensor_parallel_rank: int,
        clip_grad: float,
        average_in_collective: bool = False,
        tensor_parallel_group=None,
        experts: ExpertGroups | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data_parallel_group = data_parallel_group
        self.grad_norm_group = grad_norm_group
        self.tensor_parallel_rank = tensor_parallel_rank
        self.clip_grad = clip_grad
        self.average_in_collective = average_in_collective  # --ddp-average-in-collective
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tensor_parallel_group = tensor_parallel_group
        self.summed_over_tensor_parallel = _summed_over_tensor_parallel(
            model, tensor_parallel_group
        )
        # The optimizer's own gradients (main weights), or the model's (fp32).
        self.gradients = optimizer if hasattr(optimizer, "average_over") else None
        self.gradients = self.gradients or ModelGradients(self.params)
        self.loss_scaler = getattr(optimizer, "loss_scaler", None)
        self.experts = experts
        self.expert_params = [p for p in self.params if getattr(p, "moe_expert", False)]
        # Experts reduce apart from the dense weights unless their groups are the dense ones
        # (no expert parallelism, expert tensor parallelism = tensor parallelism).
        self.separate_experts = bool(self.expert_params) and not (
            experts is None
            or (
                _same_ranks(experts.data_parallel_group, data_parallel_group)
                and _same_ranks(experts.grad_norm_group, grad_norm_group)
            )
        )
        if self.separate_experts and getattr(self.gradients, "norm_group", None) is not None:
            raise ValueError("a sharded optimizer with expert parallelism shards in two parts")
        # The bucketed data-parallel reduction (attach_reduction), None: one blocking reduction
        self.reduction: BucketedReduction | None = None
        self.reduction_times = ReductionTimes()  # either way (dp_reduce_s, dp_exposed_s)
        # --overlap-param-gather: the sharded optimizer's gathers in buckets (attach_reduction)
        self.param_gather = None
        self.last = StepReport(grad_norm=0.0, learning_rate=0.0)
        self.calls = 0  # step calls, skipped ones included
        self.skipped_steps = 0  # steps this stage skipped, over the run
        self.consecutive_skips = 0  # ... in a row (not counting fp16 overflows), up to the last
        self.scheduler_increment = 1  # iterations; samples of the iteration with a batch ramp

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def gradient_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The gradient the step will use for a model parameter (fp32 `main_grad` with main
        weights), before the data-parallel average."""
        return self.gradients.gradient_of(param)

    def finish_param_gather(self, only=None) -> None:
        """The parameters hold the last update: with --overlap-param-gather, the gathers still
        in flight land (`only`: those of these parameters). Whatever reads the parameters
        outside a forward calls it first; a forward's own hooks wait for what it reads."""
        if self.param_gather is None:
            return
        if only is None:
            self.param_gather.finish()
        else:
            self.param_gather.wait_for(only)

    def __call__(self) -> StepReport:
        self.calls += 1
        self._sum_over_tensor_parallel()
        if self.reduction is not None:
            self.reduction.finish()
        else:
            self._reduce_as_one()
        return self._apply()

    # ------------------------------------------------------------------ PACI's deferred step
    # --paci-deferred-step: `launch` at the schedule's step starts the data-parallel reduction
    # of the step's gradients (each bucket reduces a copy of its gradients) and clears the
    # gradients, so the passes that follow accumulate the next step's; `land` applies the
    # step once the reduction is in, with the next step's partial gradients set aside.
    def launch(self) -> None:
        self.calls += 1
        self._sum_over_tensor_parallel()
        self.reduction.hold()
        self.optimizer.zero_grad(set_to_none=True)

    def land(self) -> StepReport:
        kept = self.gradients.set_aside()
        self.reduction.finish()
        try:
            return self._apply()
        finally:
            self.gradients.bring_back(kept)

    def _apply(self) -> StepReport:
        """The step on the averaged gradients: the norm, the loss scale, clipping, the update,
        the LR schedule; the gradients are cleared."""
        self.finish_param_gather()  # the previous step's gathers land before this one's start
        self._maybe_inject_overflow()
        grad_norm = self._grad_norm()
        found_inf = not math.isfinite(grad_norm)
        overflow = found_inf and self.loss_scaler is not None and self.loss_scaler.can_back_off()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if found_inf:
            return self._skip(grad_norm, overflow=overflow)
        self.consecutive_skips = 0
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            self.gradients.scale(self.clip_grad / (grad_norm + 1e-6))
        learning_rate = logged_learning_rate(self.optimizer.param_groups)
        self.optimizer.step()
        self.scheduler.step(increment=self.scheduler_increment)
        self.optimizer.zero_grad(set_to_none=True)
        self.last = StepReport(grad_norm=grad_norm, learning_rate=learning_rate)
        return self.last

    def _reduce_as_one(self) -> None:
        """The data-parallel average without buckets: one blocking reduction, timed."""
        start = time.perf_counter()
        if self.separate_experts:
            self._average_dense_and_experts()
        else:
            self.gradients.average_over(
                self.data_parallel_group, in_collective=self.average_in_collective
            )
        end = time.perf_counter()
        if (
            self.data_parallel_group is not None
            and dist.get_world_size(self.data_parallel_group) > 1
        ):
            self.reduction_times.add_span(start, end)
            self.reduction_times.add_exposed(end - start, end)
            self.reduction_times.close_step()
            self.reduction_times.buckets_at_step += 1
            self.reduction_times.bytes += 4 * sum(p.numel() for p in self.params)  # fp32

    def drop_gradients(self) -> None:
        """No step this time: the gradients are cleared, a reduction in flight forgotten."""
        if self.reduction is not None:
            self.reduction.reset()
        self.optimizer.zero_grad(set_to_none=True)

    def forget_skips(self) -> None:
        """After a rollback the skips in a row start again from zero."""
        self.consecutive_skips = 0

    def _skip(self, grad_norm: float, *, overflow: bool) -> StepReport:
        """A non-finite gradient norm: no update, and (as in Megatron) the LR schedule does not
        advance. Every rank of the stage sees the same norm, so they all skip. An fp16
        overflow while the loss scale can still back off is the scaler's normal work, not a
        sign of divergence: it does not count towards --max-consecutive-skips."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        if not overflow:
            self.consecutive_skips += 1
        learning_rate = logged_learning_rate(self.optimizer.param_groups)
        self.last = StepReport(grad_norm=grad_norm, learning_rate=learning_rate, skipped=True)
        return self.last

    def _sum_over_tensor_parallel(self) -> None:
        """Complete the gradients each tensor-parallel rank holds only its heads' part of."""
        if not self.summed_over_tensor_parallel:
            return
        grads = [self.gradients.gradient_of(p) for p in self.summed_over_tensor_parallel]
        reduce_as_one(grads, lambda flat: dist.all_reduce(flat, group=self.tensor_parallel_group))

    def _average_dense_and_experts(self) -> None:
        """Dense gradients averaged over the data-parallel group; routed experts' summed
        over the expert-data-parallel group and divided by the data-parallel size."""
        if hasattr(self.gradients, "average_dense_and_experts"):  # sharded in two parts
            self.gradients.average_dense_and_experts(
                self.data_parallel_group, self.experts.data_parallel_size,
                in_collective=self.average_in_collective,
            )  # fmt: skip
            return
        dense = [self.gradient_of(p) for p in self.params if not getattr(p, "moe_expert", False)]
        if dense and dist.get_world_size(self.data_parallel_group) > 1:
            reduce_as_one(dense, lambda flat: average_over_group(
                flat, self.data_parallel_group, in_collective=self.average_in_collective))  # fmt: skip
        group, size = self.experts.data_parallel_group, self.experts.data_parallel_size

        def sum_and_divide(flat: torch.Tensor) -> None:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat.div_(size)

        if size > 1 or dist.get_world_size(group) > 1:
            reduce_as_one([self.gradient_of(p) for p in self.expert_params], sum_and_divide)

    def _maybe_inject_overflow(self) -> None:
        """Tests: MEGATRON_INJECT_GRAD_OVERFLOW names this stage and step (loss_scaling.py)."""
        from megatron.training.optimizer.loss_scaling import (
            INJECT_ENV,
            inject_overflow,
            injected_overflow_steps,
        )

        if not os.environ.get(INJECT_ENV):
            return
        from megatron.core import parallel_state

        stage = parallel_state.get_pipeline_model_parallel_rank()
        if self.calls in injected_overflow_steps(stage):
            inject_overflow(self.gradients.first_gradient())

    def _counted(self, param: torch.nn.Parameter) -> bool:
        """A parameter replicated over tensor-parallel ranks is counted once (on TP rank 0);
        the last stage's copy of a tied embedding is counted on the first stage."""
        if getattr(param, "shared", False):
            return False
        return getattr(param, "tensor_model_parallel", False) or self.tensor_parallel_rank == 0

    def _grad_norm(self) -> float:
        """L2 norm of the averaged gradient over `grad_norm_group` (and over the
        data-parallel group when each rank holds a shard of it)."""
        if self.separate_experts:
            return math.sqrt(self._dense_and_expert_squared_norm().item())
        total = self.gradients.squared_norm(self._counted)
        for group in (self.gradients.norm_group, self.grad_norm_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return math.sqrt(total.item())

    def _dense_and_expert_squared_norm(self) -> torch.Tensor:
        """The dense part over the schedule's reach, each routed expert once over the expert
        groups (every expert rank holds distinct experts, each sharded over expert tensor
        parallelism)."""

        def dense_counted(param):
            return not getattr(param, "moe_expert", False) and self._counted(param)

        # the sharded optimizer in two parts: each part's squared norm covers its range only
        dense_part, expert_part = getattr(self.gradients, "parts", (self.gradients,) * 2)
        dense = dense_part.squared_norm(dense_counted)
        expert = expert_part.squared_norm(lambda p: getattr(p, "moe_expert", False))
        for total, groups in (
            (dense, (dense_part.norm_group, self.grad_norm_group)),
            (expert, (expert_part.norm_group, self.experts.grad_norm_group)),
        ):
            for group in groups:
                if group is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(total, group=group)
        return dense + expert


def attach_reduction(
    step: StageOptimizerStep,
    *,
    bucket_size: int | None,
    overlap: bool,
    late=(),
    chunk_of=lambda param: 0,
    force: bool = False,
    gather_params: bool = False,
) -> str | None:
    """Reduce the stage's gradients in buckets of `bucket_size` parameters (None: one), with
    `overlap` from hooks during the pass that completes them (distributed/data_parallel.py).
    `late`: parameters whose gradient changes between the backward and the reduction, reduced
    at the step. Returns why the buckets cannot be used for this stage's gradients (then they
    reduce as one at the step, as without the flags), or None. `force`: buckets even without
    data parallelism (a reduction over one rank is a copy: PACI's deferred step at DP 1).
    `gather_params` (--overlap-param-gather): the distributed optimizer's updated parameters
    gathered in the same buckets, each waited for by the forward (param_gather.py)."""
    from megatron.training.optimizer.distributed_optimizer import (
        ShardedMainOptimizer,
        ShardedReduceScatter,
    )

    group = step.data_parallel_group
    if not force and (group is None or dist.get_world_size(group) == 1):
        return None  # nothing to reduce (`force`: PACI's deferred step needs the copies)
    if step.separate_experts:
        return "the routed experts reduce over their own group"
    holder = step.gradients
    if isinstance(holder, ShardedMainOptimizer):
        strategy = ShardedReduceScatter(holder, in_collective=step.average_in_collective)
    elif isinstance(holder, ModelGradients) or isinstance(holder, ReplicatedMainOptimizer):
        strategy = CopiedAllReduce(
            holder.gradient_of, group, in_collective=step.average_in_collective
        )
    else:
        return f"{type(holder).__name__} reduces its gradients its own way"
    params = holder.params
    chunks = [chunk_of(p) for p in params]
    starts = [i for i in range(1, len(params)) if chunks[i] != chunks[i - 1]]
    ranges = bucket_ranges([p.numel() for p in params], bucket_size, chunk_starts=starts)
    if isinstance(holder, ShardedMainOptimizer):
        strategy.set_ranges(ranges)
    reduction = BucketedReduction(
        params, ranges, strategy, chunk_of=chunk_of, times=step.reduction_times
    )
    reduction.mark_late(list(late) + step.summed_over_tensor_parallel)
    if overlap:
        reduction.attach_hooks()
    step.reduction = reduction
    if gather_params and isinstance(holder, ShardedMainOptimizer):
        _attach_param_gather(step, holder, ranges)
    return None


def _attach_param_gather(step: StageOptimizerStep, holder, ranges) -> None:
    """--overlap-param-gather: `holder`'s step launches a gather per bucket, the model's
    forward pre-hooks wait for them."""
    from megatron.training.optimizer.param_gather import ShardedParamGather

    gather = ShardedParamGather(holder, ranges, step.reduction_times)
    gather.attach_forward_hooks(step.model)
    holder.param_gather = step.param_gather = gather
