"""How runs read their data: `--dataloader-type cyclic` (Megatron's random order of the
samples) and evaluation's own batch (`--eval-global-batch-size`, `--eval-micro-batch-size`).

With `--no-data-sharding` a global batch is the same run of one permutation whatever the
data-parallel size, so DP 2 x PP 2 under 1F1B-flush equals one process reading that order; and
the order is not the default one (the losses move).

    FUNCTIONAL_CASES=gpt_pp1_1f1b,gpt_pp1_1f1b_cyclic,gpt_dp2pp2_1f1b_cyclic,gpt_dp2pp2_1f1b,\\
gpt_dp2pp2_paci,gpt_dp2pp2_1f1b_evalbatch,gpt_dp2pp2_paci_evalbatch \\
        pytest tests/functional_tests/test_data_order_cases.py
"""

import pytest
from run_cases import relative_difference


def test_cyclic_order_without_sharding_does_not_depend_on_the_layout(case_results):
    one = case_results["gpt_pp1_1f1b_cyclic"]
    split = case_results["gpt_dp2pp2_1f1b_cyclic"]
    assert (split["pipeline_stages"], split["data_parallel"]) == (2, 2)
    assert len(one["loss"]) == len(split["loss"]) >= 6
    assert relative_difference(split["loss"], one["loss"]) <= 1e-5


def test_cyclic_order_is_not_the_single_pass_order(case_results):
    cyclic, single = (
        case_results["gpt_pp1_1f1b_cyclic"]["loss"],
        case_results["gpt_pp1_1f1b"]["loss"],
    )
    assert cyclic[0] != single[0]  # another first global batch
    assert relative_difference(cyclic, single[: len(cyclic)]) > 1e-3
    assert cyclic[-1] < cyclic[0]  # and the model learns from it


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_one_evaluation_iteration_of_16_equals_two_of_8(case_results, schedule):
    """--eval-global-batch-size 16 --eval-micro-batch-size 4 --eval-iters 1 reads the samples of
    two iterations of 8 (the default batch), in microbatches of another size through the
    pipeline: the same validation loss; training untouched."""
    base = case_results[f"gpt_dp2pp2_{schedule}"]
    evaluated = case_results[f"gpt_dp2pp2_{schedule}_evalbatch"]
    assert evaluated["loss"] == base["loss"]
    mine = [v["lm loss"] for v in evaluated["validation"]]
    expected = [v["lm loss"] for v in base["validation"]]
    assert len(mine) == len(expected) >= 2
    assert relative_difference(mine, expected) <= 1e-6
