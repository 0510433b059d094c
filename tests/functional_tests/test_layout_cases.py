"""Megatron's layout flags on real 4-process runs: --account-for-embedding-in-pipeline-split,
--account-for-loss-in-pipeline-split and --pipeline-model-parallel-layout.

References: megatron-core's own layer assignment (`get_num_layers_to_build`, the layout's
counts, `get_transformer_layer_offset`), which every stage's built layers must equal; the
one-process run of the same model, which 1F1B-flush on any layer split equals within float
tolerance; PACI's drift bound; a torch_dist checkpoint of one split resumed on another.
"""

import pytest
import run_cases
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from run_cases import relative_difference
from test_gpt_cases import drift_bound

from megatron.training.arguments import build_parser
from megatron.training.layout_flags import layers_by_stage, layout_config

CASES = {  # case -> (one-process reference, layers per stage)
    "gpt_pp4_1f1b_account_embedding": ("gpt_pp1_tied_7layers_1f1b", [1, 2, 2, 2]),
    "gpt_pp4_paci_account_embedding": ("gpt_pp1_tied_7layers_1f1b", [1, 2, 2, 2]),
    "gpt_pp4_1f1b_account_loss": ("gpt_pp1_tied_7layers_1f1b", [2, 2, 2, 1]),
    "gpt_pp4_paci_account_loss": ("gpt_pp1_tied_7layers_1f1b", [2, 2, 2, 1]),
    "gpt_pp4_1f1b_layout": ("gpt_pp1_tied_6layers_1f1b", [0, 3, 3, 0]),
    "gpt_pp4_paci_layout": ("gpt_pp1_tied_6layers_1f1b", [0, 3, 3, 0]),
}


def megatron_core_assignment(name: str) -> tuple[list[int], list[int]]:
    """(layers, first layer) per stage, from megatron-core's functions on the case's flags."""
    args = build_parser().parse_args(
        run_cases.flags(run_cases.discover_cases()[name]["MODEL_ARGS"], "x")
    )
    config = layout_config(args)
    stages = range(args.pipeline_model_parallel_size)
    layout = config.pipeline_model_parallel_layout
    if layout is not None:  # (its offset function reads the rank from parallel_state)
        offsets = [layout.get_layer_offset(LayerType.decoder, pp_rank=s) for s in stages]
    else:
        offsets = [get_transformer_layer_offset(config, pp_rank=s) for s in stages]
    return layers_by_stage(args), offsets


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_stage_builds_megatron_cores_layers(case_results, name):
    layers, offsets = megatron_core_assignment(name)
    assert layers == CASES[name][1]
    stages = case_results[name]["stages"]
    assert [s["layers"] for s in stages] == layers
    assert [s["first_layer"] for s in stages if s["layers"]] == [
        offset for offset, n in zip(offsets, layers) if n
    ]


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if "_1f1b_" in n])
def test_flush_on_each_split_equals_one_process(case_results, name):
    reference = case_results[CASES[name][0]]["loss"]
    assert relative_difference(case_results[name]["loss"], reference) <= 1e-5


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if "_paci_" in n])
def test_paci_on_each_split_keeps_its_bounds(case_results, name):
    summary = case_results[name]
    n, a = summary["pipeline_stages"], summary["num_microbatches"]
    for report in summary["stages"]:
        assert report["max_drift"] <= drift_bound(report["stage"], n, a)
    first, last = summary["stages"][0], summary["stages"][-1]
    assert first["tied_weight_sha256"] == last["tied_weight_sha256"]
    assert summary["cross_stage_collectives"] == 0
    flush = case_results[name.replace("_paci_", "_1f1b_")]["loss"]
    assert summary["loss"][0] == flush[0] and relative_difference(summary["loss"], flush) <= 0.01


def test_a_layout_checkpoint_reshards_onto_an_even_split(case_results):
    """Saved with E|ttt|ttt|L on 4 stages, resumed on PP=2 x DP=2 (3 + 3 layers): the rest of
    the run equals the one-process run."""
    saved = case_results["gpt_layout_1_pp4_1f1b_save"]
    reference = case_results["gpt_pp1_tied_6layers_1f1b"]["loss"]
    assert relative_difference(saved["loss"], reference[:4]) <= 1e-5
    resumed = case_results["gpt_layout_2_pp2_1f1b_load"]
    assert [s["layers"] for s in resumed["stages"]] == [3, 3]
    assert relative_difference(resumed["loss"], reference[4:]) <= 1e-5
    assert "another layout" in resumed["log"]
