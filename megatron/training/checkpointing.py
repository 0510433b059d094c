"""Checkpoints in Megatron's layout, written atomically.

    <dir>/iter_0000100/mp_rank_<tp>_<pp>/model_optim_rng.pt
    <dir>/latest_checkpointed_iteration.txt

Every file is written under a temporary name and renamed into place, and the tracker file is
updated only after every rank's file is complete, so an interrupted save never leaves a
checkpoint that looks whole. Asynchronous schedules drain before a save (see training.py), so
a checkpoint never contains a partial gradient accumulation or in-flight microbatches.
"""

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"


def atomic_write_text(path: str, text: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _rank_file(root: str, iteration: int) -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(
        root, f"iter_{iteration:07d}", f"mp_rank_{tp:02d}_{pp:03d}", "model_optim_rng.pt"
    )


def save(root: str, state, model, optimizer, scheduler, *, optim=True, rng=True) -> None:
    """`optim`/`rng` False: Megatron's --no-save-optim / --no-save-rng."""
    path = _rank_file(root, state.iteration)
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = {
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "model": model.state_dict(),
        }
        if optim:
            payload["optimizer"] = optimizer.state_dict()
            payload["opt_param_scheduler"] = scheduler.state_dict()
        if rng:
            payload["rng_state"] = torch.get_rng_state()
        temporary = f"{path}.tmp"
        torch.save(payload, temporary)
        os.replace(temporary, path)
    dist.barrier()  # every rank's file is complete before the tracker names the iteration
    if dist.get_rank() == 0:
        atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
        print(f"> saved checkpoint at iteration {state.iteration} to {root}", flush=True)


def load(root: str, *, model, optimizer, scheduler, args=None) -> tuple[int, int]:
    """(iteration, consumed samples) of the checkpoint in `root`, or (0, 0) when `root` has
    none (Megatron starts from scratch then, so `--save DIR --load DIR` works on a first run).

    With `args`: --no-load-optim, --no-load-rng, --finetune (model only, iteration 0), and the
    scheduler check (--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        if dist.get_rank() == 0:
            print(f"> no checkpoint in --load {root} (no {TRACKER}): training from scratch",
                  flush=True)  # fmt: skip
        return 0, 0
    iteration = int(open(tracker).read().strip())
    path = _rank_file(root, iteration)
    if not os.path.isfile(path):
        raise UserError(f"--load {root}: missing {path}")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    finetune = getattr(args, "finetune", False)
    if not (finetune or getattr(args, "no_load_optim", False)):
        _load_optimizer(root, payload, optimizer, scheduler)
    if not (finetune or getattr(args, "no_load_rng", False)):
        if "rng_state" not in payload:
            raise UserError(f"--load {root}: the checkpoint has no RNG state: add --no-load-rng")
        torch.set_rng_state(payload["rng_state"])
    if finetune:
        return 0, 0
    return payload["iteration"], payload["consumed_train_samples"]


def _load_optimizer(root: str, payload: dict, optimizer, scheduler) -> None:
    if "optimizer" not in payload:
        raise UserError(
            f"--load {root}: the checkpoint has no optimizer state: add --no-load-optim"
        )
    optimizer.load_state_dict(payload["optimizer"])
    try:
        scheduler.load_state_dict(payload["opt_param_scheduler"])
    except AssertionError as mismatch:  # megatron-core's check of command line vs checkpoint
        raise UserError(
            f"--load {root}: {mismatch}; pass --override-opt_param-scheduler (command line) or "
            "--use-checkpoint-opt_param-scheduler (checkpoint)"
        ) from None
