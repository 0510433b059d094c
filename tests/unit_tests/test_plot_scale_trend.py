"""tools/plot_scale_trend.py: the gap of each point paired by seed over the seeds both runs
finished, its table line, and the figure; a point not measured yet is named and left out."""

import json
import os

import pytest
import tool_scripts


@pytest.fixture(scope="module")
def tool():
    return tool_scripts.load("plot_scale_trend")


def write_run(output, name, seed, final):
    directory = os.path.join(output, f"{name}-seed{seed}")
    os.makedirs(directory)
    validation = [{"iteration": 50, "lm loss": 5.0, "tokens": 1}, {"iteration": 100,
                  "lm loss": final, "tokens": 2}]  # fmt: skip
    with open(os.path.join(directory, "summary.json"), "w") as file:
        json.dump({"validation": validation, "args": []}, file)


def test_gaps_are_paired_by_seed_and_a_missing_point_is_named(tool, tmp_path, capsys):
    output = str(tmp_path / "runs")
    for seed, flush, paci in ((1, 4.0, 3.96), (2, 5.0, 5.1), (3, 4.0, 3.8)):
        write_run(output, "flush", seed, flush)
        write_run(output, "paci", seed, paci)
    write_run(output, "paci8", 1, 4.4)  # seed 1 only: one seed in common with flush
    png = str(tmp_path / "trend.png")
    assert tool.main([
        "--png", png,
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


def test_a_malformed_point_is_one_line(tool):
    from megatron.common.errors import UserError

    with pytest.raises(UserError, match="expected OPTIMIZER.MODEL.STAGES"):
        tool.parse_point("AdamW|small|four|runs|flush|paci")
