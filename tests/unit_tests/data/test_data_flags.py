"""Megatron's data flags: per-sample options (--eod-mask-loss, --reset-position-ids) give the
batches megatron-core's own GPT dataset gives; per-split blends and data-args files choose the
data each split reads."""

import json

import numpy
import pytest
import torch
from datatests_support import random_documents, write_indexed_dataset

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.config import RunConfig
from megatron.training.data.datasets import data_iterators_of_run
from megatron.training.tokenizer.tokenizer import build_tokenizer

SEQ, VOCAB = 32, 100
EOD = VOCAB - 1  # NullTokenizer's end of document


def flags(*extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "8", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--eval-interval", "4", "--eval-iters", "2",
            "--split", "80,20,0",
            *extra]  # fmt: skip


def validated(*extra: str):
    args = build_parser().parse_args(flags(*extra))
    validate_args(args, world_size=1)
    return args


def batches(args, tmp_path, count: int = 4):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    assert tokenizer.eod == EOD
    args.data_cache_path = str(tmp_path / "cache")
    config = RunConfig.from_args(args, vocab_size=tokenizer.vocab_size)
    train, valid = data_iterators_of_run(config, tokenizer, train_samples=16, valid_samples=8)
    return [next(train) for _ in range(count)], next(valid)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two datasets whose ids do not overlap: `low` uses ids below 40, `high` 40 and above
    (documents with an end-of-document token every 20-150 ids)."""
    root = tmp_path_factory.mktemp("data_flags")
    low, high = str(root / "low"), str(root / "high")
    write_indexed_dataset(low, random_documents(60, 40, seed=1, eod=EOD))
    docs = [[40 + i % 59 if i != EOD else i for i in doc]
            for doc in random_documents(60, 60, seed=2, eod=EOD)]  # fmt: skip
    write_indexed_dataset(high, docs)
    return low, high


def test_sample_options_match_megatron_cores_dataset(corpora, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    low, _ = corpora
    args = validated("--data-path", low, "--eod-mask-loss", "--reset-position-ids")
    train, _ = batches(args, tmp_path)
    plain, _ = batches(validated("--data-path", low), tmp_path)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=SEQ, blend=([low], None), split=args.split,
        path_to_cache=str(tmp_path / "reference_cache"),
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1),
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True,
        create_attention_mask=False,
    )  # fmt: skip
    reference = BlendedMegatronDatasetBuilder(GPTDataset, [16, 8, 0], lambda: True, config)
    dataset = reference.build()[0]
    ends_seen = 0
    for index, batch in enumerate(train):
        for row in range(2):
            sample = dataset[2 * index + row]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(batch[key][row], sample[key].to(batch[key].dtype)), key
            ends = batch["tokens"][row] == EOD
            ends_seen += int(ends.sum())
            assert torch.all(batch["loss_mask"][row][ends] == 0)
    assert ends_seen > 0  # the flags had something to act on
    for key in ("loss_mask", "position_ids"):
        assert any(not torch.equal(a[key], b[key]) for a, b in zip(train, plain)), key
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(train, plain))


def test_per_split_paths_read_each_splits_data(corpora, tmp_path):
    low, high = corpora
    train, valid = batches(validated("--train-data-path", low, "--valid-data-path", high), tmp_path)
    assert all(int(b["tokens"].max()) < 40 or EOD in b["tokens"] for b in train)
    assert all(int(b["tokens"][b["tokens"] != EOD].max()) < 40 for b in train)
    assert int(valid["tokens"][valid["tokens"] != EOD].min()) >= 40
    # the same blends from a JSON file
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": [low], "valid": high, "test": []}))
    train_file, valid_file = batches(validated("--per-split-data-args-path", str(spec)), tmp_path)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(train, train_file))
    assert torch.equal(valid["tokens"], valid_file["tokens"])


def test_data_args_path_is_the_data_path_in_a_file(corpora, tmp_path):
    low, high = corpora
    blend = ["0.3", low, "0.7", high]
    (tmp_path / "blend.txt").write_text(" ".join(blend) + "\n")
    from_file, _ = batches(validated("--data-args-path", str(tmp_path / "blend.txt")), tmp_path)
    from_flag, _ = batches(validated("--data-path", *blend), tmp_path)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(from_file, from_flag))
    tokens = numpy.concatenate([b["tokens"].numpy().ravel() for b in from_file])
    assert (tokens < 40).any() and ((tokens >= 40) & (tokens != EOD)).any()  # both datasets


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data-path", "x", "--train-data-path", "y"],
         "--data-path and --train-data-path exclude each other"),
        (["--data-path", "x", "--data-args-path", "y"],
         "--data-path and --data-args-path exclude each other"),
        (["--data-args-path", "/nonexistent/blend.txt"],
         "--data-args-path /nonexistent/blend.txt: No such file or directory"),
        (["--valid-data-path", "x"], "no training data: --train-data-path"),
        (["--train-data-path", "x"], "no validation data (--valid-data-path)"),
        (["--train-data-path", "/nonexistent/corpus", "--eval-iters", "0"], "/nonexistent/corpus"),
    ],
)  # fmt: skip
def test_bad_data_flags_are_one_line(extra, message):
    with pytest.raises(UserError) as caught:
        validated(*extra)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_reset_attention_mask_is_megatron_cores_and_keeps_documents_apart(corpora, tmp_path):
    """The batch carries megatron-core's per-document mask; with it (and positions reset), the
    model's output on a document that starts mid-sample equals that document run alone."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.model.build import build_stage_model

    low, _ = corpora
    extra = ("--data-path", low, "--reset-attention-mask", "--reset-position-ids",
             "--position-embedding-type", "rope", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--transformer-impl", "local")  # fmt: skip
    args = validated(*extra)
    train, _ = batches(args, tmp_path, count=1)
    batch = train[0]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, SEQ, SEQ) and mask.dtype == torch.bool
    tokens = batch["tokens"][0]
    end = int((tokens == EOD).nonzero()[0])  # the first document ends here
    assert 0 < end < SEQ - 2
    assert mask[0, 0, end + 1, end] and not mask[0, 0, end, end]  # no look across documents
    created = not dist.is_initialized()  # leave the process as found (other tests make one)
    if created:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
        parallel_state.initialize_model_parallel(1, 1)
    try:
        config = RunConfig.from_args(args, vocab_size=VOCAB)
        model = build_stage_model(config, torch.device("cpu")).eval()
        with torch.no_grad():
            whole = model(batch["tokens"][:1], batch["position_ids"][:1], mask[:1])
            rest = tokens[end + 1 :].unsqueeze(0)
            alone = model(rest, torch.arange(rest.size(1)).unsqueeze(0), None)
            unmasked = model(batch["tokens"][:1], batch["position_ids"][:1], None)
    finally:
        if created:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    torch.testing.assert_close(whole[:, end + 1 :], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[:, end + 1 :], alone, atol=1e-3)


def test_pretrain_gpts_forward_step_trains_with_the_mask(corpora, tmp_path):
    """pretrain_gpt.py's forward_step hands the batch's mask to the model (one process, the
    reference engine): the losses differ from the run without --reset-attention-mask."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.studies.delayed_reference import parse_reference_args, run_delayed

    low, _ = corpora
    created = not dist.is_initialized()
    losses = {}
    try:
        for extra in ([], ["--reset-attention-mask"]):
            argv = flags("--data-path", low, "--data-cache-path", str(tmp_path / "cache"),
                         "--eval-iters", "0", "--transformer-impl", "local", *extra)  # fmt: skip
            losses[bool(extra)] = run_delayed(parse_reference_args(argv), delay=0).losses
    finally:
        if created and dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    assert all(torch.isfinite(torch.tensor(losses[True])))
    assert losses[True][0] != losses[False][0]
