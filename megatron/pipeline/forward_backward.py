"""Megatron-compatible schedule entry points and the selector.

Every function here has megatron-core's keyword-only schedule signature
(`forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
forward_only, ...`) and returns the last stage's per-microbatch loss dicts (an empty list on
other stages), so a Megatron training loop can call any of them. Two keywords are ours:

* `optimizer_step_func`: called by the schedule when a step is due. PACI steps each stage in
  the middle of a call, so stepping cannot be left to the caller as Megatron does.
* `microbatches_before_drain`: for asynchronous schedules, how many more microbatches (this
  call's included) may be forwarded before the pipeline must be empty; equal to
  `num_microbatches` for the call before evaluation, a checkpoint, or the end of training.

The rank's persistent state (in-flight microbatches, receives, statistics) is the
`RankRuntime` attached to the model with `attach_stage_runtime`, together with the
`PipelinePlan` it runs.

Megatron's calling conventions are accepted as well: `get_forward_backward_func()` with no
argument (or Megatron's `pp_size`, `vp_size`) returns the schedule of the plan attached to the
model it is called with; the keywords
`p2p_communicator`, `pg_collection` (when they name the pipeline group this stage runs on) and
`force_all_reduce` (our step always all-reduces over data-parallel ranks); a `loss_func` that
returns Megatron's 3-tuple `(loss sum, number of tokens, {'lm loss': [sum, tokens]})`; and
a model wrapped by megatron-core's `DistributedDataParallel` (anything with `.module`).

With a per-token loss (a runtime built with `per_token_loss=True`, from Megatron's
--calculate-per-token-loss) the loss_func must return the 3-tuple: the last stage then
backpropagates the loss sum, each stage counts the tokens of the microbatches it accumulated
(the counts ride upstream on the gradients) and, at its own step, divides its gradient by the
step's token count summed over its data-parallel ranks. Under 1F1B-flush that is Megatron's
division by the global batch's token count; under PACI each stage does it at its own step,
for the same microbatches, with no collective beyond its data-parallel group.
"""

import functools
from typing import Callable

import torch

from .deferred_wgrad import drain_weight_gradients, drained_before
from .plan import PipelinePlan, resolve_plan
from .runtime import RankRuntime
from .schedules import Schedule, flush_1f1b, paci


def attach_stage_runtime(
    model: torch.nn.Module, runtime: RankRuntime, plan: PipelinePlan | None = None
) -> None:
    """Bind the rank's runtime (and the plan `get_forward_backward_func()` runs) to `model`."""
    model.pipeline_runtime = runtime
    runtime.plan = plan


def stage_runtime_of(model: torch.nn.Module) -> RankRuntime:
    """The runtime of `model` or of the model it wraps (`.module`, as megatron-core's DDP)."""
    while True:
        runtime = model.__dict__.get("pipeline_runtime")
        if runtime is not None:
            return runtime
        if not isinstance(getattr(model, "module", None), torch.nn.Module):
            raise RuntimeError("no RankRuntime attached to this model: call attach_stage_runtime")
        model = model.module


def _megatron_loss_contract(forward_step_func: Callable, per_token: bool = False) -> Callable:
    """forward_step whose loss_func may return Megatron's 3-tuple; the schedule sees the
    2-tuple `(loss sum / tokens, {'lm loss': sum / tokens})`, Megatron's meaning without
    --calculate-per-token-loss. With it, the 3-tuple goes through as it is."""
    checked = _per_token_loss if per_token else _two_tuple_loss

    def forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)
        return output, functools.partial(checked, loss_func)

    return forward_step


def _per_token_loss(loss_func: Callable, output):
    result = loss_func(output)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(
            "--calculate-per-token-loss needs a loss_func that returns Megatron's 3-tuple "
            "(loss sum, number of tokens, {'lm loss': [loss sum, number of tokens]})"
        )
    return result


def _divided_by_step_tokens(optimizer_step_func: Callable, runtime: RankRuntime) -> Callable:
    """The step, after dividing the stage's gradient by the step's token count (the counts of
    its accumulated microbatches, summed over the stage's data-parallel ranks)."""

    def step():
        tokens = torch.tensor([float(runtime.tokens_since_step)], device=runtime.context.device)
        group = _data_parallel_group()
        data_parallel = 1 if group is None else torch.distributed.get_world_size(group)
        if data_parallel > 1:
            torch.distributed.all_reduce(tokens, group=group)
        if tokens.item() > 0:
            # The step averages gradients over data-parallel ranks (megatron/training/
            # optimizer/build.py), so dp / total makes the result the sum over ranks / total.
            _scale_gradients(optimizer_step_func, runtime.model, data_parallel / tokens.item())
        return optimizer_step_func()

    return step


def _scale_gradients(optimizer_step_func: Callable, model: torch.nn.Module, factor: float):
    """Scale the gradients the step will use: the optimizer's own (fp32 main gradients with
    --bf16/--fp16/--use-distributed-optimizer), else the model's `.grad`."""
    gradients = getattr(optimizer_step_func, "gradients", None)
    if gradients is not None:
        gradients.scale(factor)
        return
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(factor)


def _two_tuple_loss(loss_func: Callable, output):
    result = loss_func(output)
    if not (isinstance(result, tuple) and len(result) == 3):
        return result
    loss_sum, num_tokens, reduced = result
    averaged = {
        name: (
            value[0] / value[1].clamp(min=1)
            if torch.is_tensor(value) and value.numel() == 2
            else value
        )
        for name, value in reduced.items()
    }
    return loss_sum / torch.clamp(torch.as_tensor(num_tokens), min=1), averaged


def _data_parallel_group():
    """The ranks the step averages gradients over: the stage's data- and context-parallel
    ranks (None in a single process without process groups)."""
    if not torch.distributed.is_initialized():
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _check_process_groups(p2p_communicator, pg_collection) -> None:
    """Megatron may hand its groups in; they must be the ones this stage's runtime uses."""
    if p2p_communicator is None and pg_collection is None:
        return
    from megatron.core import parallel_state

    ours = parallel_state.get_pipeline_model_parallel_group()
    given = [getattr(pg_collection, "pp", None), getattr(p2p_communicator, "pp_group", None)]
    if any(group is not None and group is not ours for group in given):
        raise ValueError("pg_collection / p2p_communicator name another pipeline group")


def _single_chunk(model):
    """The module the stage runtime is attached to: Megatron passes a list of model chunks,
    of one (a rank's chunks are one `ModelChunks` module here)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("pass the rank's model chunks as one ModelChunks module")
        return model[0]
    return model


def _check_exchanged_shape(model, runtime, seq_length: int, micro_batch_size: int) -> None:
    """The stages exchange [s / cp / tp (sequence parallel), b, h]: the runtime's buffers must
    be built for this call's sequence and micro batch."""
    first = model.chunks[0] if hasattr(model, "chunks") else model  # a rank's model chunks
    config = getattr(first, "config", None)
    seq_length //= getattr(config, "context_parallel_size", 1) or 1  # a rank's 2 chunks
    if getattr(config, "sequence_parallel", False):
        seq_length //= config.tensor_model_parallel_size
    expected_shape = (seq_length, micro_batch_size)
    if runtime.tensor_shape[:2] != expected_shape:
        raise ValueError(f"stage runtime built for {runtime.tensor_shape}, got {expected_shape}")


def _run_schedule(
    schedule: Schedule,
    *,
    forward_step_func: Callable,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
    optimizer_step_func: Callable[[], object] | None = None,
    microbatches_before_drain: int | None = None,
) -> list[dict]:
    if collect_non_loss_data or adjust_tensor_shapes_fn is not None:
        raise NotImplementedError("collect_non_loss_data / adjust_tensor_shapes_fn")
    _check_process_groups(p2p_communicator, pg_collection)
    _check_step_func(schedule, forward_only, optimizer_step_func)  # a misuse is named first
    model = _single_chunk(model)
    runtime = stage_runtime_of(model)
    forward_step_func = _megatron_loss_contract(forward_step_func, runtime.per_token_loss)
    if runtime.per_token_loss and not forward_only:
        if optimizer_step_func is None:
            raise ValueError("a per-token loss needs optimizer_step_func (it scales the step)")
        optimizer_step_func = _divided_by_step_tokens(optimizer_step_func, runtime)
    # outermost: the deferred weight gradients are in before any scaling or reading
    optimizer_step_func = drained_before(optimizer_step_func, model)
    _check_exchanged_shape(model, runtime, seq_length, micro_batch_size)
    if isinstance(data_iterator, (list, tuple)) and len(data_iterator) == 1:
        data_iterator = data_iterator[0]  # else one per model chunk, as Megatron passes them
    if forward_only:
        return runtime.run_forward_only(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            num_microbatches=num_microbatches,
        )
    losses = runtime.run_training(
        schedule,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        optimizer_step_func=optimizer_step_func,
        microbatches_before_drain=microbatches_before_drain,
    )
    drain_weight_gradients(model)  # the call's gradients complete for whoever reads them next
    return losses


def _check_step_func(schedule: Schedule, forward_only: bool, optimizer_step_func) -> None:
    if schedule.steps_within_call and not forward_only and optimizer_step_func is None:
        raise ValueError(
            f"{schedule.name} steps each stage inside the schedule: pass optimizer_step_func"
        )


def forward_backward_pipelining_1f1b(**kwargs) -> list[dict]:
    """Synchronous 1F1B with a flush (Megatron's default pipeline schedule): the run's
    1F1B-flush plan attached to the model (interleaved with virtual stages), else plain."""
    return _run_schedule(_attached_or(flush_1f1b.SCHEDULE, kwargs.get("model")), **kwargs)


def forward_backward_pipelining_paci(**kwargs) -> list[dict]:
    """PACI: asynchronous 1F1B, no flush, each stage steps after `num_microbatches` backwards.
    Runs the run's PACI plan attached to the model (its arrival rule, in-flight limit, virtual
    stages, weight stashing), else plain PACI."""
    return _run_schedule(_attached_or(paci.SCHEDULE, kwargs.get("model")), **kwargs)


def _attached_or(schedule: Schedule, model) -> Schedule:
    """The schedule of the plan attached to `model` when it is `schedule` with its options,
    else `schedule` itself."""
    try:
        plan = stage_runtime_of(_single_chunk(model)).plan
    except (RuntimeError, AttributeError):
        return schedule
    return plan.schedule if plan is not None and plan.name == schedule.name else schedule


# The named entries: the schedule a plan runs goes through its entry (Megatron's shape: one
# function per schedule); the others through `forward_backward_func_for`.
_NAMED_ENTRIES = {
    flush_1f1b.SCHEDULE.name: forward_backward_pipelining_1f1b,
    paci.SCHEDULE.name: forward_backward_pipelining_paci,
}


def _plan_of_model(**kwargs) -> list[dict]:
    """Megatron's call without a schedule: the plan attached to the model, through its named
    entry where it has one."""
    runtime = stage_runtime_of(_single_chunk(kwargs["model"]))
    if runtime.plan is None:
        raise RuntimeError("no pipeline plan attached to this model: pass a schedule")
    entry = _NAMED_ENTRIES.get(runtime.plan.name)
    if entry is not None:
        return entry(**kwargs)
    return _run_schedule(runtime.plan.schedule, **kwargs)


def forward_backward_func_for(schedule: Schedule) -> Callable[..., list[dict]]:
    """The schedule function that runs `schedule` (a plan's, resolved once)."""
    return functools.partial(_run_schedule, schedule)


def get_forward_backward_func(
    pipeline_schedule: str | int | None = None,
    vp_size: int | None = None,
    *,
    pp_size=None,
    arrival_rule: str | None = None,
    inflight_limit: str | None = None,
    microbatch_group_size: int | None = None,
) -> Callable[..., list[dict]]:
    """The schedule function for `--pipeline-schedule` (the selector): any schedule of the
    runtime's registry (`megatron.pipeline.schedules.SCHEDULES`) with its options
    (`resolve_plan`). Called as Megatron calls it (no argument, or `pp_size, vp_size`), it
    returns a function that runs the plan attached to the model it is given."""
    if pipeline_schedule is None or isinstance(pipeline_schedule, int):
        return _plan_of_model
    plan = resolve_plan(
        pipeline_schedule,
        num_stages=pp_size or 1,
        chunks_per_rank=vp_size,
        microbatch_group_size=microbatch_group_size,
        arrival_rule=arrival_rule,
        inflight_limit=inflight_limit,
    )
    return functools.partial(_run_schedule, plan.schedule)


__all__ = [
    "attach_stage_runtime",
    "forward_backward_pipelining_1f1b",
    "forward_backward_pipelining_paci",
    "forward_backward_func_for",
    "get_forward_backward_func",
]
