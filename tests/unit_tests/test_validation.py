"""Bad flags end in one `UserError` line naming the flag, checked in process (no launch)."""

import json
import os

import numpy
import pytest

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args

GOOD = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "20", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--pipeline-model-parallel-size", "4",
]  # fmt: skip


def with_flags(*pairs: str) -> list[str]:
    """GOOD with each `--flag value` pair replaced or added (value None: a switch)."""
    args = list(GOOD)
    for flag, value in zip(pairs[0::2], pairs[1::2]):
        if flag in args:
            index = args.index(flag)
            del args[index : index + 2]
        args += [flag] if value is None else [flag, value]
    return args


def validation_error(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    with pytest.raises(UserError) as caught:
        validate_args(args, world_size=4)
    message = str(caught.value)
    assert "\n" not in message
    return message


NOT_A_DIR = os.path.abspath(__file__)  # a file: nothing can be created below it
CASES = {
    "heads_zero": (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1"),
    "global_batch_zero": (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    "layers_zero": (["--num-layers", "0"], "--num-layers must be >= 1"),
    "layers_negative": (["--num-layers", "-4"], "--num-layers must be >= 1, got -4"),
    "hidden_negative": (["--hidden-size", "-64"], "--hidden-size must be >= 1"),
    "seq_zero": (["--seq-length", "0"], "--seq-length must be >= 1"),
    "micro_batch_zero": (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    "ffn_zero": (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1"),
    "max_pos_zero": (["--max-position-embeddings", "0"], "--max-position-embeddings must be"),
    "lr_negative": (["--lr", "-0.001"], "--lr must be a number >= 0"),
    "lr_nan": (["--lr", "nan"], "--lr must be a number >= 0, got nan"),
    "lr_inf": (["--lr", "inf"], "--lr must be a number >= 0, got inf"),
    "min_lr_above_lr": (["--min-lr", "1e-2"], "--min-lr 0.01 is above --lr 0.001"),
    "warmup_fraction_two": (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction must be"),
    "warmup_past_decay": (["--lr-warmup-iters", "20"], "20 warmup iterations leave no decay"),
    "warmup_both": (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"],
                    "mutually exclusive"),  # fmt: skip
    "decay_iters_zero": (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1"),
    "save_interval_zero": (["--save", "/tmp/x", "--save-interval", "0"], "--save-interval must"),
    "split_not_numbers_mock_data": (["--split", "abc"], "--split must be up to three non-negative"),
    "split_zero_sum_mock_data": (["--split", "0,0,0"], "--split weights must have a positive sum"),
    "save_interval_negative": (["--save", "/tmp/x", "--save-interval", "-5"], "got -5"),
    "clip_grad_negative": (["--clip-grad", "-1"], "--clip-grad must be a number >= 0"),
    "weight_decay_negative": (["--weight-decay", "-0.1"], "--weight-decay must be"),
    "beta1_one": (["--adam-beta1", "1.0"], "--adam-beta1 must be a number >= 0 and < 1"),
    "beta2_negative": (["--adam-beta2", "-0.5"], "--adam-beta2 must be"),
    "adam_eps_zero": (["--adam-eps", "0"], "--adam-eps must be a positive number"),
    "dropout_above_one": (["--hidden-dropout", "1.5"], "--hidden-dropout must be"),
    "attention_dropout_nan": (["--attention-dropout", "nan"], "--attention-dropout must be"),
    "init_std_negative": (["--init-method-std", "-0.02"], "--init-method-std must be"),
    "timeout_zero": (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    "eval_iters_negative": (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    "log_interval_zero": (["--log-interval", "0"], "--log-interval must be >= 1"),
    "vocab_size_zero": (["--vocab-size", "0"], "--vocab-size must be >= 1"),
    "divisible_by_zero": (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible"),
    "seed_negative": (["--seed", "-1"], "--seed must be >= 0"),
    "tensor_parallel_zero": (["--tensor-model-parallel-size", "0"], "must be >= 1"),
    "sequence_parallel_indivisible": (
        ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "1",
         "--sequence-parallel", None, "--seq-length", "30"],  # fmt: skip
        "--sequence-parallel: --seq-length 30 must be divisible by --tensor-model-parallel-size 4",
    ),
    "rendezvous_timeout_negative": (["--rendezvous-timeout-seconds", "-1"], "--rendezvous-"),
    "max_skips_zero": (["--max-consecutive-skips", "0"], "--max-consecutive-skips must be"),
    "save_under_a_file": (["--save", NOT_A_DIR + "/ckpt"], "is a file, not a directory"),
    "metrics_under_a_file": (["--metrics-dir", NOT_A_DIR + "/m"], "--metrics-dir"),
    "tensorboard_under_a_file": (["--tensorboard-dir", NOT_A_DIR + "/tb"], "--tensorboard-dir"),
    "timeline_is_a_dir": (["--timeline-file", os.path.dirname(NOT_A_DIR)], "is a directory"),
    "timeline_under_a_file": (["--timeline-file", NOT_A_DIR + "/t.json"], "--timeline-file"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_number_or_path_is_one_line(name):
    pairs, needle = CASES[name]
    assert needle in validation_error(with_flags(*pairs))


def test_negative_emulated_time_is_one_parse_error(capsys):
    """Per-stage emulated times are checked by the flag's type, so argparse reports them."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(with_flags("--emulated-forward-ms", "1,-1"))
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --emulated-forward-ms: values must be finite and >= 0, got '1,-1'" in error


def test_empty_validation_split_with_evaluation_asked_for():
    argv = with_flags("--data-path", "data/x", "--split", "100,0,0", "--eval-interval", "10")
    argv.remove("--mock-data")
    message = validation_error(argv)
    assert "--split 100,0,0 leaves no validation data" in message and "--eval-iters 0" in message


def test_gpu_flags_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the flags are valid here")
    message = validation_error(with_flags("--distributed-backend", "nccl"))
    assert "--distributed-backend nccl needs a CUDA GPU" in message


def test_unwritable_directory(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere: covered by the 'under a file' cases")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert "is not writable" in validation_error(with_flags("--save", str(locked / "ckpt")))


UNCREATABLE = "/proc/x"  # /proc takes no new directory, even from root


@pytest.mark.parametrize(
    "flag, value",
    [("--save", UNCREATABLE + "/ckpt"), ("--tensorboard-dir", UNCREATABLE + "/tb"),
     ("--metrics-dir", UNCREATABLE + "/metrics"), ("--data-cache-path", UNCREATABLE + "/cache"),
     ("--timeline-file", UNCREATABLE + "/trace.json"), ("--wandb-save-dir", UNCREATABLE + "/wb")],
)  # fmt: skip
def test_output_path_that_cannot_be_created_is_one_line(flag, value, capsys, monkeypatch):
    """pretrain_gpt.py stops at validation, before any process group, with one line."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    import pretrain_gpt

    extra = ("--wandb-project", "p", "--wandb-exp-name", "e") if flag == "--wandb-save-dir" else ()
    assert pretrain_gpt.main(with_flags(flag, value, *extra)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {flag} {value}: cannot create a directory in /proc")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err + captured.out
    assert not os.path.exists(UNCREATABLE)


def test_writer_lock_reports_an_uncreatable_directory_in_one_line():
    """The lock itself, should the directory become uncreatable after validation."""
    from megatron.training.checkpointing.writer_lock import WriterLock

    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    with pytest.raises(UserError, match=r"^--save /proc/x/ckpt: No such file or directory$"):
        WriterLock("/proc/x/ckpt", "run").acquire()


def test_good_flags_still_pass(tmp_path):
    args = build_parser().parse_args(
        with_flags("--save", str(tmp_path / "new" / "ckpt"), "--save-interval", "5",
                   "--clip-grad", "0", "--timeline-file", str(tmp_path / "t.json"))  # fmt: skip
    )
    validate_args(args, world_size=4)
    assert args.clip_grad == 0 and args.max_consecutive_skips == 10


# ---------------------------------------------------------------------------- data vs tokenizer
def _dataset(prefix: str, high: int) -> str:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for document in range(4):
        builder.add_item(torch.tensor([1, 2, high - document], dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_token_ids_past_the_vocabulary(tmp_path):
    from megatron.training.validation import check_token_ids

    prefix = _dataset(str(tmp_path / "d"), high=900)
    check_token_ids([prefix], vocab_size=901, padded_vocab_size=1024)  # fits: no error
    with pytest.raises(
        UserError, match=r"d.bin holds token id 900, but the tokenizer has only 500"
    ):
        check_token_ids([prefix], vocab_size=500, padded_vocab_size=512)


def test_recorded_vocabulary_of_another_tokenizer(tmp_path):
    from megatron.training.validation import STATS_SUFFIX, check_token_ids

    prefix = _dataset(str(tmp_path / "d"), high=900)
    json.dump({"max_token_id": 900, "vocab_size": 1000}, open(prefix + STATS_SUFFIX, "w"))
    check_token_ids([prefix], vocab_size=1000, padded_vocab_size=1024)
    with pytest.raises(UserError, match="tokenized with a 1000-token vocabulary.*has 8192"):
        check_token_ids([prefix], vocab_size=8192, padded_vocab_size=8192)


@pytest.mark.parametrize("below", ["", "/ckpt"])
def test_save_on_a_dangling_symlink_fails_at_start(tmp_path, below):
    """Not at the first save: the link is named with where it points."""
    link = tmp_path / "ckpt_link"
    link.symlink_to(tmp_path / "gone")
    message = validation_error(with_flags("--save", str(link) + below))
    assert message == (
        f"--save {link}{below}: {link} is a symbolic link to {tmp_path / 'gone'}, which does "
        "not exist"
    )
