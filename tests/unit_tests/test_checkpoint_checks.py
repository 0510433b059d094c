"""Checkpoint problems end in one line naming the file or what differs, in one process with a
one-rank gloo group (the loader is collective: every rank must agree on what it loads).
Every check runs for both formats (`--ckpt-format torch` and `torch_dist`) on a small
megatron-core GPT stage with AdamW state."""

import dataclasses
import errno
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from megatron.common.errors import UserError
from megatron.model.build import build_stage_model
from megatron.training.arguments import build_parser, validate_args
from megatron.training.checkpointing import save_load as checkpointing
from megatron.training.config import RunConfig
from megatron.training.optimizer.build import build_lr_scheduler, build_optimizer

FLAGS = [
    "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
    "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


# every test here saves and loads on a one-process group (tests/unit_tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_rank_group")


FORMATS = ["torch", "torch_dist"]
current = {"format": "torch"}


@pytest.fixture(params=FORMATS, autouse=True)
def ckpt_format(request):
    """Each test once per format: make_args passes --ckpt-format."""
    current["format"] = request.param
    yield request.param


def make_args(*extra: str) -> RunConfig:
    """The run's configuration from FLAGS + `extra` (a 128-token vocabulary)."""
    args = build_parser().parse_args(FLAGS + ["--ckpt-format", current["format"], *extra])
    validate_args(args, world_size=1)
    return RunConfig.from_args(args, vocab_size=128)


def as_written_by(config: RunConfig, **layout) -> RunConfig:
    """`config` with another parallel layout: its checkpoints record that layout."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **layout))


def make_run(args, width: int = 8):
    """A GPT stage with AdamW state (one step on a made-up gradient)."""
    if width != args.model.hidden_size:
        args = make_args("--hidden-size", str(width))
    model = build_stage_model(args, torch.device("cpu"))
    optimizer = build_optimizer(model, args.optimizer)
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.01)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, build_lr_scheduler(optimizer, args.lr)


def save_at(root, iteration: int, args=None) -> None:
    args = args or make_args()
    model, optimizer, scheduler = make_run(args)
    state = SimpleNamespace(
        iteration=iteration, consumed_train_samples=iteration, consumed_valid_samples=0
    )
    checkpointing.save(str(root), state, model, optimizer, scheduler, config=args)


def load(root, args=None, width: int = 8):
    args = args or make_args()
    model, optimizer, scheduler = make_run(args, width)
    iteration, *_ = checkpointing.load(
        str(root), model=model, optimizer=optimizer, scheduler=scheduler, config=args
    )
    return iteration, scheduler


def load_error(root, *extra: str, width: int = 8) -> str:
    with pytest.raises(UserError) as caught:
        load(root, make_args(*extra), width)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def rank_file(root, iteration: int) -> str:
    """The file a damage test breaks: the rank's file, or the torch_dist tensor data."""
    directory = os.path.join(root, f"iter_{iteration:07d}")
    if current["format"] == "torch":
        return os.path.join(directory, "mp_rank_00_000", "model_optim_rng.pt")
    return os.path.join(directory, "__0_0.distcp")  # torch's FileSystemWriter: rank 0's file


@pytest.fixture(scope="module")
def saved_pairs(tmp_path_factory):
    """Checkpoints of iterations 2 and 4, written once per format (copied per test)."""
    return {}


@pytest.fixture
def two_checkpoints(tmp_path, saved_pairs, ckpt_format):
    if ckpt_format not in saved_pairs:
        original = tmp_path.parent / f"pair_{ckpt_format}"
        save_at(original, 2)
        save_at(original, 4)
        saved_pairs[ckpt_format] = original
    shutil.copytree(saved_pairs[ckpt_format], tmp_path, dirs_exist_ok=True)
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


def test_ckpt_step_loads_that_iteration_and_names_a_missing_one(two_checkpoints):
    """--ckpt-step N: iteration N's checkpoint, not the newest (the tracker names 4)."""
    at = ("--load", str(two_checkpoints), "--ckpt-step")
    assert load(two_checkpoints, make_args(*at, "2"))[0] == 2
    assert load_error(two_checkpoints, *at, "3") == (
        f"--ckpt-step 3: no checkpoint of iteration 3 in --load {two_checkpoints}"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ckpt-step", "2"], "--ckpt-step needs --load DIR"),
        (["--load", "ckpt", "--ckpt-step", "-1"], "--ckpt-step must be >= 0, got -1"),
        (["--load", "ckpt", "--ckpt-step", "2", "--load-fallback"],
         "--ckpt-step names one checkpoint; --load-fallback picks one: pass one"),
    ],
)  # fmt: skip
def test_ckpt_step_mistakes_are_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        make_args(*extra)
    assert str(caught.value) == message


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
        (["--untie-embeddings-and-output-weights"],
         "the model shape differs: --untie-embeddings-and-output-weights True (checkpoint False)"),
    ],
)  # fmt: skip
def test_changed_shape_is_named(two_checkpoints, changed, needle):
    assert needle in load_error(two_checkpoints, *changed)


def test_flush_checkpoint_resumes_under_paci_and_back(tmp_path, capsys):
    """Both schedules save with the pipeline empty at a step boundary: no schedule state."""
    save_at(tmp_path, 2)
    assert load(tmp_path, make_args("--pipeline-schedule", "paci"))[0] == 2
    assert "another schedule: --pipeline-schedule paci (checkpoint 1f1b)" in capsys.readouterr().out
    save_at(tmp_path, 4, make_args("--pipeline-schedule", "paci"))
    assert load(tmp_path, make_args("--pipeline-schedule", "1f1b"))[0] == 4


def test_changed_layout_is_named_or_resharded(tmp_path, ckpt_format, capsys):
    """A torch file belongs to its model-parallel rank; torch_dist keys are global."""
    args = make_args()
    model, optimizer, scheduler = make_run(args)
    args = as_written_by(args, pipeline_model_parallel_size=4)  # a 4-stage run
    state = SimpleNamespace(iteration=2, consumed_train_samples=2, consumed_valid_samples=0)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler, config=args)
    if ckpt_format == "torch":
        message = load_error(tmp_path)
        assert "the layout differs: --pipeline-model-parallel-size 1 (checkpoint 4)" in message
        return
    assert load(tmp_path)[0] == 2
    out = capsys.readouterr().out
    assert "another layout: --pipeline-model-parallel-size 1 (checkpoint 4)" in out
    assert "RNG state does not apply to this layout and is not loaded" in out


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


@pytest.mark.parametrize("ckpt_format", ["torch"], indirect=True)  # torch_dist records them
def test_checkpoint_without_recorded_args_that_does_not_fit(tmp_path):
    args = make_args()
    model, optimizer, scheduler = make_run(args)
    state = SimpleNamespace(iteration=2, consumed_train_samples=2, consumed_valid_samples=0)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler)  # no args recorded
    assert "the checkpoint does not fit this model (" in load_error(tmp_path, width=16)


def test_disk_full_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch, ckpt_format):
    """torch.save writes the torch format's files and torch_dist's common.pt."""

    def full(payload, path):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError) as caught:
        save_at(two_checkpoints, 6)
    monkeypatch.undo()
    directory = two_checkpoints / "iter_0000006"
    written = (
        directory / "mp_rank_00_000" / "model_optim_rng.pt" if ckpt_format == "torch" else directory
    )
    assert str(caught.value).startswith(f"disk full while writing {written}")
    assert "latest_checkpointed_iteration.txt still names iteration 4" in str(caught.value)
    assert open(two_checkpoints / checkpointing.TRACKER).read() == "4"
    if ckpt_format == "torch":
        assert not os.listdir(directory / "mp_rank_00_000")  # no partial file
    else:
        assert sorted(os.listdir(two_checkpoints)) == [
            "iter_0000002",
            "iter_0000004",
            "latest_checkpointed_iteration.txt",
        ]
    assert load(two_checkpoints)[0] == 4


def save_and_load_fresh(root, args) -> tuple:
    """Save a run at iteration 3 (its schedule 3 steps on), load it into a new run with other
    weights; (saved run, new run, what load returned), after checking the weights are equal."""
    model, optimizer, scheduler = make_run(args)
    scheduler.step(increment=3)
    state = SimpleNamespace(iteration=3, consumed_train_samples=24, consumed_valid_samples=16)
    checkpointing.save(str(root), state, model, optimizer, scheduler, config=args)
    fresh_model, fresh_optimizer, fresh_scheduler = make_run(args)
    with torch.no_grad():
        for param in fresh_model.parameters():
            param.add_(1.0)
    fresh_optimizer.state.clear()  # as a new run's optimizer: no state before its first step
    loaded = checkpointing.load(str(root), model=fresh_model, optimizer=fresh_optimizer,
                                scheduler=fresh_scheduler, config=args)  # fmt: skip
    for name, value in model.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, fresh_model.state_dict()[name]), name
    return (model, optimizer, scheduler), (fresh_model, fresh_optimizer, fresh_scheduler), loaded


def test_a_checkpoint_without_the_validation_position_resumes_at_megatrons_estimate(
    tmp_path, ckpt_format
):
    """One written before the validation samples were recorded: evaluations resume where
    evaluating every --eval-interval iterations would have read to, as Megatron estimates it
    (iteration 12, every 5 with 3 batches of 8: 2 x 3 x 8 = 48)."""
    args = make_args("--eval-interval", "5", "--eval-iters", "3", "--global-batch-size", "8",
                     "--train-iters", "20")  # fmt: skip
    model, optimizer, scheduler = make_run(args)
    state = SimpleNamespace(iteration=12, consumed_train_samples=96, consumed_valid_samples=7)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler, config=args)
    # the torch format's one rank file, or torch_dist's common state
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    wanted = "common.pt" if ckpt_format == "torch_dist" else ".pt"
    (path,) = [f for f in written if f.endswith(wanted)]
    payload = torch.load(path, weights_only=False)
    assert payload.pop("consumed_valid_samples") == 7
    torch.save(payload, path)
    loaded = checkpointing.load(str(tmp_path), model=model, optimizer=optimizer,
                                scheduler=scheduler, config=args)  # fmt: skip
    assert loaded == (12, 96, 48)


def test_round_trip_restores_model_optimizer_and_schedule(tmp_path):
    saved, fresh, loaded = save_and_load_fresh(tmp_path, make_args())
    (_, optimizer, _), (_, fresh_optimizer, fresh_scheduler) = saved, fresh
    assert loaded == (3, 24, 16) and fresh_scheduler.num_steps == 3
    expected, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert expected["state"].keys() == got["state"].keys()
    for index, entries in expected["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][key]))
    assert expected["param_groups"] == got["param_groups"]


def test_wrong_format_is_named_and_auto_detect_loads_it(two_checkpoints, ckpt_format):
    other = "torch" if ckpt_format == "torch_dist" else "torch_dist"
    current["format"] = other
    message = load_error(two_checkpoints)
    assert f"is in the {ckpt_format} format, not --ckpt-format {other}" in message
    assert load(two_checkpoints, make_args("--auto-detect-ckpt-format"))[0] == 4


def test_interrupted_save_leaves_the_previous_checkpoint(two_checkpoints, ckpt_format):
    """What a killed save leaves (a staging directory, or a rank file without the tracker
    naming it) is never loaded; the next save of that iteration replaces it."""
    if ckpt_format == "torch_dist":
        staging = two_checkpoints / "iter_0000006.tmp"
        staging.mkdir()
        (staging / "__0_0.distcp").write_bytes(b"half a tensor")
    else:
        os.makedirs(os.path.dirname(rank_file(two_checkpoints, 6)))
        open(rank_file(two_checkpoints, 6), "wb").write(b"half a file")
    assert load(two_checkpoints)[0] == 4
    assert load(two_checkpoints, make_args("--load-fallback"))[0] == 4
    save_at(two_checkpoints, 6)
    assert load(two_checkpoints)[0] == 6
    assert not (two_checkpoints / "iter_0000006.tmp").exists()


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_optimizer_state_takes_its_parameters_keys_and_sharding():
    """Adam's moments become ShardedTensors with their parameter's global key, offsets and
    replica id (so they reshard like it); its step count one object per parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron.training.checkpointing import torch_dist as dc

    model, optimizer, _ = make_run(make_args("--num-layers", "2"))
    model_sharded = dc.model_sharded_state_dict(model)
    parameters = dc.sharded_parameters(model_sharded)
    entries = dc.OptimizerMapping(optimizer, parameters).sharded_state_dict(with_local=True)
    assert entries.pop("local").data == {}  # nothing tied to the layout for AdamW
    weight = model_sharded["decoder.layers.1.mlp.linear_fc1.weight"]
    assert weight.key == "decoder.layers.1.mlp.linear_fc1.weight"  # global layer number
    for name in ("exp_avg", "exp_avg_sq"):
        moment = entries[f"optimizer.state.{name}.{weight.key}"]
        assert moment.data is optimizer.state[weight.data][name]
        assert (moment.global_shape, moment.global_offset, moment.replica_id) == (
            weight.global_shape, weight.global_offset, weight.replica_id)  # fmt: skip
    step = entries[f"optimizer.object.step.{weight.key}/shard_0_1"]
    assert isinstance(step, ShardedObject) and float(step.data) == 1.0
    assert len(entries) == 3 * len(parameters)


def state_leaves(node, path=()):
    """Every value of an optimizer state dict outside its parameter groups, by path."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key != "param_groups":
                yield from state_leaves(value, path + (key,))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from state_leaves(value, path + (index,))
    else:
        yield path, node


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
@pytest.mark.parametrize(
    "flags",
    [["--optimizer", "muon"], ["--optimizer", "soap"], ["--optimizer", "lion"],
     ["--pipeline-schedule", "paci", "--async-error-feedback",
      "--delay-compensation-lambda", "0.1"]],
    ids=["muon", "soap", "lion", "adam_ef_dc"],
)  # fmt: skip
def test_every_optimizers_state_round_trips(tmp_path, flags):
    """Optimizer chains (AdamW + Muon with its split QKV blocks, AdamW + SOAP with its
    preconditioners), pytorch_optimizer's group step counters and the delay-mitigation
    buffers come back entry by entry into a new run's optimizer."""
    args = make_args(*flags)
    model, optimizer, scheduler = make_run(args)
    optimizer.step()  # a second step: SOAP makes its first update only now
    state = SimpleNamespace(iteration=2, consumed_train_samples=2, consumed_valid_samples=0)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler, config=args)
    fresh_model = build_stage_model(args, torch.device("cpu"))
    fresh_optimizer = build_optimizer(fresh_model, args.optimizer)
    checkpointing.load(str(tmp_path), model=fresh_model, optimizer=fresh_optimizer,
                       scheduler=build_lr_scheduler(fresh_optimizer, args.lr), config=args)  # fmt: skip
    expected = dict(state_leaves(optimizer.state_dict()))
    got = dict(state_leaves(fresh_optimizer.state_dict()))
    assert expected.keys() == got.keys() and len(expected) > 0
    for path, value in expected.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(got[path])), path


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_state_that_does_not_reshard_refuses_another_layout(tmp_path):
    """SOAP's preconditioners are not parameter-shaped: they load into the saving layout only."""
    args = make_args("--optimizer", "soap")
    model, optimizer, scheduler = make_run(args)
    args = as_written_by(args, tensor_model_parallel_size=2)  # a TP=2 run
    state = SimpleNamespace(iteration=2, consumed_train_samples=2, consumed_valid_samples=0)
    checkpointing.save(str(tmp_path), state, model, optimizer, scheduler, config=args)
    message = load_error(tmp_path, "--optimizer", "soap")
    assert "this optimizer keeps state that does not reshard (" in message
    assert "saved with tensor x pipeline (2, 1): load it with that layout" in message
    assert load(tmp_path, make_args("--optimizer", "soap", "--no-load-optim"))[0] == 2


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_emulated_stages_are_checkpointed_in_the_torch_format_only():
    emulated = ["--emulated-forward-ms", "1", "--emulated-backward-ms", "2", "--save", "/tmp/c"]
    with pytest.raises(UserError) as caught:
        make_args(*emulated)
    assert str(caught.value).endswith("checkpoint them with --ckpt-format torch")
    current["format"] = "torch"
    assert make_args(*emulated).checkpoint.ckpt_format == "torch"


# ---------------------------------------------------------------------------- --verify-integrity
@pytest.fixture
def verified_checkpoints(tmp_path, saved_pairs):
    """Checkpoints of iterations 2 and 4 saved with --verify-integrity (copied per test)."""
    if "verified" not in saved_pairs:
        original = tmp_path.parent / "pair_verified"
        save_at(original, 2, make_args("--verify-integrity"))
        save_at(original, 4, make_args("--verify-integrity"))
        saved_pairs["verified"] = original
    shutil.copytree(saved_pairs["verified"], tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_integrity_manifest_hashes_every_file(verified_checkpoints):
    """The manifest lists every file of the checkpoint with its SHA-256 and size (hashed here
    again with hashlib, file by file)."""
    import hashlib
    import json

    directory = verified_checkpoints / "iter_0000004"
    manifest = json.loads((directory / "integrity.json").read_text())
    on_disk = sorted(name for name in os.listdir(directory) if name != "integrity.json")
    assert manifest["algorithm"] == "sha256" and "__0_0.distcp" in on_disk
    assert sorted(manifest["files"]) == on_disk
    for name in on_disk:
        data = (directory / name).read_bytes()
        expected = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        assert manifest["files"][name] == expected, name


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_verified_checkpoint_loads_the_saved_state(tmp_path):
    """Saved and checked with --verify-integrity: the weights come back (checked in
    save_and_load_fresh) and the manifest was there to check."""
    _, _, loaded = save_and_load_fresh(tmp_path, make_args("--verify-integrity"))
    assert loaded == (3, 24, 16)
    assert (tmp_path / "iter_0000003" / "integrity.json").is_file()


def flip_one_byte(path) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_changed_byte_fails_the_integrity_check(verified_checkpoints):
    """One flipped byte in the tensor data: the file keeps its size, so only the hash sees it;
    --load-fallback loads the previous verified checkpoint."""
    directory = verified_checkpoints / "iter_0000004"
    flip_one_byte(directory / "__0_0.distcp")
    message = load_error(verified_checkpoints, "--verify-integrity")
    assert message.startswith(f"checkpoint {directory} failed its integrity check: "
                              "__0_0.distcp changed (sha256 ")  # fmt: skip
    assert "--load-fallback" in message
    args = make_args("--verify-integrity", "--load-fallback")
    assert load(verified_checkpoints, args)[0] == 2


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
@pytest.mark.parametrize(
    "damage, needle",
    [("no_manifest", "no integrity.json"), ("missing", "common.pt is missing"),
     ("extra", "notes.txt is not in integrity.json (an extra file)")],
)  # fmt: skip
def test_manifest_and_files_must_agree(verified_checkpoints, damage, needle):
    directory = verified_checkpoints / "iter_0000004"
    if damage == "no_manifest":
        os.remove(directory / "integrity.json")
    elif damage == "missing":
        os.remove(directory / "common.pt")
    else:
        (directory / "notes.txt").write_text("added after the save")
    message = load_error(verified_checkpoints, "--verify-integrity")
    assert message.startswith(f"checkpoint {directory} failed its integrity check: {needle}")
    if damage == "no_manifest":  # without the flag a checkpoint need not have a manifest
        assert load(verified_checkpoints)[0] == 4
    else:  # but one that has a manifest is checked against it, flag or not
        assert load_error(verified_checkpoints) == message


@pytest.mark.parametrize("ckpt_format", ["torch_dist"], indirect=True)
def test_a_manifest_is_checked_without_the_flag(verified_checkpoints):
    """A tampered shard of a checkpoint saved with --verify-integrity is caught by a run that
    loads it without the flag: the manifest beside it is enough."""
    directory = verified_checkpoints / "iter_0000004"
    flip_one_byte(directory / "__0_0.distcp")
    message = load_error(verified_checkpoints)
    assert message.startswith(f"checkpoint {directory} failed its integrity check: "
                              "__0_0.distcp changed (sha256 ")  # fmt: skip
    assert load(verified_checkpoints, make_args("--load-fallback"))[0] == 2


@pytest.mark.parametrize("ckpt_format", ["torch"], indirect=True)
def test_verify_integrity_needs_torch_dist():
    with pytest.raises(UserError) as caught:
        make_args("--verify-integrity")
    assert str(caught.value) == (
        "--verify-integrity is only supported with --ckpt-format torch_dist or fsdp_dtensor"
    )


def ramp_args(*ramp: str, extra=()):
    """A run by samples with --rampup-batch-size START INCREMENT SAMPLES (or none)."""
    flags = [f for f in FLAGS if f not in ("--train-iters", "10")]
    flags += ["--train-samples", "160", "--global-batch-size", "32", "--ckpt-format",
              current["format"], *(["--rampup-batch-size", *ramp] if ramp else []), *extra]  # fmt: skip
    args = build_parser().parse_args(flags)
    validate_args(args, world_size=1)
    return RunConfig.from_args(args, vocab_size=128)


@pytest.mark.parametrize("ckpt_format", FORMATS, indirect=True)
def test_changed_batch_ramp_is_named_or_honoured(tmp_path):
    save_at(tmp_path, 2, ramp_args("8", "8", "64"))
    with pytest.raises(UserError) as caught:
        load(tmp_path, ramp_args("16", "8", "64"))
    assert str(caught.value) == (
        f"--load {tmp_path}: the batch-size ramp differs: --rampup-batch-size 16 8 64 "
        "(checkpoint 8 8 64); pass --override-opt_param-scheduler to use the new one, or the "
        "checkpoint's"
    )
    with pytest.raises(UserError) as caught:
        load(tmp_path, ramp_args())
    assert "--rampup-batch-size none (checkpoint 8 8 64)" in str(caught.value)
    assert load(tmp_path, ramp_args("8", "8", "64"))[0] == 2
    assert (
        load(tmp_path, ramp_args("16", "8", "64", extra=["--override-opt_param-scheduler"]))[0] == 2
    )


def steps_args(schedule: str | None, extra=()):
    """A run by samples with --step-batch-size-schedule SCHEDULE (or a constant batch of 32)."""
    flags = [f for f in FLAGS if f not in ("--train-iters", "10")]
    batch = ["--step-batch-size-schedule", schedule] if schedule else ["--global-batch-size", "32"]
    flags += ["--train-samples", "160", "--ckpt-format", current["format"], *batch, *extra]
    args = build_parser().parse_args(flags)
    validate_args(args, world_size=1)
    return RunConfig.from_args(args, vocab_size=128)


@pytest.mark.parametrize("ckpt_format", FORMATS, indirect=True)
def test_changed_step_schedule_is_named_or_honoured(tmp_path):
    """Compared in samples (--seq-length 8): 512 tokens and 64 samples are the same step."""
    save_at(tmp_path, 2, steps_args("0:8 512:32"))
    with pytest.raises(UserError) as caught:
        load(tmp_path, steps_args("0:16 512:32"))
    assert str(caught.value) == (
        f"--load {tmp_path}: the batch-size steps differ: --step-batch-size-schedule 0:16 64:32 "
        "(checkpoint 0:8 64:32, thresholds in samples); pass --override-opt_param-scheduler to "
        "use the new one, or the checkpoint's"
    )
    with pytest.raises(UserError) as caught:
        load(tmp_path, steps_args(None))
    assert "--step-batch-size-schedule none (checkpoint 0:8 64:32" in str(caught.value)
    assert load(tmp_path, steps_args("0:8, 0.512K:32"))[0] == 2
    extra = ["--override-opt_param-scheduler"]
    assert load(tmp_path, steps_args("0:16 512:32", extra=extra))[0] == 2


def decoupled_lrs(scheduler) -> set[tuple[float, float]]:
    groups = scheduler.optimizer.param_groups
    return {(g["max_lr"], g["min_lr"]) for g in groups if g.get("is_decoupled_lr")}


def test_changed_decoupled_lr_is_named_or_honoured(tmp_path):
    """The embedding's and output layer's own LR bounds sit in the optimizer state: a changed
    --decoupled-lr follows the LR schedule's rule, turning it off is refused."""
    save_at(tmp_path, 2, make_args("--decoupled-lr", "2e-3", "--min-lr", "1e-4"))
    message = load_error(tmp_path, "--decoupled-lr", "3e-3", "--min-lr", "1e-4")
    assert "the learning-rate schedule differs: --decoupled-lr 0.003 (checkpoint 0.002)" in message
    assert "--override-opt_param-scheduler" in message
    override = make_args("--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-4", "--min-lr",
                         "1e-4", "--override-opt_param-scheduler")  # fmt: skip
    assert decoupled_lrs(load(tmp_path, override)[1]) == {(3e-3, 2e-4)}
    keep = make_args("--decoupled-lr", "3e-3", "--min-lr", "1e-4",
                     "--use-checkpoint-opt_param-scheduler")  # fmt: skip
    assert decoupled_lrs(load(tmp_path, keep)[1]) == {(2e-3, 1e-4)}
    same = load(tmp_path, make_args("--decoupled-lr", "2e-3", "--min-lr", "1e-4"))
    assert same[0] == 2 and decoupled_lrs(same[1]) == {(2e-3, 1e-4)}
    message = load_error(tmp_path, "--min-lr", "1e-4", "--override-opt_param-scheduler")
    assert message == (
        f"--load {tmp_path}: --decoupled-lr is not given here and 0.002 in the checkpoint, "
        "which changes the optimizer's parameter groups; resume with the checkpoint's "
        "setting, or add --no-load-optim"
    )


def test_save_retain_interval_keeps_its_multiples_and_the_newest(tmp_path):
    """--save-retain-interval 4 with --save-interval 2, as Megatron: a save deletes the
    checkpoint it replaces unless that one's iteration is a multiple of 4."""
    args = make_args("--save", str(tmp_path), "--save-interval", "2", "--save-retain-interval", "4")
    for iteration in (2, 4, 6, 8):
        save_at(tmp_path, iteration, args)
    kept = sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000008"]  # 2 and 6 deleted once replaced
    save_at(tmp_path, 9, args)  # the newest is kept whatever its iteration
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("iter_"))[-1] == "iter_0000009"
    assert load(tmp_path, args)[0] == 9


@pytest.mark.parametrize("extra, message", [
    (["--save-retain-interval", "3"], "must be a positive multiple of --save-interval .2."),
    (["--save-retain-interval", "0"], "must be a positive multiple"),
])  # fmt: skip
def test_save_retain_interval_is_checked(tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        make_args("--save", str(tmp_path), "--save-interval", "2", *extra)
