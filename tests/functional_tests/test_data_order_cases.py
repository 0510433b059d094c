"""`--dataloader-type cyclic` on real runs: Megatron's random order of the training samples.

With `--no-data-sharding` a global batch is the same run of one permutation whatever the
data-parallel size, so DP 2 x PP 2 under 1F1B-flush equals one process reading that order; and
the order is not the default one (the losses move).

    FUNCTIONAL_CASES=gpt_pp1_1f1b,gpt_pp1_1f1b_cyclic,gpt_dp2pp2_1f1b_cyclic \\
        pytest tests/functional_tests/test_data_order_cases.py
"""

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
