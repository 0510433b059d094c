"""The checkpoint flags and their checks: where and how often to save, what to load (--load,
--ckpt-step, --finetune, --no-load-optim ...), the format (torch_dist, torch or fsdp_dtensor),
torch_dist's strictness and integrity manifests. The modules beside it read them (as the run's
`CheckpointConfig`); --load-fallback is parsed with the reliability flags (training/validation.py).
"""

import argparse

from megatron.common.errors import UserError

# megatron-core's StrictHandling values (dist_checkpointing.validation)
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                        "raise_all", "return_unexpected", "return_all", "ignore_all")  # fmt: skip


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("checkpoints").add_argument
    add("--save", default=None)
    add("--save-interval", type=int, default=None)
    add("--save-retain-interval", type=int, default=None,
        help="keep only the checkpoints of its multiples, and the newest")  # fmt: skip
    add("--load", default=None)
    add("--ckpt-step", type=int, default=None,
        help="load the checkpoint of this iteration from --load, not the newest one")  # fmt: skip
    add(
        "--ckpt-format",
        default="torch_dist",
        help="torch_dist (Megatron's default: megatron-core's distributed checkpoint, loads into "
        "any TP x PP x DP layout), torch (one file per model-parallel rank, same layout only) "
        "or fsdp_dtensor (a fully sharded model's rows as the ranks hold them, any DP size)",
    )
    add(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="load a checkpoint in whichever format it is (else it must be --ckpt-format's)",
    )
    add(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=DIST_CKPT_STRICTNESS,
        help="torch_dist: what to do with keys the checkpoint and the model do not share",
    )
    add("--verify-integrity", action="store_true",
        help="torch_dist: hash the checkpoint's files on save, check them before load")  # fmt: skip
    add("--no-load-optim", action="store_true")
    add("--no-load-rng", action="store_true")
    add("--no-save-optim", action="store_true")
    add("--no-save-rng", action="store_true")
    add("--finetune", action="store_true",
        help="load the model only and start at iteration 0")  # fmt: skip


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    if args.verify_integrity and args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise UserError("--verify-integrity is only supported with --ckpt-format torch_dist "
                        "or fsdp_dtensor")  # fmt: skip
    if args.save_interval is not None and args.save is None:
        raise UserError("--save-interval needs --save DIR")
    retain = args.save_retain_interval
    if retain is not None and (retain < 1 or not args.save_interval or retain % args.save_interval):
        raise UserError(f"--save-retain-interval {retain} must be a positive multiple of "
                        f"--save-interval ({args.save_interval})")  # fmt: skip
    _validate_ckpt_step(args)


def _validate_ckpt_step(args: argparse.Namespace) -> None:
    if args.ckpt_step is None:
        return
    if args.load is None:
        raise UserError("--ckpt-step needs --load DIR")
    if args.ckpt_step < 0:
        raise UserError(f"--ckpt-step must be >= 0, got {args.ckpt_step}")
    if args.load_fallback:
        raise UserError("--ckpt-step names one checkpoint; --load-fallback picks one: pass one")
