"""tools/delay_stability.py against closed forms: gradient descent without delay is stable to
a step of 2 and with a delay of tau steps to 2 sin(pi / (2 (2 tau + 1))); the momentum
0.9 to 2 (1 + beta) / (1 - beta); error feedback on fresh gradients (beta 0) to 2/3."""

import math

import pytest
import tool_scripts


@pytest.fixture(scope="module")
def tool():
    return tool_scripts.load("delay_stability")


@pytest.mark.parametrize("beta, delay, feedback, expected", [
    (0.0, 0.0, False, 2.0),
    (0.0, 1.0, False, 2 * math.sin(math.pi / 6)),
    (0.0, 2.0, False, 2 * math.sin(math.pi / 10)),
    (0.9, 0.0, False, 2 * 1.9 / 0.1),
    (0.5, 0.0, False, 2 * 1.5 / 0.5),
    (0.0, 0.0, True, 2 / 3),
])  # fmt: skip
def test_largest_stable_step_matches_the_closed_forms(tool, beta, delay, feedback, expected):
    assert tool.largest_stable_step(beta, delay, feedback) == pytest.approx(expected, rel=2e-3)


def test_a_mean_delay_between_steps_lies_between_their_bounds(tool):
    bounds = [tool.largest_stable_step(0.9, d, True) for d in (0.25, 0.5, 0.75, 1.0)]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] > 1.0


def test_the_table_names_each_stage_delay_and_flush(tool, capsys):
    assert tool.main(["--stages", "4", "--accumulation", "4", "--beta", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 (delay 0.75)" in out and "stage 3 (delay 0.00)" in out
    plain = next(line for line in out.splitlines() if line.startswith("| 0.9, PACI |"))
    cells = [float(cell) for cell in plain.strip("|").split("|")[1:]]
    assert cells[0] == pytest.approx(38.0, rel=2e-3) and cells[-1] == cells[0]  # fresh = flush


@pytest.mark.parametrize("argv, message", [(["--beta", "x"], "separated by commas"),
                                           (["--beta", "1.0"], "in \\[0, 1\\)"),
                                           (["--stages", "0"], ">= 1")])  # fmt: skip
def test_bad_input_is_named(tool, argv, message):
    with pytest.raises(tool.UserError, match=message):
        tool.main(argv)
