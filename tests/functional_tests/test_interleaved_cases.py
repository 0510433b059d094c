"""Megatron's interleaved virtual pipeline on real 4-process runs (gloo, fp32, mock data).

References independent of the code under test: the one-process run of the same model (which
1F1B-flush over any placement of the layers equals within float tolerance), megatron-core's
own layer assignment with `vp_stage`, and the simulator's run of the same schedule definition
for the activations each rank holds.

Targeted run (the cases below and their references only):

    FUNCTIONAL_CASES=$(python -c "import test_interleaved_cases as t; print(','.join(t.NEEDED))")
"""

import pytest
import run_cases
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from run_cases import relative_difference

from megatron.model.build import transformer_config
from megatron.pipeline.schedules import paci_interleaved, virtual_schedule
from megatron.pipeline.simulation import simulate
from megatron.training.arguments import build_parser, validate_args
from megatron.training.config import RunConfig

FLUSH = {  # case -> its one-process reference
    "gpt_pp4vp2_1f1b": "gpt_pp1_8layers_1f1b",
    "gpt_tp2pp2vp2_1f1b": "gpt_pp1_1f1b",
    "gpt_tp2pp2vp2_1f1b_sp": "gpt_pp1_1f1b",  # sequence parallelism too
    "gpt_dp2pp2vp2_1f1b": "gpt_pp1_1f1b",
    # the embedding and the loss counted as layers: chunks of 0, 1 and 2 layers
    "gpt_dp2pp2vp2_1f1b_account": "gpt_pp1_tied_6layers_1f1b",
    # the embedding and output layer on their own LR schedule, sharded optimizer state
    "gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt": "gpt_pp1_1f1b_decoupled_lr",
}
SAVED, LOADED = "gpt_vpp_1_dp2pp2vp2_tied_save", "gpt_vpp_2_pp4_tied_load"
TIED_REFERENCE = "gpt_pp1_tied_1f1b"
PACI = "gpt_pp4vp2_paci"  # the GPT-2 BPE corpus, tied embeddings, the memory cap binds
PACI_CASES = [PACI, "gpt_tp2pp2vp2_paci"]  # the second: decisions shared over TP ranks
NEEDED = sorted({*FLUSH, *FLUSH.values(), SAVED, LOADED, TIED_REFERENCE, *PACI_CASES,
                 "gpt_pp1_1f1b", "gpt_dp2pp2_paci"})  # fmt: skip


def parsed(name: str, world_size: int = 4):
    args = build_parser().parse_args(
        run_cases.flags(run_cases.discover_cases()[name]["MODEL_ARGS"], "x")
    )
    validate_args(args, world_size=world_size, check_files=False)
    return args


@pytest.mark.parametrize("name", sorted(FLUSH))
def test_interleaved_flush_matches_one_process(case_results, name):
    reference = case_results[FLUSH[name]]["loss"]
    assert len(reference) == 8
    assert relative_difference(case_results[name]["loss"], reference) <= 1e-5


def test_decoupled_lr_changes_the_run(case_results):
    """The reference of the --decoupled-lr case is not the plain run: the flag changes the
    numbers (so the match above checks where each stage's groups take their LR)."""
    plain, decoupled = (
        case_results[n]["loss"] for n in ("gpt_pp1_1f1b", "gpt_pp1_1f1b_decoupled_lr")
    )
    assert plain[0] == decoupled[0]  # the first loss is before any step
    assert relative_difference(decoupled, plain) >= 1e-3


@pytest.mark.parametrize("name", sorted(FLUSH))
def test_each_chunk_builds_megatron_cores_layers(case_results, name):
    """Chunk c of rank r holds the layers megatron-core gives (pp_rank r, vp_stage c): its
    offset function and its count (with one layer per chunk, layer c * N + r)."""
    args = parsed(name)
    config = transformer_config(RunConfig.from_args(args), device=None)
    n, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    assert v == 2
    built = []
    for report in case_results[name]["stages"]:
        r = report["stage"]
        for c, layers in enumerate(report["chunk_layers"]):
            offset = get_transformer_layer_offset(config, vp_stage=c, pp_rank=r)
            assert layers == list(range(offset, offset + args.chunk_layers[r][c]))
            if args.num_layers == n * v:
                assert layers == [c * n + r]
            built += layers
    assert sorted(built) == list(range(args.num_layers))


@pytest.mark.parametrize("name", sorted(FLUSH))
def test_activations_held_are_the_simulated_schedules(case_results, name):
    """The runtime runs the simulator's definition: each rank's peak of microbatch-chunks in
    flight is the simulated one (Megatron's warm-up + 1 on rank 0)."""
    summary = case_results[name]
    args = parsed(name)
    n, v, m = (args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
               args.num_microbatches)  # fmt: skip
    simulated = simulate(virtual_schedule("1f1b"), num_stages=n, microbatches_per_step=m,
                         steps=2, chunks_per_rank=v, forward_cost=1.0, backward_cost=2.0,
                         record_timeline=False)  # fmt: skip
    peaks = simulated.to_dict()["virtual_stages"]["peak_activation_chunks_per_rank"]
    assert [r["peak_inflight_microbatches"] for r in summary["stages"]] == peaks
    assert peaks[0] == min(2 * (n - 1) + (v - 1) * n + 1, m * v)


def test_every_rank_steps_once_per_iteration_with_a_global_norm(case_results):
    for name in [*FLUSH, SAVED]:
        summary = case_results[name]
        assert all(r["optimizer_steps"] == summary["iterations"] for r in summary["stages"])
        assert summary["cross_stage_collectives"] > 0  # the gradient norm over all stages


def test_tied_embedding_over_chunks_and_a_checkpoint_to_the_plain_pipeline(case_results):
    """Tied embeddings on rank 0's first chunk and the last rank's last chunk, data parallel 2:
    the first 4 iterations equal the one-process tied run; the torch_dist checkpoint, loaded
    by the plain 4-stage pipeline, continues it within 1e-5 (weights and Adam's moments found
    under megatron-core's global keys), and both copies of the tied weight end equal."""
    reference = case_results[TIED_REFERENCE]["loss"]
    saved, loaded = case_results[SAVED], case_results[LOADED]
    assert relative_difference(saved["loss"], reference[:4]) <= 1e-5
    assert "> saved checkpoint at iteration 4" in saved["log"]
    assert loaded["iterations"] == 8 and len(loaded["loss"]) == 4
    assert relative_difference(loaded["loss"], reference[4:]) <= 1e-5
    ends = [loaded["stages"][0], loaded["stages"][-1]]
    assert ends[0]["tied_weight_sha256"] == ends[1]["tied_weight_sha256"]


@pytest.mark.parametrize("name", PACI_CASES)
def test_paci_over_virtual_stages_keeps_its_drift_bound_per_chunk(case_results, name):
    """Measured steps between each microbatch's forward and backward, per chunk, never exceed
    paci_interleaved.drift_bound; the early chunks of the first ranks do cross a step."""
    summary = case_results[name]
    args = parsed(name)
    n, v, a = args.pipeline_model_parallel_size, 2, args.num_microbatches
    assert summary["num_microbatches"] == a == 4 and args.virtual_pipeline_model_parallel_size == v
    for report in summary["stages"]:
        r = report["stage"]
        bounds = [paci_interleaved.drift_bound(r, c, n, a, v) for c in range(v)]
        assert all(d <= b for d, b in zip(report["chunk_max_drift"], bounds)), (r, bounds)
        assert report["max_drift"] <= max(bounds)
    assert summary["stages"][0]["chunk_max_drift"][0] >= 1  # asynchronous: it does drift
    assert summary["stages"][-1]["chunk_max_drift"][-1] == 0  # the last virtual stage never


@pytest.mark.parametrize("name", PACI_CASES)
def test_paci_over_virtual_stages_holds_at_most_interleaved_flushs_activations(case_results, name):
    """Per rank, the most microbatch-chunks in flight is at most interleaved 1F1B-flush's peak
    for the same command line (simulated: min(2(N - r - 1) + (v - 1) g + 1, m v))."""
    summary = case_results[name]
    n, v, m = summary["pipeline_stages"], 2, summary["num_microbatches"]
    flush = simulate(virtual_schedule("1f1b"), num_stages=n, microbatches_per_step=m, steps=2,
                     chunks_per_rank=v, forward_cost=1.0, backward_cost=2.0,
                     record_timeline=False).to_dict()["virtual_stages"]  # fmt: skip
    peaks = [r["peak_inflight_microbatches"] for r in summary["stages"]]
    assert all(p <= f for p, f in zip(peaks, flush["peak_activation_chunks_per_rank"]))
    assert peaks == [paci_interleaved.window(r, n, m, v) for r in range(n)]
    if n == 4:
        assert peaks[0] == m * v  # the cap binds on rank 0 (Megatron's warm-up would hold 11)


@pytest.mark.parametrize("name", PACI_CASES)
def test_paci_over_virtual_stages_steps_without_cross_stage_collectives(case_results, name):
    summary = case_results[name]
    assert summary["cross_stage_collectives"] == 0
    assert all(r["optimizer_steps"] == summary["iterations"] for r in summary["stages"])
    losses = summary["loss"]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert "validation loss at iteration 8" in summary["log"]


def test_paci_over_virtual_stages_ties_its_embedding_point_to_point(case_results):
    summary = case_results[PACI]
    # the tied embedding's two copies (rank 0's first chunk, rank 3's last) agree at the end
    assert summary["cross_stage_collectives"] == 0
    first, last = summary["stages"][0], summary["stages"][-1]
    assert first["tied_weight_sha256"] == last["tied_weight_sha256"]
    exchange = last["tied_embedding"]
    assert exchange["steps"] == 8 and exchange["max_lag"] <= exchange["lag_bound"]


@pytest.mark.parametrize("name", ["gpt_dp2pp2vp2_1f1b_decoupled_lr_distopt", "gpt_dp2pp2_paci"])
def test_replicas_weight_hashes_were_checked(case_results, name):
    """--check-weight-hash-across-dp-replicas-interval 4 over 8 iterations: each stage checked
    its two replicas at the start and after iterations 4 and 8 (a mismatch stops the run),
    under interleaved flush with the distributed optimizer and under PACI."""
    summary = case_results[name]
    assert summary["data_parallel"] == 2
    assert summary["weight_hash_checks_by_stage"] == [[0, 4, 8], [0, 4, 8]]
    assert ">>> Weight hashes match after 8 iterations... (stage 1 of 2, 2 data-parallel" in (
        summary["log"]
    )
