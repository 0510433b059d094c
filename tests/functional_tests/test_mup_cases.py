"""muP (--use-mup, width multiplier 4) on real multi-process runs: its initialization, the
logits' factor on the last stage and its per-parameter learning rates and epsilons do not
depend on the layout. Two pipeline stages under 1F1B-flush, and two data-parallel ranks with
the distributed optimizer (whose sharded groups must carry muP's settings), equal one process;
PACI trains within its drift bound."""

import pytest
import run_cases
from test_gpt_cases import drift_bound

REFERENCE = "gpt_mup_pp1_1f1b"


@pytest.mark.parametrize("name", ["gpt_mup_pp2_1f1b", "gpt_mup_dp2_distopt_1f1b"])
def test_equal_to_one_process(case_results, name):
    summary, reference = case_results[name], case_results[REFERENCE]
    assert len(summary["loss"]) == len(reference["loss"]) == 4
    assert run_cases.relative_difference(summary["loss"], reference["loss"]) <= 1e-5
    validation = [v["lm loss"] for v in summary["validation"]]
    expected = [v["lm loss"] for v in reference["validation"]]
    assert validation and run_cases.relative_difference(validation, expected) <= 1e-5


def test_paci_trains_within_its_bound(case_results):
    summary = case_results["gpt_mup_pp2_paci"]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    assert all(r["max_drift"] <= drift_bound(r["stage"], n, a) for r in summary["stages"])
    assert max(r["max_drift"] for r in summary["stages"]) >= 1
    assert summary["loss"][-1] < summary["loss"][0]
