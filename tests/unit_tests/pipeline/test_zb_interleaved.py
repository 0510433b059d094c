"""The interleaved zero-bubble schedule (`schedules/zb_interleaved.py`): torch's own order, its
bubble and memory in the simulator against the other flushing schedules, and its flags.

Costs are per chunk pass; a schedule with one chunk per rank gets a whole stage's (2 chunks).
The executor's equality with one process is in test_rank_runtime.py (FLUSH_CASES); here, the
same with the output layer and the input embedding split over the ranks (--enable-vocab-parallel).
"""

from types import SimpleNamespace

import pytest
from small_run_flags import error_of, validated
from test_embedding_runtime import (
    test_virtual_stages_with_both_layers_split_train_as_one_process as trains_as_one_process,
)

from megatron.benchmarks import comparison
from megatron.benchmarks.runtime_comparison import RUNTIME_NAMES
from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.schedules import SCHEDULES, SIMULATED_SCHEDULES, zb_interleaved
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.simulation import simulate
from megatron.training.config import RunConfig

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD
SYNCHRONOUS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"]


def run(name, n, m, steps=1, t=1.0, chunks=None, **kw):
    """`name` at F = B = W = t per chunk (a one-chunk schedule: 2t per pass, its backward
    B + W in one pass where it does not split it)."""
    schedule = SIMULATED_SCHEDULES[name]
    cost = t if schedule.placement is not None else 2 * t
    split = schedule.splits_backward
    if schedule.placement is not None:
        kw["chunks_per_rank"] = chunks
    return simulate(schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                    forward_cost=cost, backward_cost=cost if split else 2 * cost,
                    weight_grad_cost=cost if split else 0.0, record_timeline=False,
                    **kw)  # fmt: skip


# ------------------------------------------------------------------ torch's order


def torch_order(n: int, m: int, v: int) -> dict[int, list[str]]:
    """Each rank's passes in torch's ScheduleInterleavedZeroBubble, its empty slots left out,
    named as our actions ("F3c1": forward of microbatch 3 on the rank's chunk 1)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    # the schedule only reads these of its stages to build the order (rank 0's view)
    stages = [SimpleNamespace(group_size=n, group_rank=0, num_stages=n * v, stage_index=c * n,
                              is_first=c == 0, is_last=c == v - 1, submod=None)
              for c in range(v)]  # fmt: skip
    schedule = ScheduleInterleavedZeroBubble(stages, m)
    kinds = {"F": "F", "I": "B", "W": "W"}  # torch's I: the input gradient, our B
    return {
        rank: [f"{kinds[a.computation_type.value]}{a.microbatch_index}c{a.stage_index // n}"
               for a in actions if a is not None]
        for rank, actions in schedule.pipeline_order.items()
    }  # fmt: skip


@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 2, 2), (4, 6, 2),
                                   (8, 8, 2), (8, 12, 2), (8, 16, 2), (4, 8, 3), (3, 9, 4)])  # fmt: skip
def test_each_ranks_order_is_torchs(n, m, v):
    ours = {r: [str(slot) for slot in zb_interleaved.rank_order(r, n, m, v)] for r in range(n)}
    assert ours == torch_order(n, m, v)


@pytest.mark.parametrize("n,m", [(4, 9), (4, 13), (8, 17)])
def test_microbatches_that_torch_refuses_are_refused(n, m):
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_order(n, m, 2)
    with pytest.raises(ValueError, match="equal rounds"):
        zb_interleaved.check_microbatches(n, 2, m)


# ------------------------------------------------------------------ the simulator


def test_at_8_ranks_and_8_microbatches_it_beats_every_synchronous_schedule():
    """N = 8, m = 8, F = B = W = 1 per chunk: a flushed step takes 55 (48 of work and the
    fill's 7), ZB-V 62, ZB-H1 62, interleaved 1F1B 69; DualPipeV needs m >= 2N."""
    ours = run("zb-interleaved", 8, 8).makespan
    assert ours == pytest.approx(55.0)
    others = {}
    for name in SYNCHRONOUS:
        try:
            others[name] = run(name, 8, 8).makespan
        except ValueError:  # a schedule not defined for m = 8 on 8 ranks
            continue
    assert others["zb-v"] == pytest.approx(62.0)
    assert others["interleaved-1f1b"] == pytest.approx(69.0)
    assert set(others) == set(SYNCHRONOUS) - {"dualpipe-v"}
    assert all(ours < makespan for makespan in others.values())
    half = run("zb-interleaved", 8, 8, t=0.5).makespan  # F = B = W = 1 per whole stage
    assert (half, run("zb-v", 8, 8, t=0.5).makespan) == pytest.approx((27.5, 31.0))


@pytest.mark.parametrize("n", [4, 8])
def test_a_flushed_step_is_shorter_than_zb_vs_below_3n_over_2_microbatches_then_equal(n):
    for m in range(1, 2 * n - 1):
        ours, zb_v = (run(name, n, m).makespan for name in ("zb-interleaved", "zb-v"))
        assert ours < zb_v if 2 * m < 3 * n else ours == pytest.approx(zb_v), m


@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (8, 32)])
def test_a_step_idles_only_the_fill_when_m_is_a_multiple_of_n(n, m):
    """F = B = W = t: (N - 1) t per rank and flushed step, and chained steps add as much each
    (the step does not fit into the next one, unlike ZB-V's)."""
    one = run("zb-interleaved", n, m)
    assert one.idle_per_step == pytest.approx([(n - 1) * 1.0] * n)
    four = run("zb-interleaved", n, m, steps=4)
    assert four.makespan == pytest.approx(4 * one.makespan)


@pytest.mark.parametrize("n,m,v", [(4, 8, 2), (4, 2, 2), (3, 4, 2), (4, 6, 3), (8, 8, 2)])
def test_every_microbatch_runs_f_b_and_w_once_per_chunk_after_its_inputs(n, m, v):
    steps, latency = 2, 0.25
    schedule = SIMULATED_SCHEDULES["zb-interleaved"]
    r = simulate(schedule, num_stages=n, microbatches_per_step=m, steps=steps, forward_cost=1.0,
                 backward_cost=1.5, weight_grad_cost=0.5, p2p_latency=latency, chunks_per_rank=v,
                 record_timeline=True)  # fmt: skip
    seen = {}
    for event in r.timeline:
        if event.action.kind in (F, B, W):
            key = (event.stage, event.action.kind, event.action.chunk, event.action.microbatch)
            assert key not in seen, f"{key} ran twice"
            seen[key] = (event.start_s, event.end_s)
    placement = schedule.placement(n, v)
    assert len(seen) == 3 * steps * m * placement.num_virtual_stages
    for stage in range(1, placement.num_virtual_stages):  # the activation crossed a rank
        rank, chunk = placement.locate(stage)
        up_rank, up_chunk = placement.locate(stage - 1)
        for mb in range(steps * m):
            arrived = seen[(up_rank, F, up_chunk, mb)][1] + latency
            assert seen[(rank, F, chunk, mb)][0] >= arrived - 1e-9
            assert seen[(rank, W, chunk, mb)][0] >= seen[(rank, B, chunk, mb)][1] - 1e-9
    assert r.optimizer_steps_per_stage == [steps] * n


@pytest.mark.parametrize("n,m", [(4, 4), (4, 8), (8, 8), (8, 16), (8, 4), (4, 2)])
def test_it_holds_at_most_what_zb_v_holds(n, m):
    ours, zb_v = run("zb-interleaved", n, m, steps=2), run("zb-v", n, m, steps=2)
    assert max(ours.peak_held_per_stage) <= max(zb_v.peak_held_per_stage)
    assert max(ours.peak_inflight_per_stage) <= max(zb_v.peak_inflight_per_stage)


@pytest.mark.parametrize("n,m,v", [(8, 12, 2), (4, 6, 2), (4, 8, 3), (8, 8, 2), (4, 3, 3)])
def test_peak_is_v_minus_1_rounds_plus_n_chunks(n, m, v):
    """min((v - 1) g + N, m v) microbatch-chunks on every rank, g the round: more than ZB-V's
    2N when g > N (m = 12 on 8 ranks)."""
    g = zb_interleaved.round_size(n, m)
    r = run("zb-interleaved", n, m, steps=2, chunks=v)
    assert max(r.peak_held_per_stage) == min((v - 1) * g + n, m * v)


def test_the_comparison_runs_it_and_at_m_8_it_passes_zb_v_on_both_models():
    assert ("zb-interleaved", 2) in comparison.SCHEDULES
    assert RUNTIME_NAMES["zb-interleaved"] == ("zb-interleaved", 2)
    for model in comparison.MODELS.values():
        ours, zb_v = (comparison.compare(model, name, 2, 8) for name in ("zb-interleaved", "zb-v"))
        assert ours.pace > zb_v.pace and ours.peak_activations == zb_v.peak_activations


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_with_the_vocabulary_split_it_trains_as_one_process(tied):
    trains_as_one_process("zb-interleaved", n=2, chunks=2, m=4, tied=tied)


# ------------------------------------------------------------------ the plan and the flags

PP2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-interleaved"]


def test_the_plan_takes_v_from_the_caller_default_2():
    plan = resolve_plan("zb-interleaved", num_stages=4)
    assert plan.placement.shape == "interleaved" and plan.chunks_per_rank == 2 and plan.flushes
    assert resolve_plan("zb-interleaved", num_stages=4, chunks_per_rank=3).chunks_per_rank == 3
    assert SCHEDULES["zb-interleaved"].splits_backward
    with pytest.raises(ValueError, match="at least 2 model chunks per rank, not 1"):
        resolve_plan("zb-interleaved", num_stages=4, chunks_per_rank=1)


@pytest.mark.parametrize("extra,chunks,layers", [
    (["--num-layers", "8"], 2, [[2, 2], [2, 2]]),
    (["--num-layers", "12", "--num-virtual-stages-per-pipeline-rank", "3"], 3, [[2, 2, 2]] * 2),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"], 4, [[1] * 4] * 2),
    (["--num-layers", "8", "--decoder-first-pipeline-num-layers", "2"], 2, [[1, 1], [3, 3]]),
])  # fmt: skip
def test_flags_give_the_chunks(extra, chunks, layers):
    args = validated(PP2 + extra, world_size=2)
    assert args.virtual_pipeline_model_parallel_size == chunks and args.chunk_layers == layers
    plan = RunConfig.from_args(args).pipeline.plan
    assert plan.schedule is SCHEDULES["zb-interleaved"] and plan.chunks_per_rank == chunks


@pytest.mark.parametrize("extra,world,message", [
    (["--pipeline-schedule", "zb-interleaved"], 1, "needs --pipeline-model-parallel-size >= 2"),
    (PP2 + ["--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "1"], 2,
     "at least 2 model chunks per pipeline rank, not the 1"),
    (PP2 + ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "4"], 2,
     "not the 1 that --num-layers-per-virtual-pipeline-stage gives"),
    (PP2 + ["--num-layers", "6"], 2, "not divisible by --pipeline-model-parallel-size 2 x 2"),
    (PP2 + ["--num-layers", "8", "--microbatch-group-size-per-virtual-pipeline-stage", "2"], 2,
     "--microbatch-group-size-per-virtual-pipeline-stage with --pipeline-schedule zb-inter"),
    (PP2 + ["--num-layers", "8", "--global-batch-size", "10"], 2, "2 equal rounds, got m = 5"),
    (PP2 + ["--num-layers", "8", "--rampup-batch-size", "4", "4", "16"], 2,
     "--rampup-batch-size with virtual pipeline stages is not supported yet"),
])  # fmt: skip
def test_unsupported_flags_are_one_line(extra, world, message):
    line = error_of(extra, world_size=world)
    assert message in line and "\n" not in line
