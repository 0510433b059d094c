"""User mistakes end with one line naming the problem, a non-zero exit and no traceback,
before any process group, model or dataset is built."""

import concurrent.futures
import os
import shutil
import subprocess
import sys

import numpy
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--pipeline-model-parallel-size", "4",
]  # fmt: skip


def with_flag(args: list[str], flag: str, value: str | None) -> list[str]:
    """Replace (or with value None, remove) a flag and its value."""
    args = list(args)
    if flag in args:
        index = args.index(flag)
        del args[index : index + (1 if args[index + 1].startswith("--") else 2)]
    return args + ([flag, value] if value is not None else [])


def run_pretrain(args: list[str], world_size: int = 4) -> subprocess.CompletedProcess:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"}
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def indexed_dataset(tmp_path_factory):
    """A small real .bin/.idx pair written by megatron-core's builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("data") / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for document in range(20):
        builder.add_item(torch.arange(50 + document, dtype=torch.int32) % 900)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def corrupt_copy(prefix: str, directory, name: str, mutate) -> str:
    target = str(directory / name)
    shutil.copy(prefix + ".bin", target + ".bin")
    data = bytearray(open(prefix + ".idx", "rb").read())
    open(target + ".idx", "wb").write(mutate(data))
    return target


def data_args(prefix: str) -> list[str]:
    return with_flag(GOOD, "--mock-data", None) + ["--data-path", prefix]


CASES = {
    "layers_not_divisible": (with_flag(GOOD, "--num-layers", "5"), 4, "--num-layers 5"),
    "global_batch": (with_flag(GOOD, "--global-batch-size", "7"), 4, "--global-batch-size 7"),
    "unknown_schedule": (GOOD + ["--pipeline-schedule", "zigzag"], 4, "'zigzag'"),
    "no_data": (with_flag(GOOD, "--mock-data", None), 4, "--data-path"),
    "missing_data_path": (
        with_flag(GOOD, "--mock-data", None) + ["--data-path", "/nonexistent/corpus"],
        4,
        "/nonexistent/corpus",
    ),
    "world_size": (GOOD, 6, "world size 6"),
    "save_uncreatable": (GOOD + ["--save", "/proc/x/ckpt"], 4, "--save /proc/x/ckpt: cannot"),
    # numeric ranges (most are checked in process: tests/unit_tests/test_validation.py)
    "heads_zero": (with_flag(GOOD, "--num-attention-heads", "0"), 4, "--num-attention-heads"),
    "lr_nan": (with_flag(GOOD, "--lr", "nan"), 4, "--lr must be a number >= 0, got nan"),
    # --enable-vocab-parallel: what it cannot take yet (a weight-stashing schedule keeps the
    # input embedding whole, so it cannot be tied to the split output layer), and a vocabulary
    # it cannot split (the
    # other refusals are checked in process: tests/unit_tests/training/test_vocab_parallel_flags.py)
    "vocab_split_schedule": (
        GOOD + ["--enable-vocab-parallel", "--pipeline-schedule", "2bw"],
        4,
        "--enable-vocab-parallel with tied embeddings and --pipeline-schedule 2bw is not "
        "supported yet",
    ),  # fmt: skip
    "vocab_split_uneven": (
        GOOD + ["--untie-embeddings-and-output-weights", "--enable-vocab-parallel",
                "--make-vocab-size-divisible-by", "3"],
        4,
        "the padded vocabulary of 1002 does not split evenly over 4 pipeline x tensor ranks",
    ),  # fmt: skip
    "uneven_split": (
        with_flag(GOOD, "--num-layers", "8") + ["--decoder-first-pipeline-num-layers", "3"],
        4,
        "does not split evenly",
    ),
}


def assert_clean_error(completed: subprocess.CompletedProcess, needle: str) -> None:
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr + completed.stdout
    lines = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, completed.stderr[-2000:]
    assert needle in lines[0]


@pytest.fixture(scope="module")
def bad_flag_outcomes():
    """name -> the finished process of each case, two at a time (each is one process that
    mostly imports, so two fill the two cores of a small machine)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = {name: pool.submit(run_pretrain, *CASES[name][:2]) for name in CASES}
        return {name: future.result() for name, future in started.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_flags(bad_flag_outcomes, name):
    assert_clean_error(bad_flag_outcomes[name], CASES[name][2])


def test_good_flags_pass_validation():
    """The same flags without the mistake get past validation (they would start training)."""
    from megatron.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(GOOD)
    validate_args(args, world_size=4)
    assert args.num_microbatches == 4 and args.data_parallel_size == 1


@pytest.mark.parametrize(
    "name, mutate",
    [
        ("truncated", lambda data: bytes(data[: len(data) // 2])),
        ("bad_magic", lambda data: b"NOTANIDX!" + bytes(data[9:])),
    ],
)
def test_corrupt_index(indexed_dataset, tmp_path, name, mutate):
    prefix = corrupt_copy(indexed_dataset, tmp_path, name, mutate)
    assert_clean_error(run_pretrain(data_args(prefix)), name)
