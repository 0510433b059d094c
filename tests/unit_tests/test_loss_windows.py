"""tools/loss_windows.py: training losses paired by tokens (a run whose first iterations read two
batches each against one reading one), validation gaps paired by evaluation, clear errors."""

import json
import os

import pytest
import tool_scripts


@pytest.fixture(scope="module")
def tool():
    return tool_scripts.load("loss_windows")


def write_run(directory, losses, tokens, validation, final=None):
    os.makedirs(directory)
    evaluations = [{"iteration": 2 * (k + 1), "lm loss": v, "tokens": 0}
                   for k, v in enumerate(validation)]  # fmt: skip
    with open(os.path.join(directory, "summary.json"), "w") as file:
        json.dump({"loss": losses, "tokens": tokens, "validation": evaluations,
                   "final_validation": final}, file)  # fmt: skip
    return str(directory)


@pytest.fixture
def runs(tmp_path):
    # the reference reads 100 tokens an iteration, loss 10 - i at iteration i (0-based)
    reference = write_run(tmp_path / "flush", [10.0 - i for i in range(8)],
                          [100 * (i + 1) for i in range(8)], [4.0, 2.0], final=2.0)  # fmt: skip
    # the other reads two batches in its first 2 iterations, then one: its iteration i >= 2
    # reads the reference's batch i + 2; its loss there is the reference's at i + 2, times 1.1
    other_tokens = [200, 400] + [100 * (i + 3) for i in range(2, 6)]
    other_losses = [9.0, 7.0] + [1.1 * (10.0 - (i + 2)) for i in range(2, 6)]
    other = write_run(tmp_path / "paci", other_losses, other_tokens, [3.0, 2.5, 9.9], final=2.1)
    return reference, other


def test_training_losses_are_paired_by_tokens(tool, runs):
    reference, other = map(tool.read_run, runs)
    gaps = tool.training_gaps(reference, other, [0, 4, 8])
    # iterations 0-3 of the reference (tokens 0-400): losses 10, 9, 8, 7, mean 8.5; the other's
    # iterations ending there: its first two (9 and 7), mean 8
    assert gaps[0][:2] == (0, 4) and gaps[0][2] == pytest.approx(100 * (8.0 / 8.5 - 1))
    # iterations 4-7 (tokens 401-800): the same batches, 10% higher
    assert gaps[1][:2] == (4, 8) and gaps[1][2] == pytest.approx(10.0)


def test_a_window_the_other_run_does_not_read_to_its_end_has_no_gap(tool, runs, tmp_path):
    reference = tool.read_run(runs[0])
    short = tool.read_run(write_run(tmp_path / "short", [9.0, 8.0, 7.0], [200, 400, 500], [3.0]))
    gaps = [gap for _, _, gap in tool.training_gaps(reference, short, [0, 2, 6])]
    assert gaps[0] is not None and gaps[1] is None  # it stopped at 500 of tokens (200, 600]


def test_a_run_not_finished_is_read_from_its_checkpoint(tool, runs, tmp_path):
    import torch

    directory = tmp_path / "screen"
    os.makedirs(directory)
    result = {"losses": [9.0, 7.0], "tokens": [200, 400], "validation": [],
              "final_validation": None, "phases": []}  # fmt: skip
    torch.save({"iteration": 2, "result": result}, directory / "checkpoint.pt")
    screen = tool.read_run(str(directory))
    assert (screen["loss"], screen["tokens"]) == ([9.0, 7.0], [200, 400])
    reference = tool.read_run(runs[0])
    assert tool.training_gaps(reference, screen, [0, 4])[0][2] == pytest.approx(100 * (8 / 8.5 - 1))


def test_validation_gaps_pair_evaluations_by_index_in_groups(tool, runs):
    reference, other = map(tool.read_run, runs)
    # two evaluations both runs made: -25% and +25%; the other's third has no partner
    assert tool.validation_gaps(reference, other, 1) == [(1, 1, -25.0), (2, 2, 25.0)]
    assert tool.validation_gaps(reference, other, 10) == [(1, 2, 0.0)]


def test_the_command_prints_each_window_and_the_final_evaluations(tool, runs, capsys):
    assert tool.main([*runs, "--windows", "0,4,8", "--group", "2"]) == 0
    out = capsys.readouterr().out
    assert "iterations 4-8: +10.00" in out and "evaluations 1-2: +0.00" in out
    assert "final evaluation: 2.1000 against 2.0000, +5.00%" in out


@pytest.mark.parametrize("windows, message", [("0,9", "within the reference's 8 iterations"),
                                              ("4,2", "must rise"), ("a,b", "separated by commas")])  # fmt: skip
def test_bad_windows_are_named(tool, runs, windows, message):
    with pytest.raises(tool.UserError, match=message):
        tool.main([*runs, "--windows", windows])


def test_a_run_without_tokens_is_named(tool, runs, tmp_path):
    directory = tmp_path / "old"
    os.makedirs(directory)
    (directory / "summary.json").write_text(json.dumps({"loss": [1.0], "validation": []}))
    with pytest.raises(tool.UserError, match="no tokens per iteration"):
        tool.main([runs[0], str(directory)])
    with pytest.raises(tool.UserError, match="cannot read the run's summary"):
        tool.main([runs[0], str(tmp_path / "missing")])
