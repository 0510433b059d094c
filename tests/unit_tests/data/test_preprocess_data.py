import json
import os
import subprocess
import sys

import numpy
import pytest
from datatests_support import REPO_ROOT, tiny_documents

from megatron.common.errors import UserError
from megatron.training.data import preprocessing
from megatron.training.data.datasets import validate_indexed_dataset
from megatron.training.tokenizer.tokenizer import build_tokenizer

SCRIPT = os.path.join(REPO_ROOT, "tools", "preprocess_data.py")


def _run(args, cwd):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")


def test_end_to_end_with_workers(sp_model, tmp_path):
    """Two workers, two json keys, an empty document: .bin/.idx readable by megatron-core."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = tiny_documents()[:12]
    texts[5] = ""
    records = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(texts)]
    _write_jsonl(tmp_path / "in.jsonl", records)
    prefix = str(tmp_path / "out" / "tiny")
    os.makedirs(tmp_path / "out")
    args = ["--input", "in.jsonl", "--output-prefix", prefix, "--json-keys", "text", "title"]
    args += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model]
    args += ["--append-eod", "--workers", "2", "--log-interval", "4"]
    result = _run(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Processed 8 documents (" in result.stderr and "MB/s)." in result.stderr
    assert "11 documents" in result.stdout and "1 empty skipped" in result.stdout
    assert sorted(os.listdir(tmp_path / "out")) == [
        "tiny_text_document.bin",
        "tiny_text_document.idx",
        "tiny_text_document.stats.json",
        "tiny_title_document.bin",
        "tiny_title_document.idx",
        "tiny_title_document.stats.json",
    ]

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    for key in ("text", "title"):
        validate_indexed_dataset(f"{prefix}_{key}_document")
        dataset = IndexedDataset(f"{prefix}_{key}_document")
        expected = [tok.tokenize(r[key]) + [tok.eod] for r in records if r[key]]
        assert len(dataset) == len(expected)
        assert dataset.index.dtype == numpy.uint16
        for i, ids in enumerate(expected):
            assert dataset[i].tolist() == ids
        assert int(dataset.sequence_lengths.sum()) == sum(map(len, expected))


def test_cli_error_is_one_line(tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}])
    args = ["--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-type"]
    result = _run(args + ["SentencePieceTokenizer", "--tokenizer-model", "missing.model"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: --tokenizer-model file not found: missing.model\n"
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "1 2 3"}', "{not json"], "line 2 is not valid JSON"),
        (['{"text": "1 2 3"}', '{"body": "4"}'], "line 2 has no key 'text'"),
        (['{"text": "1 2 3"}', '{"text": "4 100"}'], "token id 100 outside the vocabulary"),
        (['{"text": "1 2 -3"}'], "token id -3 outside"),
        ([""], "has no documents"),
        (['{"text": 5}'], "line 1: 'text' is a JSON int, not a string"),
    ],
)
def test_bad_input_leaves_no_files(tmp_path, capsys, lines, message):
    _write_jsonl(tmp_path / "in.jsonl", lines)
    prefix = str(tmp_path / "out")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--append-eod"]
    assert preprocessing.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_null_tokenizer_and_atomic_overwrite(tmp_path, capsys):
    """A NullTokenizer run in process; a rerun replaces the files under the final names."""
    prefix = str(tmp_path / "ints")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", "--append-eod"]
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "5 6 7"}, {"text": "69999"}])
    assert preprocessing.main(argv) == 0
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    assert preprocessing.main(argv) == 0
    assert "1 documents, 3 tokens (int32)" in capsys.readouterr().out
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix + "_text_document")
    assert [d.tolist() for d in dataset] == [[1, 2, 70000]]
    assert sorted(os.listdir(tmp_path)) == [
        "in.jsonl",
        "ints_text_document.bin",
        "ints_text_document.idx",
        "ints_text_document.stats.json",
    ]
    assert json.load(open(prefix + "_text_document.stats.json")) == {
        "max_token_id": 70000,
        "vocab_size": 70001,
    }


def test_checked_document_rejects_bad_lengths():
    assert (
        preprocessing.checked_document([1, 2, 3], [3], 10, numpy.uint16, "doc").dtype
        == numpy.uint16
    )
    with pytest.raises(UserError, match="do not add up"):
        preprocessing.checked_document([1, 2, 3], [2], 10, numpy.uint16, "doc")
    with pytest.raises(UserError, match="do not add up"):
        preprocessing.checked_document([1, 2, 3], [3, 0], 10, numpy.uint16, "doc")


def test_null_text_is_skipped_not_the_word_none(tmp_path, capsys):
    """`{"text": null}` is a missing document (counted as skipped), not the text "None"."""
    prefix = str(tmp_path / "ints")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "5 6"}, {"text": None}, {"text": "7"}])
    assert preprocessing.main(argv) == 0
    assert "2 documents, 3 tokens, 1 empty skipped" in capsys.readouterr().out
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert [d.tolist() for d in IndexedDataset(prefix + "_text_document")] == [[5, 6], [7]]


def _null_argv(tmp_path, prefix, input_path=None):
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}])
    argv = ["--input", str(input_path or tmp_path / "in.jsonl"), "--output-prefix", str(prefix)]
    return argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_input_directory_is_named_as_a_directory(tmp_path, capsys):
    assert preprocessing.main(_null_argv(tmp_path, tmp_path / "out", input_path=tmp_path)) == 2
    err = _one_error_line(capsys)
    assert f"--input {tmp_path} is a directory, not a jsonl file" in err
    assert "not found" not in err


def test_output_prefix_under_a_regular_file(tmp_path, capsys):
    (tmp_path / "plain").write_text("")
    assert preprocessing.main(_null_argv(tmp_path, tmp_path / "plain" / "out")) == 2
    err = _one_error_line(capsys)
    assert f"{tmp_path / 'plain'} is a file, not a directory" in err


def test_output_prefix_in_a_read_only_directory(tmp_path, capsys):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("running as root: chmod 555 does not stop this process from writing")
        assert preprocessing.main(_null_argv(tmp_path, read_only / "out")) == 2
        err = _one_error_line(capsys)
        assert f"--output-prefix directory is not writable: {read_only}" in err
        assert os.listdir(read_only) == []
    finally:
        read_only.chmod(0o755)


def test_write_failure_is_one_line_naming_the_file(tmp_path, capsys):
    """An OSError while writing (here a directory where the .bin goes, which stops root too;
    a read-only file system fails the same way) names the file and leaves no temporary files."""
    prefix = tmp_path / "out"
    (tmp_path / "out_text_document.bin").mkdir()
    assert preprocessing.main(_null_argv(tmp_path, prefix)) == 2
    err = _one_error_line(capsys)
    assert f"cannot write {prefix}_text_document.bin (--output-prefix {prefix}): " in err
    assert "Is a directory" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin"]


def test_cli_write_failure_exit_code_and_no_traceback(tmp_path):
    (tmp_path / "plain").write_text("")
    _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}])
    args = ["--input", "in.jsonl", "--output-prefix", "plain/out"]
    result = _run(args + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.endswith(f"error: --output-prefix plain/out: {tmp_path / 'plain'} is a "
                                  "file, not a directory\n")  # fmt: skip
    assert "Traceback" not in result.stderr
