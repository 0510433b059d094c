"""tools/plot_scale_trend.py: the gap of each point paired by seed over the seeds both runs
finished, its table line, and the figure; a point not measured yet is named and left out; the
measured points are kept in the data file, from which the figure is redrawn."""

import json
import os

import pytest
import tool_scripts


@pytest.fixture(scope="module")
def tool():
    return tool_scripts.load("plot_scale_trend")


def write_run(output, name, seed, final, final_evaluation=None, evaluations=2):
    """A finished run: `evaluations` periodic evaluations, the last at `final`, and a final
    evaluation when given."""
    directory = os.path.join(output, f"{name}-seed{seed}")
    os.makedirs(directory)
    validation = [{"iteration": 50 * k, "lm loss": 5.0, "tokens": k} for k in range(1, evaluations)]
    validation.append({"iteration": 50 * evaluations, "lm loss": final, "tokens": evaluations})
    with open(os.path.join(directory, "summary.json"), "w") as file:
        json.dump({"validation": validation, "args": [], "final_validation": final_evaluation},
                  file)  # fmt: skip


def test_gaps_are_paired_by_seed_and_a_missing_point_is_named(tool, tmp_path, capsys):
    output = str(tmp_path / "runs")
    for seed, flush, paci in ((1, 4.0, 3.96), (2, 5.0, 5.1), (3, 4.0, 3.8)):
        write_run(output, "flush", seed, flush)
        write_run(output, "paci", seed, paci)
    write_run(output, "paci8", 1, 4.4)  # seed 1 only: one seed in common with flush
    png, data = str(tmp_path / "trend.png"), str(tmp_path / "trend.json")
    assert tool.main([
        "--png", png, "--data", data,
        "--point", f"AdamW|small|4|{output}|flush|paci",
        "--point", f"AdamW|deep-8x|8|{output}|flush|paci8",
        "--point", f"Muon|small-4x|4|{output}|flush|absent",
    ]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    lines = out.splitlines()
    # seed gaps -1%, +2%, -5%: median -1%
    assert lines[2] == "| AdamW | small | 0.33M | 4 | -1.00% [-5.00, +2.00] | 3 |"
    assert lines[3] == "| AdamW | deep-8x | 2.66M | 8 | +10.00% [+10.00, +10.00] | 1 |"
    assert len(lines) == 4
    assert "not measured yet: absent against flush" in err
    assert os.path.getsize(png) > 10_000
    with open(data) as file:
        recorded = json.load(file)["points"]
    assert [(p["model"], p["stages"]) for p in recorded] == [
        ("small", 4), ("deep-8x", 8), ("small-4x", 4)]  # fmt: skip
    assert recorded[1]["paci"] == {"run": "paci8", "final": {"1": 4.4},
                                   "evaluation": {"1": "last of 2"}}  # fmt: skip
    assert recorded[2]["paci"] == {"run": "absent", "final": {}, "evaluation": {}}


def test_the_figure_is_redrawn_from_the_data_file_and_a_point_is_replaced(tool, tmp_path, capsys):
    """Without the runs the recorded points still draw; a new measurement of the same optimizer,
    model and stages replaces the old one, the others stay."""
    output, data = str(tmp_path / "runs"), str(tmp_path / "trend.json")
    write_run(output, "flush", 1, 4.0)
    write_run(output, "paci", 1, 3.6)
    write_run(output, "paci-muon", 1, 4.2)
    png = str(tmp_path / "trend.png")
    tool.main(["--png", png, "--data", data, "--point", f"AdamW|small|4|{output}|flush|paci",
               "--point", f"Muon|small|4|{output}|flush|paci-muon"])  # fmt: skip
    capsys.readouterr()
    write_run(output, "paci-better", 1, 3.8)
    tool.main(
        ["--png", png, "--data", data, "--point", f"AdamW|small|4|{output}|flush|paci-better"]
    )
    capsys.readouterr()
    os.rename(output, output + ".gone")
    assert tool.main(["--png", png, "--data", data]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["| AdamW | small | 0.33M | 4 | -5.00% [-5.00, -5.00] | 1 |",
                         "| Muon | small | 0.33M | 4 | +5.00% [+5.00, +5.00] | 1 |"]  # fmt: skip


def test_one_schedule_recorded_now_and_the_other_later_make_the_point(tool, tmp_path, capsys):
    """Flush's runs recorded in one study, PACI's in a later one whose output lacks flush's:
    the point pairs them; a PACI run of another name replaces the old PACI side."""
    data, png = str(tmp_path / "trend.json"), str(tmp_path / "trend.png")
    first, later = str(tmp_path / "first"), str(tmp_path / "later")
    write_run(first, "flush", 1, 4.0)
    write_run(first, "flush", 2, 5.0)
    write_run(later, "paci4", 1, 4.2)
    write_run(later, "paci4", 2, 4.5)
    write_run(later, "paci4-other", 1, 3.0)
    tool.main(["--png", png, "--data", data, "--point", f"AdamW|deep-8x|4|{first}|flush|paci4"])
    assert "not measured yet: paci4 against flush" in capsys.readouterr().err
    tool.main(["--png", png, "--data", data, "--point", f"AdamW|deep-8x|4|{later}|flush|paci4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["| AdamW | deep-8x | 2.66M | 4 | -2.50% [-10.00, +5.00] | 2 |"]
    tool.main(["--png", png, "--data", data,
               "--point", f"AdamW|deep-8x|4|{later}|flush|paci4-other"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["| AdamW | deep-8x | 2.66M | 4 | -25.00% [-25.00, -25.00] | 1 |"]


def test_only_losses_of_the_same_validation_batches_are_paired(tool, tmp_path, capsys):
    """A seed pairs where both runs give the final evaluation, or both the last of as many
    periodic evaluations; a run that evaluated less often (PACI with an accumulation schedule)
    against flush read other batches, and one with a final evaluation against one without."""
    output, data = str(tmp_path / "runs"), str(tmp_path / "trend.json")
    write_run(output, "flush", 1, 4.0, final_evaluation=4.1)
    write_run(output, "paci", 1, 3.9, final_evaluation=4.0)  # paired on the final evaluations
    write_run(output, "flush", 2, 4.0, evaluations=40)
    write_run(output, "paci", 2, 3.0, evaluations=36)  # other batches: not paired
    write_run(output, "flush", 3, 4.0, final_evaluation=4.4)
    write_run(output, "paci", 3, 3.0)  # no final evaluation: not paired
    write_run(output, "flush-muon", 1, 4.0, evaluations=40)
    write_run(output, "paci-muon", 1, 4.2, evaluations=40)  # the same 40 evaluations: paired
    tool.main(["--png", str(tmp_path / "trend.png"), "--data", data,
               "--point", f"AdamW|small|4|{output}|flush|paci",
               "--point", f"Muon|small|4|{output}|flush-muon|paci-muon"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    gap = 100 * (4.0 / 4.1 - 1)
    assert lines[2:] == [f"| AdamW | small | 0.33M | 4 | {gap:+.2f}% [{gap:+.2f}, {gap:+.2f}] | 1 |",
                         "| Muon | small | 0.33M | 4 | +5.00% [+5.00, +5.00] | 1 |"]  # fmt: skip


def test_a_data_file_of_something_else_is_one_line(tool, tmp_path):
    from megatron.common.errors import UserError

    data = tmp_path / "trend.json"
    data.write_text('{"runs": []}')
    with pytest.raises(UserError, match="not a scale-trend data file"):
        tool.read_points(str(data))


def test_a_malformed_point_is_one_line(tool):
    from megatron.common.errors import UserError

    with pytest.raises(UserError, match="expected OPTIMIZER.MODEL.STAGES"):
        tool.parse_point("AdamW|small|four|runs|flush|paci")
