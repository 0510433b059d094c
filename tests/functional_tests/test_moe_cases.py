"""Mixture of experts under 1F1B-flush on real multi-process runs: megatron-core's MoE layer
(4 experts, top-2, aux loss) with expert parallelism, tensor + sequence parallelism and the
distributed optimizer, each against the one-process run of the same model.

SGD rather than Adam: Adam is blind to a constant factor on a gradient, SGD is not, so a
wrong expert-gradient reduction shows in the losses (dividing the experts' gradients by the
data-parallel size left out moves the EP=2 x PP=2 losses by 1e-3 relative; measured).

    FUNCTIONAL_CASES=moe_pp1_1f1b,moe_ep2pp2_1f1b,moe_tp2ep2_sp_1f1b,moe_dp2pp2_1f1b_distopt \
        pytest tests/functional_tests/test_moe_cases.py
"""

import pytest
from run_cases import relative_difference

REFERENCE = "moe_pp1_1f1b"
LAYOUTS = {  # case -> (pipeline stages, tensor parallel, data parallel)
    "moe_ep2pp2_1f1b": (2, 1, 2),  # EP=2 inside each stage's data-parallel pair
    "moe_tp2ep2_sp_1f1b": (1, 2, 2),  # TP=2 + SP, EP=2 with ETP=1 (allgather dispatcher)
    "moe_dp2pp2_1f1b_distopt": (2, 1, 2),  # --use-distributed-optimizer, EP=1
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_flush_equals_the_one_process_run(case_results, name):
    summary, reference = case_results[name], case_results[REFERENCE]
    layout = (summary["pipeline_stages"], summary["tensor_parallel"], summary["data_parallel"])
    assert layout == LAYOUTS[name]
    assert len(summary["loss"]) == len(reference["loss"]) == 6
    assert relative_difference(summary["loss"], reference["loss"]) <= 1e-5


def test_the_moe_model_trains(case_results):
    """The reference itself learns (the comparison is not between two frozen runs)."""
    losses = case_results[REFERENCE]["loss"]
    assert losses[-1] < losses[0] - 0.05
