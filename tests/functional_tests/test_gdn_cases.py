"""Gated DeltaNet hybrid attention (--experimental-attention-variant gated_delta_net) on real
multi-process runs (gloo, torchrun): megatron-core's GatedDeltaNet in the portable spec on our
portable chunked gated delta rule, GDN in layers 0 and 2 and gated softmax attention
(--attention-output-gate) in 1 and 3, two key heads for four value heads, 80 tokens (two
chunks), --swiglu, --qk-layernorm with --apply-wd-to-qk-layernorm.

Reference: the same model on one process. Under 1F1B-flush two pipeline stages, two tensor
ranks, and two tensor x two pipeline ranks with sequence parallelism (as Megatron's GDN test
lines; GDN heads, convolution channels and the swiglu halves split over the tensor ranks, the
output norm's gradients summed over them) change no number beyond float tolerance; under PACI on four stages each stage's drift stays within its
bound and the loss falls."""

import pytest
import run_cases
from test_gpt_cases import assert_flush_equals, assert_paci_keeps_its_bound

REFERENCE = "gpt_gdn_pp1_1f1b"


@pytest.mark.parametrize("name", ["gpt_gdn_pp2_1f1b", "gpt_gdn_tp2_1f1b", "gpt_gdn_tp2pp2_1f1b_sp"])
def test_flush_equals_one_process(case_results, name):
    assert_flush_equals(case_results[name], case_results[REFERENCE], iterations=4)


def test_reference_learns(case_results):
    losses = case_results[REFERENCE]["loss"]
    assert losses[-1] < losses[0]


def test_paci_keeps_its_drift_bound(case_results):
    assert_paci_keeps_its_bound(case_results["gpt_gdn_pp4_paci"], case_results[REFERENCE]["loss"])


def test_megatrons_gdn_line_shape_at_tp2_equals_one_process(case_results):
    """GDN with MoE layers, zero-centered norms and partial RoPE at TP 2 with sequence
    parallelism (Megatron's gpt3_mcore_te_tp2_pp1_gdn lines, shrunk)."""
    losses = case_results["gpt_gdn_moe_tp2_1f1b_sp"]["loss"]
    expected = case_results["gpt_gdn_moe_pp1_1f1b"]["loss"]
    assert len(losses) == 4 and run_cases.relative_difference(losses, expected) <= 1e-5
    assert losses[-1] < losses[0]
