"""Weights & Biases logging with Megatron's flags: `--wandb-project` turns it on, with
`--wandb-exp-name` (the run's name, required), `--wandb-entity` (optional) and
`--wandb-save-dir` (where the run's files go; default `--save`/wandb).

The logging rank (the last stage's first tensor- and data-parallel rank, Megatron's last rank)
logs every scalar it writes to TensorBoard under the same name, at the iteration as the step,
so the per-stage drift is there per stage as in TensorBoard. wandb's own settings decide
where the run goes: `WANDB_MODE=offline` keeps it in files under the save directory (no
network; `wandb sync DIR` uploads it later).
"""

import argparse
import os

from megatron.common.errors import UserError


def add_wandb_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("Weights & Biases").add_argument
    add("--wandb-project", default=None, help="log to this W&B project (off when not given)")
    add("--wandb-exp-name", default=None, help="the W&B run's name (needed with a project)")
    add("--wandb-entity", default=None, help="the W&B team or user")
    add("--wandb-save-dir", default=None, help="the run's local files (default: --save/wandb)")


def wandb_enabled(logging) -> bool:
    """`logging`: the run's `LoggingConfig` (or, while validating, the flags)."""
    return bool(getattr(logging, "wandb_project", None))


def save_dir(logging, save: str | None) -> str:
    return logging.wandb_save_dir or os.path.join(save, "wandb")


def validate_wandb_args(args: argparse.Namespace) -> None:
    """Megatron's rules, before any work, one line each."""
    if not wandb_enabled(args):
        others = [
            f for f in ("wandb_exp_name", "wandb_entity", "wandb_save_dir") if getattr(args, f)
        ]
        if others:
            raise UserError(f"--{others[0].replace('_', '-')} needs --wandb-project")
        return
    if not args.wandb_exp_name:
        raise UserError("Please specify the wandb experiment name! (--wandb-exp-name)")
    if not args.wandb_save_dir and not args.save:
        raise UserError("--wandb-project needs --wandb-save-dir or --save (its files go there)")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError(
            "--wandb-project needs the wandb package: pip install -e .[wandb]"
        ) from None


def plain_flags(args: argparse.Namespace) -> dict:
    """The flags as the run's config (values W&B stores as they are), taken once by
    `RunConfig.from_args`."""
    plain = (bool, int, float, str, type(None))
    config = {}
    for name, value in vars(args).items():
        if isinstance(value, plain) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value)
        ):
            config[name] = value
    return config


class WandbWriter:
    """TensorBoard's `add_scalar` / `flush` / `close` onto a W&B run."""

    def __init__(self, logging, save: str | None):
        """`logging`: the run's `LoggingConfig`; `save`: --save (the default directory)."""
        import wandb

        directory = save_dir(logging, save)
        os.makedirs(directory, exist_ok=True)
        settings = dict(dir=directory, name=logging.wandb_exp_name,
                        project=logging.wandb_project, config=dict(logging.flags))  # fmt: skip
        if logging.wandb_entity:
            settings["entity"] = logging.wandb_entity
        self.run = wandb.init(**settings)

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.run.log({tag: float(value)}, step=int(step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for the run's files to be written


class ScalarWriters:
    """Several writers (TensorBoard, W&B) seen as one."""

    def __init__(self, writers: list):
        self.writers = writers

    def add_scalar(self, tag: str, value, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
