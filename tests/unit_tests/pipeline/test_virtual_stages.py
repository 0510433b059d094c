"""Virtual stages: placements, interleaved 1F1B, ZB-V and DualPipeV against their closed forms.

Costs are per chunk pass (f, b, w); "idle" is a rank's time without work per step, and the
bubble over ideal is idle over compute time (Narayanan et al.'s t_bubble / t_ideal).
"""

import json
import os
import subprocess
import sys

import pytest

from megatron.pipeline.schedules import SIMULATED_SCHEDULES, dualpipe_v, interleaved_1f1b, zb_v
from megatron.pipeline.schedules.base import Action, ActionKind
from megatron.pipeline.schedules.placement import Placement, interleaved, v_shape
from megatron.pipeline.simulation import SimulationError, simulate
from megatron.pipeline.trace import action_order, read_chrome_trace, write_chrome_trace

CLI = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "simulate_pipeline.py")
F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD
CHUNKED = ["interleaved-1f1b", "zb-v", "dualpipe-v"]


def run(name, n, m, steps=1, f=1.0, b=1.0, w=1.0, **kw):
    kw.setdefault("record_timeline", False)
    return simulate(SIMULATED_SCHEDULES[name], num_stages=n, microbatches_per_step=m, steps=steps,
                    forward_cost=f, backward_cost=b, weight_grad_cost=w, **kw)  # fmt: skip


# ------------------------------------------------------------------ placements


def test_interleaved_placement_strides_by_the_ranks():
    p = interleaved(4, 3)
    assert [p.stages_of(r) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert all(p.locate(p.virtual_stage(r, c)) == (r, c) for r in range(4) for c in range(3))


def test_v_placement_folds_the_pipeline_back():
    p = v_shape(4)
    assert [p.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert p.locate(3) == p.locate(4)[:1] + (0,)  # the turn stays on rank N - 1
    assert all(p.locate(p.virtual_stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    with pytest.raises(ValueError, match="even number of chunks"):
        Placement("v", 4, 3)


def test_actions_name_their_chunk():
    assert str(Action(F, 3)) == "F3"  # one chunk per stage: as before
    assert str(Action(F, 3, 1)) == "F3c1"
    pair = Action(F, 3, 0, (Action(B, 1, 1), Action(W, 1, 1)))
    assert str(pair) == "F3c0&B1c1&W1c1"
    assert pair.passes == (Action(F, 3, 0), Action(B, 1, 1), Action(W, 1, 1))


# ------------------------------------------------------------------ every pass once, in order


def passes_by_time(result):
    """(rank, kind, chunk, microbatch) -> (start, end) of its slot, each pass exactly once."""
    seen = {}
    for event in result.timeline:
        for part in event.action.passes:
            if part.kind is ActionKind.STEP:
                continue
            key = (event.stage, part.kind, part.chunk, part.microbatch)
            assert key not in seen, f"{key} ran twice"
            seen[key] = (event.start_s, event.end_s)
    return seen


@pytest.mark.parametrize("name,n,m", [("interleaved-1f1b", 4, 8), ("interleaved-1f1b", 3, 6),
                                      ("zb-v", 4, 8), ("zb-v", 4, 3), ("zb-v", 3, 7),
                                      ("dualpipe-v", 4, 8), ("dualpipe-v", 3, 11)])  # fmt: skip
def test_every_microbatch_of_every_chunk_runs_once_in_dependency_order(name, n, m):
    latency, steps = 0.25, 2
    r = run(name, n, m, steps=steps, f=1.0, b=1.5, w=0.5, p2p_latency=latency,
            record_timeline=True)  # fmt: skip
    schedule = SIMULATED_SCHEDULES[name]
    placement = schedule.placement(n, schedule.default_chunks_per_rank)
    seen = passes_by_time(r)
    total, last = steps * m, placement.num_virtual_stages - 1
    kinds = (F, B, W) if schedule.splits_backward else (F, B)
    assert len(seen) == len(kinds) * total * placement.num_virtual_stages
    for stage in range(placement.num_virtual_stages):
        rank, chunk = placement.locate(stage)
        for mb in range(total):
            start = {k: seen[(rank, k, chunk, mb)][0] for k in kinds}
            end = {k: seen[(rank, k, chunk, mb)][1] for k in kinds}
            if stage > 0:  # the activation from the virtual stage before, across ranks or not
                up_rank, up_chunk = placement.locate(stage - 1)
                hop = latency if up_rank != rank else 0.0
                assert start[F] >= seen[(up_rank, F, up_chunk, mb)][1] + hop - 1e-9
            if stage < last:  # the gradient from the virtual stage after
                down_rank, down_chunk = placement.locate(stage + 1)
                hop = latency if down_rank != rank else 0.0
                assert start[B] >= seen[(down_rank, B, down_chunk, mb)][1] + hop - 1e-9
            assert start[B] >= end[F] - 1e-9
            if W in kinds:
                assert start[W] >= start[B]
    assert r.optimizer_steps_per_stage == [steps] * n


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_the_turn_of_the_v_costs_no_transfer(name):
    """Rank N - 1 runs virtual stages N - 1 and N: its first chunk-1 forward starts as soon as
    its first chunk-0 forward ends, whatever the latency between ranks."""
    n, latency = 4, 0.5
    r = run(name, n, 2 * n, p2p_latency=latency, record_timeline=True)
    last = sorted((e for e in r.timeline if e.stage == n - 1), key=lambda e: e.start_s)
    first_down = next(e for e in last if e.action == Action(F, 0, 0))
    first_up = next(e for e in last if e.action.kind is F and e.action.chunk == 1)
    assert first_up.action.microbatch == 0 and first_up.start_s == first_down.end_s
    assert first_down.start_s == pytest.approx((n - 1) * (1.0 + latency))  # N - 1 hops before


def test_a_chunked_action_must_name_its_chunk():
    from megatron.pipeline.schedules.base import Schedule

    chunkless = Schedule("chunkless", lambda v: Action(F, v.forwards), False, True,
                         placement=interleaved, default_chunks_per_rank=2)  # fmt: skip
    with pytest.raises(SimulationError, match="names no model chunk"):
        simulate(chunkless, num_stages=2, microbatches_per_step=2, steps=1, forward_cost=1,
                 backward_cost=1)  # fmt: skip


# ------------------------------------------------------------------ interleaved 1F1B


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved_bubble_is_n_minus_1_over_v_m(n, v, groups):
    m = groups * n
    r = run("interleaved-1f1b", n, m, steps=2, f=1.0, b=2.0, w=0.0, chunks_per_rank=v)
    assert r.bubble_over_ideal == pytest.approx((n - 1) / (v * m), rel=0.01)
    assert r.idle_per_step == pytest.approx([(n - 1) * 3.0] * n, rel=0.01)  # (N - 1)(f + b)
    # Megatron's warm-up + 1 chunk activations at most, capped at all of the step's
    warmup = [min((n - s - 1) * 2 + (v - 1) * n, m * v) for s in range(n)]
    assert r.peak_inflight_per_stage == [min(w + 1, m * v) for w in warmup]


def test_interleaved_beats_1f1b_by_v_at_the_same_model():
    n, m, v = 4, 8, 2
    flush = run("1f1b", n, m, steps=1, f=2.0, b=4.0, w=0.0)  # a stage = v chunks
    inter = run("interleaved-1f1b", n, m, steps=1, f=1.0, b=2.0, w=0.0, chunks_per_rank=v)
    assert sum(inter.busy_per_stage) == sum(flush.busy_per_stage)
    assert inter.idle_per_step[0] == pytest.approx(flush.idle_per_step[0] / v)


def test_interleaved_order_is_megatrons_table():
    assert interleaved_1f1b.chunk_order(4, 2, 2) == (0, 0, 1, 1, 0, 0, 1, 1)
    assert interleaved_1f1b.chunk_order(5, 2, 3) == (0, 0, 0, 1, 1, 1, 0, 0, 1, 1)  # last short
    r = run("interleaved-1f1b", 2, 4, f=1.0, b=2.0, w=0.0, record_timeline=True)
    assert (
        action_order(r.timeline)[1]
        == (
            "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0 S"
        ).split()
    )  # rank 1: warm-up (N - r - 1) * 2 + (v - 1) * N = 2, then 1F1B over chunks


@pytest.mark.parametrize("n,v,m,group", [(4, 2, 6, None), (4, 2, 2, None), (4, 3, 9, None),
                                         (4, 2, 10, 4), (4, 2, 13, 5), (4, 2, 8, 3)])  # fmt: skip
def test_interleaved_rejects_megatrons_invalid_microbatch_counts(n, v, m, group):
    schedule = interleaved_1f1b.interleaved_1f1b(group)
    with pytest.raises(ValueError, match=r"^interleaved-1f1b on 4 ranks (needs a multiple|with)"):
        simulate(schedule, num_stages=n, microbatches_per_step=m, steps=1, forward_cost=1,
                 backward_cost=1, chunks_per_rank=v)  # fmt: skip


def test_interleaved_accepts_a_last_group_of_at_least_n():
    schedule = interleaved_1f1b.interleaved_1f1b(5)  # m = 14: groups 5, 5, 4 >= N
    r = simulate(schedule, num_stages=4, microbatches_per_step=14, steps=1, forward_cost=1,
                 backward_cost=2, chunks_per_rank=2)  # fmt: skip
    assert r.optimizer_steps_per_stage == [1] * 4
    with pytest.raises(ValueError, match="at least 2 model chunks"):
        run("interleaved-1f1b", 4, 8, chunks_per_rank=1)


# ------------------------------------------------------------------ ZB-V


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zb_v_at_equal_costs_idles_only_its_fill(n, m):
    """F = B = W = t: a flushed step idles (N - 1) t per rank (the staircase of the fill),
    half of ZB-H1's (N - 1)(F + B - W) at the same model; chained steps add no bubble."""
    t = 1.0
    one = run("zb-v", n, m, steps=1, f=t, b=t, w=t)
    assert one.idle_per_step == pytest.approx([(n - 1) * t] * n)
    assert one.bubble_over_ideal == pytest.approx((n - 1) / (6 * m))
    zb_h1 = run("zb-h1", n, m, steps=1, f=2 * t, b=2 * t, w=2 * t)  # a stage = 2 chunks
    assert zb_h1.idle_per_step[0] == pytest.approx(2 * one.idle_per_step[0])
    chained = run("zb-v", n, m, steps=8, f=t, b=t, w=t)
    assert [idle * 8 for idle in chained.idle_per_step] == pytest.approx([(n - 1) * t] * n)
    assert chained.steady_bubble_fraction == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [3, 4, 8])
@pytest.mark.parametrize(
    "fbw", [(1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (3.0, 5.0, 2.0), (1.0, 1.0, 0.5)]
)
def test_zb_v_steady_bubble_with_uneven_costs(n, fbw):
    """W <= min(F, B): each chained step adds 2(N - 1)(max(F, B) - W) of idle per rank."""
    f, b, w = fbw
    m = 2 * n
    six, seven = (run("zb-v", n, m, steps=k, f=f, b=b, w=w) for k in (6, 7))
    added = [7 * i7 - 6 * i6 for i6, i7 in zip(six.idle_per_step, seven.idle_per_step)]
    assert added == pytest.approx([2 * (n - 1) * (max(f, b) - w)] * n)


@pytest.mark.parametrize("n,m", [(2, 3), (4, 7), (4, 16), (8, 15)])
def test_zb_v_holds_1f1b_memory_on_every_rank(n, m):
    r = run("zb-v", n, m, steps=2)
    assert r.peak_inflight_per_stage == [2 * n] * n  # 2N chunks = N whole stages
    assert r.peak_held_per_stage == [2 * n] * n  # W never keeps more alive
    flush = run("1f1b", n, m, steps=1)
    assert flush.peak_inflight_per_stage[0] == n == r.peak_inflight_per_stage[0] / 2


def test_zb_v_runs_with_fewer_microbatches_than_its_phases():
    r = run("zb-v", 4, 2, steps=2, record_timeline=True)
    assert sum(1 for e in r.timeline if e.action.kind is W) == 2 * 2 * 2 * 4
    assert max(r.peak_inflight_per_stage) <= 4


def test_zb_v_and_dualpipe_v_need_two_chunks():
    for name in ("zb-v", "dualpipe-v"):
        with pytest.raises(ValueError, match="exactly 2 model chunks"):
            run(name, 4, 8, chunks_per_rank=4)


# ------------------------------------------------------------------ DualPipeV


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 10), (8, 16), (8, 20), (8, 32)])
@pytest.mark.parametrize("w", [1.0, 0.5])
def test_dualpipe_v_bubble_is_deepseeks(n, m, w):
    """(N - 1)(F&B + B - 3W) with B the full backward (b + w) and a pair's F&B = f + b + w here
    (passes of a slot add up), at DeepSeek's figure's costs f = b."""
    f = b = 1.0
    r = run("dualpipe-v", n, m, steps=1, f=f, b=b, w=w)
    full = b + w
    assert r.idle_per_step == pytest.approx([(n - 1) * ((f + full) + full - 3 * w)] * n)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (8, 16), (8, 32)])
def test_dualpipe_v_holds_2n_plus_1_chunks(n, m):
    r = run("dualpipe-v", n, m, steps=2)
    assert r.peak_inflight_per_stage == [2 * n + 1] * n  # DeepSeek's PP + 1, PP = 2N
    assert max(r.peak_held_per_stage) == 2 * n + 1


def test_dualpipe_v_overlaps_a_forward_with_the_other_chunks_full_backward():
    r = run("dualpipe-v", 4, 8, record_timeline=True)
    pairs = [e.action for e in r.timeline if e.action.kind is F and e.action.together]
    assert pairs and all(
        [p.kind for p in a.together] == [B, W] and a.together[0].chunk != a.chunk for a in pairs
    )
    # rank r runs 2(m - 2N + r + 1) + N - r - 1 pairs, the last rank one fewer (its first)
    per_rank = {s: sum(1 for e in r.timeline if e.stage == s and e.action.together
                       and e.action.kind is F) for s in range(4)}  # fmt: skip
    assert per_rank == {s: 2 * (8 - 8 + s + 1) + 4 - s - 1 - (s == 3) for s in range(4)}


def test_dualpipe_v_needs_2n_microbatches():
    with pytest.raises(ValueError, match="dualpipe-v needs at least 8 microbatches"):
        run("dualpipe-v", 4, 7)


def test_tables_are_the_papers_phases():
    order = [str(slot) for slot in zb_v.rank_order(1, 2, 4)]
    assert order == ("F0c0 F0c1 F1c0 F1c1 B0c1 W0c1 F2c0 B0c0 W0c0 F2c1 B1c1 W1c1 F3c0 B1c0 "
                     "W1c0 F3c1 B2c1 W2c1 B2c0 B3c1 B3c0 W2c0 W3c1 W3c0").split()  # fmt: skip
    order = [str(slot) for slot in dualpipe_v.rank_order(0, 2, 4)]
    assert order[:7] == "F0c0 F1c0 F2c0 F0c1 B0c1 W0c1 F1c1".split()  # phases 1 to 3
    assert order[7:9] == ["F3c0&B1c1&W1c1", "F2c1&B0c0&W0c0"]  # phase 4: overlapped pairs


# ------------------------------------------------------------------ traces and the CLI


def test_chunked_trace_round_trip(tmp_path):
    r = run("dualpipe-v", 2, 4, record_timeline=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), r.timeline, process_name="dualpipe-v")
    back = read_chrome_trace(str(path))
    assert action_order(back) == action_order(r.timeline)
    assert any(e.action.together for e in back)


def cli(*args):
    return subprocess.run([sys.executable, CLI, *args], capture_output=True, text=True, timeout=120)


def test_cli_prints_virtual_stage_figures():
    proc = cli("--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "8",
               "--virtual-stages", "2", "--steps", "2", "--fwd", "1", "--bwd", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["virtual_stages"]
    assert report["placement"] == "interleaved" and report["chunks_per_rank"] == 2
    assert report["bubble_over_ideal"] == pytest.approx(3 / 16)
    assert report["peak_activation_chunks_per_rank"] == [11, 9, 7, 5]
    assert report["peak_activations_in_stages_per_rank"] == [5.5, 4.5, 3.5, 2.5]
    plain = json.loads(cli("--schedule", "1f1b", "--steps", "2").stdout)
    assert "virtual_stages" not in plain  # one chunk per stage: the report is as before


@pytest.mark.parametrize("args,message", [
    (["--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages applies to"),
    (["--schedule", "interleaved-1f1b", "--microbatches", "6"], "needs a multiple of 4"),
    (["--schedule", "zb-v", "--fwd", "1,2"], "--fwd: 2 values for 8 stages"),
])  # fmt: skip
def test_cli_bad_virtual_stage_input_is_one_error_line(args, message):
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
