import os
import shutil
import struct
import subprocess
import sys

import pytest
from datatests_support import REPO_ROOT

from megatron.common.errors import UserError
from megatron.training.data.datasets import (
    main,
    parse_data_path,
    parse_split,
    read_index_summary,
    validate_indexed_dataset,
)


@pytest.fixture
def dataset_copy(small_dataset, tmp_path):
    prefix, docs = small_dataset
    copy = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, copy + ext)
    return copy, docs


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_valid_dataset_summary(small_dataset):
    prefix, docs = small_dataset
    validate_indexed_dataset(prefix)
    summary = read_index_summary(prefix)
    assert (summary.documents, summary.sequences) == (len(docs), len(docs))
    assert summary.tokens == sum(map(len, docs))


@pytest.mark.parametrize("ext", [".idx", ".bin"])
def test_missing_file(dataset_copy, ext):
    prefix, _ = dataset_copy
    os.remove(prefix + ext)
    with pytest.raises(UserError, match=f"dataset file not found: .*copy\\{ext}"):
        validate_indexed_dataset(prefix)


@pytest.mark.parametrize("keep", [10, 100, -8])
def test_truncated_idx(dataset_copy, keep):
    prefix, _ = dataset_copy
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(keep if keep > 0 else os.path.getsize(prefix + ".idx") + keep)
    with pytest.raises(UserError, match="corrupt dataset index .*copy.idx"):
        validate_indexed_dataset(prefix)


@pytest.mark.parametrize(
    "offset, data, message",
    [
        (0, b"XXIDIDX\x00\x00", "bad magic"),
        (9, struct.pack("<Q", 2), "unsupported version 2"),
        (17, struct.pack("<B", 42), "unknown dtype code 42"),
        (18, struct.pack("<Q", 7), "bytes, but 7 sequences"),
        (34, struct.pack("<i", -5), "negative sequence length"),
        (34, struct.pack("<i", 3), "offsets do not match"),
        (34 + 120 * 4 + 8, struct.pack("<q", 1 << 40), "offsets do not match"),
        (34 + 120 * 12, struct.pack("<q", 3), "must run from 0 to 120"),
        (34 + 120 * 12 + 8 * 5, struct.pack("<q", 1), "not in order"),
    ],
)
def test_corrupt_idx(dataset_copy, offset, data, message):
    prefix, _ = dataset_copy
    _patch(prefix + ".idx", offset, data)
    with pytest.raises(UserError, match=message):
        validate_indexed_dataset(prefix)


def test_bin_size_mismatch(dataset_copy):
    prefix, _ = dataset_copy
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(UserError, match="copy.bin has .* bytes but .*copy.idx describes"):
        validate_indexed_dataset(prefix)


def test_cli_prints_one_error_line(dataset_copy, capsys):
    prefix, docs = dataset_copy
    assert main([prefix]) == 0
    assert f"ok, {len(docs)} documents" in capsys.readouterr().out
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(50)
    result = subprocess.run(
        [sys.executable, "-m", "megatron.training.data.datasets", prefix],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: corrupt dataset index ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "70", "b"]) == (["a", "b"], [0.3, 70.0])
    assert parse_data_path(["1", "a", "b"]) == (["1", "a", "b"], None)
    for bad in ([], ["0.5", "a", "b", "c"], ["1", "2", "1", "b"], ["-1", "a"], ["0", "a"]):
        with pytest.raises(UserError, match="--data-path"):
            parse_data_path(bad)


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("", "1,2,3,4", "a,b", "-1,2", "0,0,0", "1e3,1"):
        with pytest.raises(UserError, match="--split"):
            parse_split(bad)
