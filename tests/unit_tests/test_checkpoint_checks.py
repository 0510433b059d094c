"""Checkpoint problems end in one line naming the file or what differs, in one process with a
one-rank gloo group (the loader is collective: every rank must agree on what it loads)."""

import errno
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.arguments import build_parser, validate_args
from megatron.training.errors import UserError
from megatron.training.optimizer import build_lr_scheduler, build_optimizer

FLAGS = [
    "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
    "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    import torch.distributed as dist
    from megatron.core import parallel_state

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def make_args(*extra: str):
    args = build_parser().parse_args(FLAGS + list(extra))
    validate_args(args, world_size=1)
    args.padded_vocab_size = 128
    return args


def make_run(args, width: int = 8):
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width))
    optimizer = build_optimizer(model, args)
    return model, optimizer, build_lr_scheduler(optimizer, args)


def save_at(root, iteration: int, args=None) -> None:
    args = args or make_args()
    model, optimizer, scheduler = make_run(args)
    state = SimpleNamespace(iteration=iteration, consumed_train_samples=iteration)
    checkpointing.save(str(root), state, model, optimizer, scheduler, args=args)


def load(root, args=None, width: int = 8):
    args = args or make_args()
    model, optimizer, scheduler = make_run(args, width)
    iteration, _ = checkpointing.load(
        str(root), model=model, optimizer=optimizer, scheduler=scheduler, args=args
    )
    return iteration, scheduler


def load_error(root, *extra: str, width: int = 8) -> str:
    with pytest.raises(UserError) as caught:
        load(root, make_args(*extra), width)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def rank_file(root, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00_000", "model_optim_rng.pt")


@pytest.fixture
def two_checkpoints(tmp_path):
    save_at(tmp_path, 2)
    save_at(tmp_path, 4)
    return tmp_path


def test_round_trip(two_checkpoints):
    assert load(two_checkpoints)[0] == 4


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_file_is_named_and_fallback_loads_the_previous(two_checkpoints, damage):
    path = rank_file(two_checkpoints, 4)
    data = open(path, "rb").read()
    replacement = {"truncated": data[: len(data) // 2], "garbage": b"\x00not a zip" * 50}
    open(path, "wb").write(replacement.get(damage, b""))
    message = load_error(two_checkpoints)
    assert f"checkpoint file {path} is truncated or corrupt" in message
    assert "--load-fallback" in message
    assert load(two_checkpoints, make_args("--load-fallback"))[0] == 2


def test_missing_rank_file(two_checkpoints):
    os.remove(rank_file(two_checkpoints, 4))
    assert f"missing {rank_file(two_checkpoints, 4)}" in load_error(two_checkpoints)


def test_malformed_tracker(two_checkpoints):
    open(two_checkpoints / checkpointing.TRACKER, "w").write("iter_4\n")
    assert "malformed latest_checkpointed_iteration.txt ('iter_4'" in load_error(two_checkpoints)
    assert load(two_checkpoints, make_args("--load-fallback"))[0] == 4


def test_no_tracker_starts_from_scratch(tmp_path, capsys):
    """As Megatron: `--load DIR` without a checkpoint in DIR trains from scratch and says so."""
    assert load(tmp_path)[0] == 0
    assert "training from scratch" in capsys.readouterr().out


def test_no_tracker_with_fallback_loads_what_is_on_disk(two_checkpoints):
    os.remove(os.path.join(two_checkpoints, checkpointing.TRACKER))
    assert load(two_checkpoints, make_args("--load-fallback"))[0] == 4


@pytest.mark.parametrize(
    "changed, needle",
    [
        (["--hidden-size", "16"], "the model shape differs: --hidden-size 16 (checkpoint 8)"),
        (["--num-layers", "4"], "the model shape differs: --num-layers 4 (checkpoint 2)"),
        (["--pipeline-schedule", "paci"], "the schedule differs: --pipeline-schedule paci"),
    ],
)
def test_changed_shape_or_schedule_is_named(two_checkpoints, changed, needle):
    assert needle in load_error(two_checkpoints, *changed)


def test_changed_layout_is_named(tmp_path):
    args = make_args()
    args.pipeline_model_parallel_size = 4  # recorded as written by a 4-stage run
    save_at(tmp_path, 2, args)
    message = load_error(tmp_path)
    assert "the layout differs: --pipeline-model-parallel-size 1 (checkpoint 4)" in message


def test_changed_lr_is_named_or_honoured(two_checkpoints):
    message = load_error(two_checkpoints, "--lr", "2e-3")
    assert "the learning-rate schedule differs: --lr 0.002 (checkpoint 0.001)" in message
    assert "--override-opt_param-scheduler" in message
    _, scheduler = load(
        two_checkpoints, make_args("--lr", "2e-3", "--override-opt_param-scheduler")
    )
    assert scheduler.max_lr == 2e-3
    args = make_args("--lr", "2e-3", "--use-checkpoint-opt_param-scheduler")
    assert load(two_checkpoints, args)[1].max_lr == 1e-3


def test_changed_train_iters_is_named(two_checkpoints):
    message = load_error(two_checkpoints, "--train-iters", "20")
    assert "decay iterations" in message and "20 (checkpoint 10)" in message


def test_load_past_train_iters(two_checkpoints):
    message = load_error(two_checkpoints, "--train-iters", "4", "--lr-decay-iters", "10",
                         "--use-checkpoint-opt_param-scheduler")  # fmt: skip
    assert "is at iteration 4, at or past --train-iters 4: nothing to train" in message


def test_checkpoint_without_recorded_args_that_does_not_fit(tmp_path):
    args = make_args()
    model, optimizer, scheduler = make_run(args)
    state = SimpleNamespace(iteration=2, consumed_train_samples=2)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler)  # no args recorded
    assert "the checkpoint does not fit this model (" in load_error(tmp_path, width=16)


def test_disk_full_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch):
    def full(payload, path):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError) as caught:
        save_at(two_checkpoints, 6)
    assert str(caught.value).startswith(f"disk full while writing {rank_file(two_checkpoints, 6)}")
    assert "latest_checkpointed_iteration.txt still names iteration 4" in str(caught.value)
    assert open(two_checkpoints / checkpointing.TRACKER).read() == "4"
    assert not os.listdir(os.path.dirname(rank_file(two_checkpoints, 6)))  # no partial file
