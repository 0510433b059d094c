"""Checkpoints in Megatron's layout, written atomically, checked when loaded.

    <dir>/iter_0000100/mp_rank_<tp>_<pp>/model_optim_rng.pt
    <dir>/latest_checkpointed_iteration.txt

Every file is written under a temporary name and renamed into place, and the tracker file is
updated only after every rank's file is complete, so an interrupted save never leaves a
checkpoint that looks whole. Asynchronous schedules drain before a save (see training.py), so
a checkpoint never contains a partial gradient accumulation or in-flight microbatches.

Each file records the arguments that fix its layout, model shape and schedule; loading compares
them with the run's and names what differs in one line. An unreadable file is named; with
`--load-fallback` the newest checkpoint every rank can read is loaded instead.
"""

import errno
import os
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
# What must be equal to load a checkpoint, by what it describes.
RECORDED_ARGS = {
    "layout": ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
    "model shape": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "max_position_embeddings", "padded_vocab_size", "position_embedding_type",
                    "bf16"),
    "schedule": ("pipeline_schedule",),
}  # fmt: skip
# OptimizerParamScheduler field -> what the user calls it
_SCHEDULE_FIELDS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "warmup iterations",
    "lr_decay_steps": "decay iterations (--lr-decay-iters, default --train-iters)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
}  # (the weight-decay increment's length is unused: its style is always constant)


def atomic_write_text(path: str, text: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        _remove_quietly(temporary)
        raise UserError(_write_problem(path, error)) from None


def _write_problem(path: str, error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return f"disk full while writing {path}"
    return f"cannot write {path}: {error.strerror or error}"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _rank_file(root: str, iteration: int) -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(
        root, f"iter_{iteration:07d}", f"mp_rank_{tp:02d}_{pp:03d}", "model_optim_rng.pt"
    )


def recorded_args(args) -> dict:
    return {name: getattr(args, name, None) for names in RECORDED_ARGS.values() for name in names}


# ---------------------------------------------------------------------------- save
def save(root: str, state, model, optimizer, scheduler, args=None) -> None:
    """With `args`: Megatron's --no-save-optim / --no-save-rng leave those parts out."""
    path = _rank_file(root, state.iteration)
    save_optim = not getattr(args, "no_save_optim", False)
    # On every rank: the distributed optimizer gathers its shards over data parallelism.
    optimizer_state = optimizer.state_dict() if save_optim else None
    if parallel_state.get_data_parallel_rank() == 0:
        payload = {
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "model": model.state_dict(),
            "args": recorded_args(args) if args is not None else None,
        }
        if save_optim:
            payload["optimizer"] = optimizer_state
            payload["opt_param_scheduler"] = scheduler.state_dict()
        if not getattr(args, "no_save_rng", False):
            payload["rng_state"] = torch.get_rng_state()
        _write_rank_file(root, path, payload)
    dist.barrier()  # every rank's file is complete before the tracker names the iteration
    if dist.get_rank() == 0:
        atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
        print(f"> saved checkpoint at iteration {state.iteration} to {root}", flush=True)


def _write_rank_file(root: str, path: str, payload: dict) -> None:
    """Write under a temporary name; on failure remove it and say what the last good
    checkpoint is (the tracker was not touched)."""
    temporary = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(payload, temporary)
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        _remove_quietly(temporary)
        cause = error if isinstance(error, OSError) else _os_error_in(error)
        if cause is None:
            raise
        kept = read_tracker(root, quiet=True)
        still = f"; {TRACKER} still names iteration {kept}" if kept is not None else ""
        raise UserError(f"{_write_problem(path, cause)}: checkpoint not saved{still}") from None


def _os_error_in(error: BaseException) -> OSError | None:
    """torch.save reports a full disk as a RuntimeError from its zip writer."""
    text = str(error).lower()
    if "no space left" in text or "file write failed" in text:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


# ---------------------------------------------------------------------------- load
def read_tracker(root: str, quiet: bool = False) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        if quiet:
            return None
        raise UserError(f"--load {root}: no {TRACKER} there")
    text = open(tracker).read().strip()
    if not text.isdigit():
        if quiet:
            return None
        raise UserError(
            f"--load {root}: malformed {TRACKER} ({text[:40]!r}, expected an iteration "
            f"number); pass --load-fallback to load the newest intact checkpoint"
        )
    return int(text)


def iterations_on_disk(root: str) -> list[int]:
    """Checkpoint iterations present under `root`, newest first."""
    found = [re.fullmatch(r"iter_(\d+)", name) for name in os.listdir(root)]
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def _read_rank_file(path: str) -> tuple[dict | None, str | None]:
    """(payload, None) or (None, the problem in words)."""
    if not os.path.isfile(path):
        return None, f"missing {path}"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch reports truncation in many ways; name the file
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        return None, f"checkpoint file {path} is truncated or corrupt ({reason})"
    needed = ("iteration", "consumed_train_samples", "model")
    if not isinstance(payload, dict) or any(key not in payload for key in needed):
        return None, f"checkpoint file {path} is not one of our checkpoints"
    return payload, None


def _every_rank_ok(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def read_checkpoint(root: str, device: torch.device, fallback: bool) -> dict:
    """The payload of the newest checkpoint every rank can read (collective)."""
    newest = read_tracker(root, quiet=fallback)
    candidates = [newest] if newest is not None else []
    if fallback:
        candidates += [i for i in iterations_on_disk(root) if newest is None or i < newest]
    for iteration in candidates:
        payload, problem = _read_rank_file(_rank_file(root, iteration))
        if _every_rank_ok(problem is None, device):
            if iteration != newest and dist.get_rank() == 0:
                print(f"> --load-fallback: loading the intact checkpoint of iteration "
                      f"{iteration} from {root}", flush=True)  # fmt: skip
            return payload
        if problem is not None and fallback:
            print(f"> skipping the checkpoint of iteration {iteration}: {problem}", flush=True)
        if not fallback:
            raise UserError(
                (problem or f"--load {root}: the checkpoint of iteration {iteration} is "
                 "unreadable on another rank (see its error)")
                + "; pass --load-fallback to load the newest intact checkpoint"
            )  # fmt: skip
    raise UserError(f"--load {root}: no intact checkpoint there")


def check_recorded_args(payload: dict, args, path: str) -> None:
    """One line naming every recorded argument that differs from this run's."""
    recorded = payload.get("args")
    if not recorded or args is None:
        return
    for what, names in RECORDED_ARGS.items():
        differences = [
            f"--{name.replace('_', '-')} {getattr(args, name, None)} (checkpoint {recorded[name]})"
            for name in names
            if name in recorded and recorded[name] != getattr(args, name, None)
        ]
        if differences:
            raise UserError(f"--load {path}: the {what} differs: {', '.join(differences)}")


def check_schedule(payload: dict, scheduler, args, path: str) -> None:
    """A changed LR schedule is used only when asked to (Megatron's two flags); else one line."""
    if getattr(args, "override_opt_param_scheduler", False):
        scheduler.override_opt_param_scheduler = True
        return
    if getattr(args, "use_checkpoint_opt_param_scheduler", False):
        scheduler.use_checkpoint_opt_param_scheduler = True
        return
    saved = payload.get("opt_param_scheduler")
    if saved is None or args.finetune or args.no_load_optim:
        return  # the schedule is not restored
    differences = [
        f"{label} {getattr(scheduler, field)} (checkpoint {saved[field]})"
        for field, label in _SCHEDULE_FIELDS.items()
        if field in saved and saved[field] != getattr(scheduler, field)
    ]
    if differences:
        raise UserError(
            f"--load {path}: the learning-rate schedule differs: {', '.join(differences)}; "
            f"pass --override-opt_param-scheduler to use the new one or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


def restore(payload: dict, *, model, optimizer, scheduler, path: str, args=None) -> None:
    """Model, then optimizer and schedule, then RNG state; with `args`, Megatron's
    --finetune (model only), --no-load-optim and --no-load-rng."""
    finetune = getattr(args, "finetune", False)
    load_optim = not (finetune or getattr(args, "no_load_optim", False))
    load_rng = not (finetune or getattr(args, "no_load_rng", False))
    for part, wanted, flag in (("optimizer", load_optim, "--no-load-optim"),
                               ("rng_state", load_rng, "--no-load-rng")):  # fmt: skip
        if wanted and part not in payload:
            raise UserError(f"--load {path}: the checkpoint has no {part} state: add {flag}")
    try:
        model.load_state_dict(payload["model"])
        if load_optim:
            optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError) as error:
        reason = str(error).strip().splitlines()[0][:160]
        raise UserError(f"--load {path}: the checkpoint does not fit this model ({reason})")
    if load_optim:
        scheduler.load_state_dict(payload["opt_param_scheduler"])
    if load_rng:
        torch.set_rng_state(payload["rng_state"])


def has_checkpoint(root: str, fallback: bool) -> bool:
    """A tracker file, or (with --load-fallback) any iteration directory to fall back to."""
    if os.path.isfile(os.path.join(root, TRACKER)):
        return True
    return fallback and os.path.isdir(root) and bool(iterations_on_disk(root))


def load(root: str, *, model, optimizer, scheduler, args=None) -> tuple[int, int]:
    """(iteration, consumed samples) of the checkpoint in `root`, or (0, 0) when `root` has
    none: Megatron then starts from scratch, so `--save DIR --load DIR` works on a first run."""
    fallback = getattr(args, "load_fallback", False)
    if not has_checkpoint(root, fallback):
        if dist.get_rank() == 0:
            print(f"> no checkpoint in --load {root} (no {TRACKER}): training from scratch",
                  flush=True)  # fmt: skip
        return 0, 0
    device = next(model.parameters()).device
    payload = read_checkpoint(root, device, fallback=fallback)
    check_recorded_args(payload, args, root)
    finetune = getattr(args, "finetune", False)
    if args is not None:
        check_schedule(payload, scheduler, args, root)
        if payload["iteration"] >= args.train_iters and not (finetune or args.skip_train):
            raise UserError(
                f"--load {root} is at iteration {payload['iteration']}, at or past "
                f"--train-iters {args.train_iters}: nothing to train (raise --train-iters)"
            )
    restore(payload, model=model, optimizer=optimizer, scheduler=scheduler, path=root, args=args)
    if finetune:
        return 0, 0
    return payload["iteration"], payload["consumed_train_samples"]
