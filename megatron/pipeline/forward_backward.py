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

The stage's persistent state (in-flight microbatches, receives, statistics) is the
`StageRuntime` registered for the model with `attach_stage_runtime`.
"""

import functools
import weakref
from typing import Callable

import torch

from .runtime import StageRuntime
from .schedules import Schedule, get_schedule
from .schedules.paci import with_arrival_rule

_RUNTIMES: "weakref.WeakKeyDictionary[torch.nn.Module, StageRuntime]" = weakref.WeakKeyDictionary()


def attach_stage_runtime(model: torch.nn.Module, runtime: StageRuntime) -> None:
    _RUNTIMES[model] = runtime


def stage_runtime_of(model: torch.nn.Module) -> StageRuntime:
    try:
        return _RUNTIMES[model]
    except KeyError:
        raise RuntimeError("no StageRuntime attached to this model: call attach_stage_runtime")


def _single_chunk(model):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("interleaved (virtual pipeline) chunks are not supported")
        return model[0]
    return model


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
    optimizer_step_func: Callable[[], object] | None = None,
    microbatches_before_drain: int | None = None,
) -> list[dict]:
    if collect_non_loss_data or adjust_tensor_shapes_fn is not None:
        raise NotImplementedError("collect_non_loss_data / adjust_tensor_shapes_fn")
    model = _single_chunk(model)
    runtime = stage_runtime_of(model)
    expected_shape = (seq_length, micro_batch_size)
    if runtime.tensor_shape[:2] != expected_shape:
        raise ValueError(f"stage runtime built for {runtime.tensor_shape}, got {expected_shape}")
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    if forward_only:
        return runtime.run_forward_only(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            num_microbatches=num_microbatches,
        )
    return runtime.run_training(
        schedule,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        optimizer_step_func=optimizer_step_func,
        microbatches_before_drain=microbatches_before_drain,
    )


def forward_backward_pipelining_1f1b(**kwargs) -> list[dict]:
    """Synchronous 1F1B with a flush (Megatron's default pipeline schedule)."""
    return _run_schedule(get_schedule("1f1b"), **kwargs)


def forward_backward_pipelining_paci(**kwargs) -> list[dict]:
    """PACI: asynchronous 1F1B, no flush, each stage steps after `num_microbatches` backwards."""
    return _run_registered(get_schedule("paci"), **kwargs)


def _run_registered(schedule: Schedule, **kwargs) -> list[dict]:
    if schedule.steps_within_call and not kwargs.get("forward_only"):
        if kwargs.get("optimizer_step_func") is None:
            raise ValueError(
                f"{schedule.name} steps each stage inside the schedule: pass optimizer_step_func"
            )
    return _run_schedule(schedule, **kwargs)


def get_forward_backward_func(
    pipeline_schedule: str = "1f1b", arrival_rule: str | None = None
) -> Callable[..., list[dict]]:
    """The schedule function for `--pipeline-schedule` (the selector): any schedule of the
    runtime's registry (`megatron.pipeline.schedules.SCHEDULES`); `arrival_rule` picks PACI's
    (`--paci-arrival-rule`, None: the default)."""
    schedule = with_arrival_rule(get_schedule(pipeline_schedule), arrival_rule)
    return functools.partial(_run_registered, schedule)


__all__ = [
    "attach_stage_runtime",
    "forward_backward_pipelining_1f1b",
    "forward_backward_pipelining_paci",
    "get_forward_backward_func",
]
