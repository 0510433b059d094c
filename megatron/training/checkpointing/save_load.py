"""Checkpoints in Megatron's layout, written atomically, checked when loaded.

Two formats (`--ckpt-format`, Megatron's default `torch_dist`):

    torch_dist: <dir>/iter_0000100/{metadata.json,common.pt,*.distcp}   (torch_dist.py)
    torch:      <dir>/iter_0000100/mp_rank_<tp>_<pp>/model_optim_rng.pt
                <dir>/latest_checkpointed_iteration.txt                  (both)

Every file is written under a temporary name and renamed into place, and the tracker file is
updated only after every rank's part is complete, so an interrupted save never leaves a
checkpoint that looks whole. A torch_dist checkpoint loads into any tensor x pipeline x data
layout; a torch checkpoint only into the layout that wrote it. Asynchronous schedules drain
before a save (see training.py), so a checkpoint never contains a partial gradient
accumulation or in-flight microbatches.

Each checkpoint records the arguments that fix its layout, model shape and schedule; loading
compares them with the run's and names what differs in one line (the layout only for the torch
format; the schedule only between schedules that keep more than one weight version). An
unreadable file is named; with `--load-fallback` the newest checkpoint every rank can read is
loaded instead.
"""

import errno
import os
import re
import shutil
import signal
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.common.errors import UserError
from megatron.distributed import fsdp
from megatron.pipeline.schedules import SCHEDULES
from megatron.training import faults
from megatron.training.checkpointing import fsdp_dtensor, integrity, torch_dist
from megatron.training.config import CheckpointConfig

TRACKER = "latest_checkpointed_iteration.txt"
INJECT_STOP_ENV = "MEGATRON_INJECT_STOP_IN_SAVE"
# What must be equal to load a checkpoint, by what it describes.
RECORDED_ARGS = {  # in the order they are checked: a changed shape is named as such
    "model shape": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "max_position_embeddings", "padded_vocab_size", "position_embedding_type",
                    "bf16", "untie_embeddings_and_output_weights"),
    "layout": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "stage_layers"),
    "schedule": ("pipeline_schedule",),
}  # fmt: skip
# Recorded arguments a torch_dist checkpoint does not need to match: its keys are global.
RESHARDABLE = {"layout"}
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


# Recorded too, and checked with the learning-rate schedule (`check_schedule`).
RECORDED_SCHEDULE_ARGS = (
    "rampup_batch_size", "step_batch_size_schedule", "decoupled_lr", "decoupled_min_lr"
)  # fmt: skip


# Recorded, not compared here: where torch_dist keeps optimizer state per data-parallel rank
# (MoE with expert parallelism), a load checks them itself (torch_dist.py).
RECORDED_INFO = ("expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size")


def recorded_flags(config) -> dict:
    """The flags a checkpoint records, by flag name, read from the run's `RunConfig` (lists
    where the flags are lists, as checkpoints have always recorded them)."""
    model, layout, ramp = config.model, config.parallel, config.training.rampup_batch_size
    steps = config.training.step_batch_size_schedule
    sections = {"model shape": model, "layout": layout, "info": layout}
    recorded = {
        name: getattr(sections[what], name)
        for what, names in (*RECORDED_ARGS.items(), ("info", RECORDED_INFO))
        if what != "schedule"
        for name in names
    }
    return recorded | {
        "stage_layers": list(layout.stage_layers),
        "pipeline_schedule": config.pipeline.plan.name,
        "rampup_batch_size": None if ramp is None else list(ramp),
        "step_batch_size_schedule": None if steps is None else [list(step) for step in steps],
        "decoupled_lr": config.optimizer.decoupled_lr,
        "decoupled_min_lr": config.optimizer.decoupled_min_lr,
    }


def _checkpoint_config(config) -> CheckpointConfig:
    """The run's checkpoint section; Megatron's defaults for a save or load without a run."""
    return CheckpointConfig() if config is None else config.checkpoint


# ---------------------------------------------------------------------------- save
def save(root: str, state, model, optimizer, scheduler, config=None) -> None:
    """In the run's `--ckpt-format` (torch without a `config`), without the parts Megatron's
    --no-save-optim / --no-save-rng leave out."""
    _stop_here_if_injected(state.iteration)
    checkpoint = _checkpoint_config(config)
    try:
        if checkpoint.ckpt_format == fsdp_dtensor.FORMAT:  # each rank's rows, as they are
            _save_dist(root, state, model, optimizer, scheduler, config, writer=fsdp_dtensor)
        else:
            with fsdp.unsharded_for_checkpoint(model, optimizer):  # FSDP: whole parameters
                if checkpoint.ckpt_format == torch_dist.FORMAT:
                    _save_dist(root, state, model, optimizer, scheduler, config)
                else:
                    _save_torch(root, state, model, optimizer, scheduler, config)
        dist.barrier()  # every rank's part is complete before the tracker names the iteration
    except (RuntimeError, torch_dist.CheckpointException) as error:
        if not faults.timed_out(error):
            raise
        minutes = None if config is None else config.parallel.distributed_timeout_minutes
        raise UserError(_save_timeout(root, state.iteration, minutes)) from None
    if dist.get_rank() == 0:
        previous = _tracked_iteration(root)
        atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
        print(f"> saved checkpoint at iteration {state.iteration} to {root}", flush=True)
        _drop_unretained(root, previous, state.iteration, checkpoint.save_retain_interval)


def _tracked_iteration(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER)) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def _drop_unretained(root: str, previous: int | None, saved: int, retain: int | None) -> None:
    """--save-retain-interval N, as Megatron: once a new checkpoint is complete and named, the
    one it replaces is deleted unless its iteration is a multiple of N (or it is a link)."""
    if retain is None or not previous or previous == saved or previous % retain == 0:
        return
    directory = os.path.join(root, f"iter_{previous:07d}")
    if os.path.isdir(directory) and not os.path.islink(directory):
        shutil.rmtree(directory)
        print(f"> deleted the checkpoint of iteration {previous} (--save-retain-interval "
              f"{retain})", flush=True)  # fmt: skip


def _save_torch(root: str, state, model, optimizer, scheduler, config) -> None:
    path, checkpoint = _rank_file(root, state.iteration), _checkpoint_config(config)
    save_optim = not checkpoint.no_save_optim
    # On every rank: the distributed optimizer gathers its shards over data parallelism.
    optimizer_state = optimizer.state_dict() if save_optim else None
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:  # one per replica
        payload = {
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "model": model.state_dict(),
            "args": None if config is None else recorded_flags(config),
            "run_id": checkpoint.run_id,  # which run wrote it (writer_lock.py)
        }
        if save_optim:
            payload["optimizer"] = optimizer_state
            payload["opt_param_scheduler"] = scheduler.state_dict()
        if not checkpoint.no_save_rng:
            payload["rng_state"] = torch.get_rng_state()
        _write_rank_file(root, path, payload)


def _save_dist(root: str, state, model, optimizer, scheduler, config, writer=torch_dist) -> None:
    """torch_dist (or `writer`'s format, fsdp_dtensor). The LR schedule goes with the common
    state (the first stage's, as in Megatron; stages' schedules differ only after one of them
    skipped a step)."""
    checkpoint = config.checkpoint
    directory = os.path.join(root, f"iter_{state.iteration:07d}")
    common = {
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "args": recorded_flags(config),
        "run_id": checkpoint.run_id,  # which run wrote it (writer_lock.py)
    }
    if not checkpoint.no_save_optim:
        common["opt_param_scheduler"] = scheduler.state_dict()
    try:
        writer.save_checkpoint(
            directory, common, model=model, optimizer=optimizer, checkpoint=checkpoint
        )
    except (OSError, RuntimeError, torch_dist.CheckpointException) as error:
        torch_dist.remove_staging(directory)
        if not isinstance(error, OSError) and faults.timed_out(error):
            raise  # a rank did not take part: save() names it
        cause = error if isinstance(error, OSError) else _os_error_in(error)
        problem = _write_problem(directory, cause) if cause else f"cannot write {directory} ("
        if cause is None:
            problem += f"{torch_dist.first_line(error)})"
        raise UserError(f"{problem}: checkpoint not saved{_kept_note(root)}") from None


def _save_timeout(root: str, iteration: int, minutes: int | None) -> str:
    """A rank did not take part in the save's collectives in time: the stopped ones on this
    host are ended (so the launcher need not wait for them) and named."""
    from megatron.pipeline.p2p import describe_rank

    stopped = faults.end_stopped_peers()
    if stopped:
        who = ", ".join(describe_rank(rank) for rank in stopped)
        who += f" {'was' if len(stopped) == 1 else 'were'} stopped (ended now) and"
    else:
        who = "a rank (stuck, or on another host)"
    return (
        f"checkpoint of iteration {iteration} not saved: {who} did not take part within "
        f"--distributed-timeout-minutes {minutes}{_kept_note(root)}"
    )


def _stop_here_if_injected(iteration: int) -> None:
    """Tests: MEGATRON_INJECT_STOP_IN_SAVE=RANK:ITERATION makes that global rank stop itself
    (SIGSTOP) as the save of that iteration begins: a rank frozen while the others write."""
    if os.environ.get(INJECT_STOP_ENV) == f"{dist.get_rank()}:{iteration}":
        os.kill(os.getpid(), signal.SIGSTOP)


def _kept_note(root: str) -> str:
    kept = read_tracker(root, quiet=True)
    return f"; {TRACKER} still names iteration {kept}" if kept is not None else ""


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
        raise UserError(
            f"{_write_problem(path, cause)}: checkpoint not saved{_kept_note(root)}"
        ) from None


def _os_error_in(error: BaseException) -> OSError | None:
    """torch.save reports a full disk as a RuntimeError from its zip writer; torch's
    distributed checkpoint wraps the writer's error in its own exception."""
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


def _iterations_if_any(root: str) -> list[int]:
    return iterations_on_disk(root) if os.path.isdir(root) else []


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


def format_on_disk(directory: str) -> str | None:
    """The format of the checkpoint directory `iter_N` (None: neither format's files)."""
    if not os.path.isdir(directory):
        return None
    names = os.listdir(directory)
    if fsdp_dtensor.is_fsdp_dtensor_checkpoint(directory):
        return fsdp_dtensor.FORMAT
    if torch_dist.is_dist_checkpoint(directory) or any(
        name == "common.pt" or name.endswith(".distcp") for name in names
    ):
        return torch_dist.FORMAT
    return "torch" if any(name.startswith("mp_rank_") for name in names) else None


def _checked_format(root: str, iteration: int, wanted: str | None) -> str:
    """The format to read iteration `iteration` in: what is on disk; `wanted` (the run's
    --ckpt-format, None with --auto-detect-ckpt-format) must agree, as in Megatron."""
    on_disk = format_on_disk(os.path.join(root, f"iter_{iteration:07d}"))
    if on_disk is None or wanted is None or on_disk == wanted:
        return on_disk or wanted or "torch"
    raise UserError(
        f"--load {root}: the checkpoint of iteration {iteration} is in the {on_disk} format, "
        f"not --ckpt-format {wanted}: pass --ckpt-format {on_disk} or --auto-detect-ckpt-format"
    )


def _read_iteration(root: str, iteration: int, wanted: str | None) -> tuple[dict | None, str]:
    """(payload, None) or (None, the problem). A torch_dist payload is the common state (the
    tensors are read by `restore`), with "format" and "directory" added."""
    on_disk = _checked_format(root, iteration, wanted)
    if on_disk == "torch":
        return _read_rank_file(_rank_file(root, iteration))
    directory = os.path.join(root, f"iter_{iteration:07d}")
    reader = fsdp_dtensor if on_disk == fsdp_dtensor.FORMAT else torch_dist
    common, problem = reader.read_common(directory)
    if common is not None:
        common.update(format=reader.FORMAT, directory=directory)
    return common, problem


def _read_verified(root: str, iteration: int, wanted: str | None, device, required) -> tuple:
    """`_read_iteration` of a checkpoint whose files match their manifest (collective: every
    rank gets rank 0's verdict; not `required`: only if it has one); a wrong format is named
    first."""
    _checked_format(root, iteration, wanted)
    directory = os.path.join(root, f"iter_{iteration:07d}")
    problem = integrity.integrity_problem(directory, device, required)
    if problem is not None:
        return None, problem
    return _read_iteration(root, iteration, wanted)


def read_checkpoint(
    root: str,
    device: torch.device,
    fallback: bool,
    ckpt_format: str | None = None,
    verify_integrity: bool = False,
    step: int | None = None,
) -> dict:
    """The payload of the newest checkpoint every rank can read (collective); `ckpt_format`:
    the format it must be in (None: whichever it is). Files are checked against the
    checkpoint's manifest (integrity.py) before anything is read, when it has one;
    `verify_integrity`: it must have one; `step` (--ckpt-step): that iteration's, not the
    newest."""
    newest = read_tracker(root, quiet=fallback) if step is None else step
    candidates = [newest] if newest is not None else []
    if fallback:
        candidates += [i for i in iterations_on_disk(root) if newest is None or i < newest]
    for iteration in candidates:
        # a manifest is checked whenever there is one; --verify-integrity requires it
        payload, problem = _read_verified(root, iteration, ckpt_format, device, verify_integrity)
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


def _differences(recorded: dict, now: dict, names) -> list[str]:
    return [
        f"--{name.replace('_', '-')} {now.get(name)} (checkpoint {recorded[name]})"
        for name in names
        if name in recorded and recorded[name] != now.get(name)
    ]


def check_recorded_args(payload: dict, config, path: str) -> None:
    """One line naming every recorded argument that differs from this run's; a torch_dist
    checkpoint may change the layout, and any checkpoint may change between schedules that
    drain to one weight version (both are printed)."""
    recorded = payload.get("args")
    if not recorded or config is None:
        return
    resharding, now = payload.get("format") == torch_dist.FORMAT, recorded_flags(config)
    for what, names in RECORDED_ARGS.items():
        differences = _differences(recorded, now, names)
        allowed = (what in RESHARDABLE and resharding) or (
            what == "schedule"
            and _one_weight_version(recorded.get("pipeline_schedule"))
            and not config.pipeline.plan.schedule.stashes_weights
        )
        if differences and not allowed:
            raise UserError(f"--load {path}: the {what} differs: {', '.join(differences)}")
        if differences and what == "schedule" and not resharding and _tied_over_stages(config):
            # the last stage's copy sits in an optimizer group of its own under PACI
            raise UserError(
                f"--load {path}: a --ckpt-format torch checkpoint of tied embeddings resumes "
                f"under its own schedule only ({', '.join(differences)}); torch_dist (the "
                "default) checkpoints change schedules"
            )
        if differences and dist.get_rank() == 0:
            print(f"> loading a checkpoint of another {what}: {', '.join(differences)}",
                  flush=True)  # fmt: skip


def _tied_over_stages(config) -> bool:
    return config.model.tied_embeddings and config.parallel.pipeline_model_parallel_size > 1


def _one_weight_version(saved_schedule: str | None) -> bool:
    """A checkpoint of this schedule holds no schedule state: it saves with the pipeline empty
    and every stage at the same step boundary (a flush by construction, PACI by draining
    first) and keeps one weight version, so it resumes under any other such schedule."""
    schedule = SCHEDULES.get(saved_schedule)
    return schedule is not None and not schedule.stashes_weights


def check_schedule(payload: dict, scheduler, config, path: str) -> None:
    """A changed LR schedule is used only when asked to (Megatron's two flags); else one line.
    So is a changed batch-size ramp (--override-opt_param-scheduler takes the new one): the
    ramp, like the LR, is a function of the samples consumed, and a new one applied halfway
    changes the run's remaining batches and its length in iterations."""
    checkpoint = config.checkpoint
    _check_batch_ramp(payload, config, path)
    _check_decoupled_groups(payload, config, path)
    if checkpoint.override_opt_param_scheduler:
        scheduler.override_opt_param_scheduler = True
        return
    if checkpoint.use_checkpoint_opt_param_scheduler:
        scheduler.use_checkpoint_opt_param_scheduler = True
        return
    saved = payload.get("opt_param_scheduler")
    if saved is None or checkpoint.finetune or checkpoint.no_load_optim:
        return  # the schedule is not restored
    differences = [
        f"{label} {getattr(scheduler, field)} (checkpoint {saved[field]})"
        for field, label in _SCHEDULE_FIELDS.items()
        if field in saved and saved[field] != getattr(scheduler, field)
    ]
    now = recorded_flags(config)
    differences += _differences(payload.get("args") or {}, now, _DECOUPLED_LR_ARGS)
    if differences:
        raise UserError(
            f"--load {path}: the learning-rate schedule differs: {', '.join(differences)}; "
            f"pass --override-opt_param-scheduler to use the new one or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


_DECOUPLED_LR_ARGS = ("decoupled_lr", "decoupled_min_lr")


def _check_decoupled_groups(payload: dict, config, path: str) -> None:
    """--decoupled-lr puts the embedding and output layer in optimizer groups of their own:
    turning it on or off changes the optimizer state's groups, which a checkpoint keeps."""
    recorded = payload.get("args") or {}
    if "decoupled_lr" not in recorded or config.checkpoint.no_load_optim:
        return
    saved, now = recorded["decoupled_lr"], config.optimizer.decoupled_lr
    if (saved is None) != (now is None) and not config.checkpoint.finetune:
        spell = lambda lr: "not given" if lr is None else f"{lr:g}"  # noqa: E731
        raise UserError(
            f"--load {path}: --decoupled-lr is {spell(now)} here and {spell(saved)} in the "
            "checkpoint, which changes the optimizer's parameter groups; resume with the "
            "checkpoint's setting, or add --no-load-optim"
        )


def apply_decoupled_lr(optimizer, scheduler, payload: dict, config) -> None:
    """The embedding's and output layer's LR bounds after a load: the checkpoint's under
    --use-checkpoint-opt_param-scheduler, else this run's (`check_schedule` refuses a
    difference without one of Megatron's two flags). A torch checkpoint's optimizer state
    brings the saved bounds and torch_dist's does not, so both are set here."""
    if config is None:
        return
    values = {name: getattr(config.optimizer, name) for name in _DECOUPLED_LR_ARGS}
    if config.checkpoint.use_checkpoint_opt_param_scheduler:
        values = {name: (payload.get("args") or {}).get(name) for name in _DECOUPLED_LR_ARGS}
    if values["decoupled_lr"] is None:
        return
    from megatron.training.optimizer.build import stage_lr_scale

    # --paci-stage-lr-scale scales these bounds as it scales the scheduler's (min_lr included)
    scale = stage_lr_scale(config.pipeline, config.training,
                           parallel_state.get_pipeline_model_parallel_rank())  # fmt: skip
    floor = values["decoupled_min_lr"]
    floor = scheduler.min_lr if floor is None else floor * scale
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            group["max_lr"], group["min_lr"] = values["decoupled_lr"] * scale, floor


def _check_batch_ramp(payload: dict, config, path: str) -> None:
    recorded = payload.get("args") or {}
    if "rampup_batch_size" not in recorded or config.checkpoint.override_opt_param_scheduler:
        return
    saved, now = recorded["rampup_batch_size"], recorded_flags(config)["rampup_batch_size"]
    if saved != now:
        spell = lambda ramp: " ".join(map(str, ramp)) if ramp else "none"  # noqa: E731
        raise UserError(
            f"--load {path}: the batch-size ramp differs: --rampup-batch-size {spell(now)} "
            f"(checkpoint {spell(saved)}); pass --override-opt_param-scheduler to use the new "
            f"one, or the checkpoint's"
        )
    _check_batch_steps(recorded, config, path)


def _check_batch_steps(recorded: dict, config, path: str) -> None:
    """As a ramp, a step schedule is compared in samples (so the same thresholds spelled in
    other units are the same schedule); checkpoints from before it was recorded are not."""
    if "step_batch_size_schedule" not in recorded:
        return
    saved = recorded["step_batch_size_schedule"]
    now = recorded_flags(config)["step_batch_size_schedule"]
    if saved != now:
        spell = lambda steps: (
            " ".join(f"{s}:{b}" for s, b in steps) if steps else "none"
        )  # noqa: E731
        raise UserError(
            f"--load {path}: the batch-size steps differ: --step-batch-size-schedule "
            f"{spell(now)} (checkpoint {spell(saved)}, thresholds in samples); pass "
            f"--override-opt_param-scheduler to use the new one, or the checkpoint's"
        )


def restore(payload: dict, *, model, optimizer, scheduler, path: str, config=None) -> None:
    """Model, then optimizer and schedule, then RNG state; with the run's `config`, Megatron's
    --finetune (model only), --no-load-optim and --no-load-rng."""
    checkpoint = _checkpoint_config(config)
    load_optim = not (checkpoint.finetune or checkpoint.no_load_optim)
    load_rng = not (checkpoint.finetune or checkpoint.no_load_rng)
    saved = payload.get("saved_parts", payload)  # torch_dist lists them; torch holds them
    for part, wanted, flag in (("optimizer", load_optim, "--no-load-optim"),
                               ("rng_state", load_rng, "--no-load-rng")):  # fmt: skip
        if wanted and part not in saved:
            raise UserError(f"--load {path}: the checkpoint has no {part} state: add {flag}")
    if payload.get("format") == fsdp_dtensor.FORMAT:
        fsdp_dtensor.restore_checkpoint(payload, model=model, optimizer=optimizer,
                                        load_optim=load_optim, load_rng=load_rng)  # fmt: skip
    elif payload.get("format") == torch_dist.FORMAT:
        torch_dist.restore_checkpoint(
            payload, model=model, optimizer=optimizer, load_optim=load_optim, load_rng=load_rng,
            strict=checkpoint.dist_ckpt_strictness,
        )  # fmt: skip
    else:
        _restore_torch(payload, model=model, optimizer=optimizer, path=path,
                       load_optim=load_optim, load_rng=load_rng)  # fmt: skip
    if load_optim:
        scheduler.load_state_dict(payload["opt_param_scheduler"])
        apply_decoupled_lr(optimizer, scheduler, payload, config)


def _restore_torch(payload: dict, *, model, optimizer, path: str, load_optim, load_rng) -> None:
    try:
        model.load_state_dict(payload["model"])
        if load_optim:
            optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError) as error:
        reason = str(error).strip().splitlines()[0][:160]
        raise UserError(f"--load {path}: the checkpoint does not fit this model ({reason})")
    if load_rng:
        torch.set_rng_state(payload["rng_state"])


def has_checkpoint(root: str, fallback: bool) -> bool:
    """A tracker file, or (with --load-fallback) any iteration directory to fall back to."""
    if os.path.isfile(os.path.join(root, TRACKER)):
        return True
    return fallback and os.path.isdir(root) and bool(iterations_on_disk(root))


class Resumed(NamedTuple):
    """Where a loaded checkpoint's run stood."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int  # evaluations read on from there, as Megatron's do


def load(root: str, *, model, optimizer, scheduler, config=None) -> Resumed:
    """Where the checkpoint in `root` stood, or all 0 when `root` has none: Megatron then
    starts from scratch, so `--save DIR --load DIR` works on a first run."""
    checkpoint = _checkpoint_config(config)
    fallback, step = checkpoint.load_fallback, checkpoint.ckpt_step
    if step is not None and step not in _iterations_if_any(root):
        raise UserError(f"--ckpt-step {step}: no checkpoint of iteration {step} in --load {root}")
    if step is None and not has_checkpoint(root, fallback):
        if dist.get_rank() == 0:
            print(f"> no checkpoint in --load {root} (no {TRACKER}): training from scratch",
                  flush=True)  # fmt: skip
        return Resumed(0, 0, 0)
    device = next(model.parameters()).device
    wanted = None if checkpoint.auto_detect_ckpt_format else checkpoint.ckpt_format
    verify = checkpoint.verify_integrity
    payload = read_checkpoint(root, device, fallback, wanted, verify_integrity=verify, step=step)
    check_recorded_args(payload, config, root)
    finetune = checkpoint.finetune
    if config is not None:
        check_schedule(payload, scheduler, config, root)
        train_iters = config.training.train_iters
        if payload["iteration"] >= train_iters and not (finetune or config.training.skip_train):
            raise UserError(
                f"--load {root} is at iteration {payload['iteration']}, at or past "
                f"--train-iters {train_iters}: nothing to train (raise --train-iters)"
            )
    sharded_as_saved = payload.get("format") == fsdp_dtensor.FORMAT  # else whole parameters
    with fsdp.unsharded_for_checkpoint(model, optimizer, load=True, skip=sharded_as_saved):
        restore(payload, model=model, optimizer=optimizer, scheduler=scheduler, path=root,
                config=config)  # fmt: skip
    if dist.get_rank() == 0:
        writer = payload.get("run_id")
        by = f" (saved by run {writer})" if writer else ""
        print(f"> loaded the checkpoint of iteration {payload['iteration']} from {root}{by}",
              flush=True)  # fmt: skip
    if finetune:
        return Resumed(0, 0, 0)
    iteration = payload["iteration"]
    valid = payload.get("consumed_valid_samples")
    if valid is None:  # written before it was recorded: Megatron's estimate for such a one
        valid = _evaluated_samples(config, iteration)
    return Resumed(iteration, payload["consumed_train_samples"], valid)


def _evaluated_samples(config, iteration: int) -> int:
    """Validation samples that evaluating every --eval-interval iterations read up to
    `iteration`."""
    training = None if config is None else config.training
    if training is None or not training.eval_iters or not training.eval_interval:
        return 0
    return (iteration // training.eval_interval) * training.eval_iters * training.eval_batch[0]
