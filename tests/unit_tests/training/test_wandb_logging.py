"""Weights & Biases logging under Megatron's --wandb-* flags, offline: the scalars written to
TensorBoard reach the W&B run's files under the same names and steps (read back from the
run file)."""

import os

import pytest
from small_run_flags import validated

from megatron.common.errors import UserError


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--wandb-project", "p"], "Please specify the wandb experiment name!"),
        (["--wandb-project", "p", "--wandb-exp-name", "e"],
         "--wandb-project needs --wandb-save-dir or --save"),
        (["--wandb-exp-name", "e"], "--wandb-exp-name needs --wandb-project"),
    ],
)  # fmt: skip
def test_megatrons_rules_are_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(extra)
    assert str(caught.value).startswith(message)


def test_scalars_reach_the_offline_run_as_in_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    from wandb_records import read_run, run_file

    from megatron.training.config import RunConfig
    from megatron.training.tracking.wandb_run import ScalarWriters, WandbWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "ckpt"
    args = validated(["--wandb-project", "proj", "--wandb-exp-name", "run-1",
                      "--save", str(save), "--tensorboard-dir", str(tmp_path / "tb")])  # fmt: skip
    logging = RunConfig.from_args(args).logging
    writer = ScalarWriters([SummaryWriter(log_dir=args.tensorboard_dir),
                            WandbWriter(logging, args.save)])  # fmt: skip
    for step in range(1, 4):
        writer.add_scalar("lm loss", 7.0 / step, step)
        writer.add_scalar("drift/stage0/max", step % 2, step)
    writer.add_scalar("lm loss validation", 2.5, 3)
    writer.close()
    run = read_run(run_file(os.path.join(save, "wandb")))  # Megatron's default: --save/wandb
    assert (run["project"], run["name"]) == ("proj", "run-1")
    assert run["config"]["lr"] == args.lr and run["config"]["wandb_project"] == "proj"
    events = EventAccumulator(args.tensorboard_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert sorted(tags) == sorted(run["history"])
    for tag in tags:
        expected = {e.step: pytest.approx(e.value, rel=1e-6) for e in events.Scalars(tag)}
        assert run["history"][tag] == expected, tag
