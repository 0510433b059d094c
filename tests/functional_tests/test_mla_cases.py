"""Multi-latent attention (--multi-latent-attention, DeepSeek's MLA with YaRN) on real
multi-process runs (gloo, torchrun): megatron-core's MLASelfAttention in the portable spec,
compressed queries, latent norms (--qk-layernorm).

Reference: the same model on one process. Under 1F1B-flush four pipeline stages, and two
tensor x two pipeline ranks with sequence parallelism (the latents gathered over the tensor
ranks), change no number beyond float tolerance; under PACI each stage's drift stays within
its bound and the loss falls, also with DeepSeek-style MoE layers at EP 2 x PP 2. YaRN for
the GPT model's own rotary embedding (--position-embedding-type yarn): two pipeline stages
equal one process."""

import pytest
import run_cases
from test_gpt_cases import assert_flush_equals, assert_paci_keeps_its_bound, drift_bound

REFERENCE = "gpt_mla_pp1_1f1b"


@pytest.mark.parametrize("name", ["gpt_mla_pp4_1f1b", "gpt_mla_tp2pp2_1f1b_sp"])
def test_flush_equals_one_process(case_results, name):
    assert_flush_equals(case_results[name], case_results[REFERENCE], iterations=4)


def test_paci_keeps_its_drift_bound(case_results):
    assert_paci_keeps_its_bound(case_results["gpt_mla_pp4_paci"], case_results[REFERENCE]["loss"])


def test_deepseek_style_moe_under_paci(case_results):
    """MLA with MoE layers after a dense first one (sigmoid routing, expert bias, a shared
    expert) at EP 2 x PP 2: every stage within PACI's drift bound, the loss falls."""
    summary = case_results["moe_mla_ep2pp2_paci"]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], n, a)
    assert summary["loss"][-1] < summary["loss"][0]


def test_yarn_on_two_stages_equals_one_process(case_results):
    losses = case_results["gpt_yarn_pp2_1f1b"]["loss"]
    expected = case_results["gpt_yarn_pp1_1f1b"]["loss"]
    assert len(losses) == 4 and run_cases.relative_difference(losses, expected) <= 1e-5
