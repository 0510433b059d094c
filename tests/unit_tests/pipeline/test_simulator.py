"""The discrete-event simulator: bubbles, drift, in-flight and delays, traces, and the CLI."""

import json
import math
import os
import subprocess
import sys

import pytest

from megatron.benchmarks.calibration_file import stage_costs_from_calibration
from megatron.pipeline.schedules import SIMULATED_SCHEDULES, paci
from megatron.pipeline.schedules.base import Action, ActionKind, Schedule
from megatron.pipeline.simulation import SimulationError, simulate
from megatron.pipeline.trace import (
    TraceEvent,
    action_order,
    read_chrome_trace,
    write_chrome_trace,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CLI = os.path.join(REPO, "tools", "simulate_pipeline.py")


def run(name, n, m, steps, fwd=1.0, bwd=2.0, **kw):
    kw.setdefault("record_timeline", False)
    return simulate(
        SIMULATED_SCHEDULES[name],
        num_stages=n,
        microbatches_per_step=m,
        steps=steps,
        forward_cost=fwd,
        backward_cost=bwd,
        **kw,
    )


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_flush_bubble_is_the_closed_form(n, m):
    r = run("1f1b", n, m, steps=4)
    closed = (n - 1) / (m + n - 1)
    assert r.bubble_fraction == pytest.approx(closed, rel=0.01)
    assert r.steady_bubble_fraction == pytest.approx(closed, rel=0.01)
    assert r.peak_inflight_per_stage == [min(n - s, m) for s in range(n)]
    assert r.max_drift_per_stage == [0] * n
    assert r.max_gradient_delay_per_stage == [0] * n
    # every stage idles (N - 1)(F + B) per step
    assert r.idle_per_step == pytest.approx([(n - 1) * 3.0] * n)


@pytest.mark.parametrize("n,a", [(4, 4), (8, 4), (8, 8)])
def test_paci_utilization_over_200_steps(n, a):
    r = run("paci", n, a, steps=200)
    assert r.mean_utilization >= 0.99
    assert r.steady_utilization == pytest.approx([1.0] * n)
    assert r.throughput_vs_ideal >= 0.99


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("a", [1, 2])
def test_paci_bubble_is_a_one_time_fill(n, a):
    """Whole-run bubble = (N-1)/(M+N-1) for M microbatches in all: flush's form with m = M."""
    r = run("paci", n, a, steps=200)
    total = 200 * a
    assert r.bubble_fraction == pytest.approx((n - 1) / (total + n - 1), rel=1e-9)
    assert r.steady_utilization == pytest.approx([1.0] * n)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("a", [1, 2, 4, 8])
def test_paci_drift_and_in_flight(n, a):
    r = run("paci", n, a, steps=12)
    bound = [math.ceil((n - 1 - s) / a) for s in range(n)]
    assert r.max_drift_per_stage == bound
    assert bound == [paci.drift_bound(s, n, a) for s in range(n)]
    assert r.max_gradient_delay_per_stage == bound  # no stash: the drift is the delay
    assert r.peak_inflight_per_stage == [n - s for s in range(n)]
    assert r.extra_weight_versions == [0] * n
    assert r.optimizer_steps_per_stage == [12] * n


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("a", [1, 2, 3, 8])
@pytest.mark.parametrize("backward_cost", [1.0, 2.0, 3.0])
def test_paci_flush_inflight_limit_holds_what_flush_holds(n, a, backward_cost):
    """--paci-inflight-limit flush: stage s holds min(N - s, a), 1F1B-flush's count with a
    microbatches per step, also for a < N; drift stays within ceil((window - 1) / a). The
    pipeline still never drains, so every rule beats flush once a > 1 (the first stage starts
    the next step while the last backwards come back), the reactive rules by the most."""
    kwargs = dict(num_stages=n, microbatches_per_step=a, steps=24, forward_cost=1.0,
                  backward_cost=backward_cost, record_timeline=False)  # fmt: skip
    flush = simulate(SIMULATED_SCHEDULES["1f1b"], **kwargs)
    depth = simulate(paci.paci_schedule(), **kwargs)
    windows = [min(n - s, a) for s in range(n)]
    bounds = [paci.drift_bound(s, n, a, "flush") for s in range(n)]
    assert bounds == [math.ceil((w - 1) / a) for w in windows]
    capped = {r: simulate(paci.paci_schedule(r, "flush"), **kwargs) for r in paci.ARRIVAL_RULES}
    for result in capped.values():
        assert result.peak_inflight_per_stage == flush.peak_inflight_per_stage == windows
        assert all(d <= b for d, b in zip(result.max_drift_per_stage, bounds))
        assert result.max_drift_per_stage[0] == bounds[0]
        assert depth.makespan <= result.makespan <= flush.makespan
        if a > 1:
            assert result.makespan < flush.makespan
        if a >= n:  # the window is N - s either way
            assert result.makespan == depth.makespan
    assert capped["backward-first"].makespan <= capped["fixed"].makespan
    assert depth.peak_inflight_per_stage == [n - s for s in range(n)]


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("m", [8, 16])
@pytest.mark.parametrize("fbw", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0)])
def test_zb_h1_bubble_per_step(n, m, fbw):
    f, b, w = fbw
    zb = run("zb-h1", n, m, steps=3, fwd=f, bwd=b, weight_grad_cost=w)
    flush = run("1f1b", n, m, steps=3, fwd=f, bwd=b, weight_grad_cost=w)
    assert zb.idle_per_step == pytest.approx([(n - 1) * (f + b - w)] * n, rel=0.01)
    assert flush.idle_per_step == pytest.approx([(n - 1) * (f + b + w)] * n, rel=0.01)
    assert zb.peak_inflight_per_stage == flush.peak_inflight_per_stage
    assert zb.max_drift_per_stage == [0] * n


@pytest.mark.parametrize("slow", [0, 2, 3])
def test_paci_with_a_3x_slower_stage(slow):
    n, a = 4, 2
    fwd, bwd = [1.0] * n, [2.0] * n
    fwd[slow], bwd[slow] = 3.0, 6.0
    r = run("paci", n, a, steps=100, fwd=fwd, bwd=bwd)
    assert all(r.max_drift_per_stage[s] <= paci.drift_bound(s, n, a) for s in range(n))
    assert all(r.peak_inflight_per_stage[s] <= n - s for s in range(n))
    assert r.throughput_vs_ideal >= 0.98  # the slow stage is the bottleneck, and it is busy
    assert r.optimizer_steps_per_stage == [100] * n


def test_synchronous_schedules_never_drift():
    for name in ("1f1b", "gpipe", "zb-h1"):
        r = run(name, 4, 4, steps=3, fwd=[1, 2, 1, 3], bwd=2, weight_grad_cost=0.5)
        assert r.max_drift_per_stage == [0] * 4
        assert r.max_gradient_delay_per_stage == [0] * 4


# ------------------------------------------------------------------ stashing schedules


def test_2bw_has_a_constant_one_step_delay_with_two_versions():
    n = 8
    r = run("2bw", n, n, steps=10)
    assert r.max_drift_per_stage == [0] * n  # the backward uses the stashed version
    assert r.max_gradient_delay_per_stage == [1] * n  # every stage, the last one too
    assert r.measured_extra_weight_versions == r.extra_weight_versions == [1] * n
    assert r.steady_utilization == pytest.approx([1.0] * n)


def test_2bw_needs_a_batch_to_cover_the_pipeline():
    with pytest.raises(ValueError, match="2bw needs at least 7 microbatches"):
        run("2bw", 8, 4, steps=2)


def test_pipedream_delay_grows_with_depth():
    n = 6
    r = run("pipedream", n, 4, steps=6)
    assert r.max_drift_per_stage == [0] * n
    assert r.max_gradient_delay_per_stage == [n - 1 - s for s in range(n)]
    assert r.measured_extra_weight_versions == r.extra_weight_versions
    assert r.extra_weight_versions == [n - 1 - s for s in range(n)]
    assert r.optimizer_steps_per_stage == [24] * n


def test_gpipe_holds_every_microbatch():
    r = run("gpipe", 4, 6, steps=2)
    assert r.peak_inflight_per_stage == [6] * 4
    assert r.bubble_fraction == pytest.approx(3 / 9)


# ------------------------------------------------------------------ model details


def test_step_cost_lengthens_each_flush_step():
    n, m, step = 4, 8, 0.7
    r = run("1f1b", n, m, steps=5, step_cost=step)
    assert r.makespan / 5 == pytest.approx((m + n - 1) * 3 + step)


@pytest.mark.parametrize("n", [4, 8])
def test_latency_is_not_hidden_by_the_1f1b_window(n):
    """Stage 0 admits N microbatches; each round trip costs N(F+B) of compute plus 2(N-1)
    transfers, so with latency L the steady state is N(F+B) / (N(F+B) + 2(N-1)L) busy."""
    latency = 0.3
    r = run("paci", n, 4, steps=40, p2p_latency=latency)
    expected = n * 3 / (n * 3 + 2 * (n - 1) * latency)
    assert r.steady_utilization == pytest.approx([expected] * n, rel=1e-6)


def test_paci_order_does_not_hinge_on_ties():
    """A real run can only reproduce the simulated order if simultaneous events don't decide."""
    base = action_order(run("paci", 4, 2, steps=6, record_timeline=True).timeline)
    for kw in ({"p2p_latency": 1e-6}, {"fwd": 1.0001}, {"bwd": 2.0001}):
        assert action_order(run("paci", 4, 2, steps=6, record_timeline=True, **kw).timeline) == base


def test_stages_move_to_the_next_call_on_their_own():
    r = run("paci", 4, 2, steps=3, record_timeline=True)
    order = action_order(r.timeline)
    # the last stage steps after its 2nd backward while stage 0 still has 2 forwards to go
    assert order[3][:5] == ["F0", "B0", "F1", "B1", "S"]
    assert order[0] == "F0 F1 F2 F3 B0 F4 B1 S F5 B2 B3 S B4 B5 S".split()


def test_bad_arguments():
    with pytest.raises(ValueError, match="3 values given for 4 stages"):
        run("paci", 4, 2, steps=2, fwd=[1, 1, 1])
    with pytest.raises(ValueError, match="finite and >= 0"):
        run("paci", 4, 2, steps=2, bwd=-1.0)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        run("paci", 4, 2, steps=0)
    with pytest.raises(ValueError, match="p2p_latency"):
        run("paci", 4, 2, steps=2, p2p_latency=math.nan)


def test_deadlocks_and_impossible_actions_are_reported():
    waits = Schedule("waits", lambda v: Action(ActionKind.WAIT), True, False)
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(
            waits, num_stages=2, microbatches_per_step=1, steps=1, forward_cost=1, backward_cost=1
        )
    skips = Schedule("skips", lambda v: Action(ActionKind.FORWARD, v.forwards + 1), False, False)
    with pytest.raises(SimulationError, match="names microbatch 1"):
        simulate(
            skips, num_stages=2, microbatches_per_step=1, steps=1, forward_cost=1, backward_cost=1
        )


def test_to_json_is_one_object():
    data = json.loads(run("zb-h1", 4, 8, steps=2, weight_grad_cost=1.0).to_json())
    for key in (
        "makespan",
        "utilization",
        "bubble_fraction",
        "throughput_vs_ideal",
        "max_drift_per_stage",
        "peak_inflight_per_stage",
        "extra_weight_versions",
        "microbatches_per_second",
    ):
        assert key in data
    assert set(data["utilization"]) == {"per_stage", "mean"}
    assert data["microbatches_per_second"] == pytest.approx(16 / data["makespan"])


# ------------------------------------------------------------------ calibration


def test_calibration_per_layer_is_split_into_stage_blocks():
    data = {
        "p2p_s": 0.5,
        "profiles": [
            {"micro_batch_size": 1, "layer": {"forward_s": 1, "backward_s": 2}, "num_layers": 4},
            {
                "micro_batch_size": 2,
                "layers": [{"forward_s": f, "backward_s": 2 * f} for f in (1, 2, 3, 4)],
                "embedding": {"forward_s": 0.5, "backward_s": 0.5},
                "output": {"forward_s": 1, "backward_s": 1, "weight_grad_s": 0.25},
            },
        ],
    }
    costs = stage_costs_from_calibration(data, 2, micro_batch_size=2)
    assert costs.forward == [3.5, 8.0]
    assert costs.backward == [6.5, 15.0]
    assert costs.weight_grad == [0.0, 0.25]
    assert costs.p2p_latency == 0.5
    assert stage_costs_from_calibration(data, 4, micro_batch_size=1).forward == [1.0] * 4
    with pytest.raises(ValueError, match="choose one"):
        stage_costs_from_calibration(data, 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        stage_costs_from_calibration(data, 3, micro_batch_size=1)
    stages = {"stages": [{"forward_s": 1, "backward_s": 2, "step_s": 0.1}]}
    assert stage_costs_from_calibration(stages, 1).step == [0.1]
    with pytest.raises(ValueError, match=r"stages\[0\]: missing backward_s"):
        stage_costs_from_calibration({"stages": [{"forward_s": 1}]}, 1)


# ------------------------------------------------------------------ traces


def test_chrome_trace_round_trip(tmp_path):
    r = run("zb-h1", 3, 4, steps=2, weight_grad_cost=1.0, record_timeline=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), r.timeline, process_name="zb-h1")
    raw = json.loads(path.read_text())
    threads = [e for e in raw["traceEvents"] if e.get("name") == "thread_name"]
    assert [t["args"]["name"] for t in threads] == ["stage 0", "stage 1", "stage 2"]
    work = [e for e in raw["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in work} == {"forward", "backward", "weight_grad", "step"}
    assert all(e["pid"] == 0 for e in work)
    back = read_chrome_trace(str(path))
    assert action_order(back) == action_order(r.timeline)
    first = min(back, key=lambda e: (e.stage, e.start_s))
    assert first == TraceEvent(0, Action(ActionKind.FORWARD, 0), 0.0, 1.0)


def test_action_order_leaves_out_decisions():
    events = [
        TraceEvent(0, Action(ActionKind.BACKWARD, 0), 2.0, 3.0),
        TraceEvent(0, Action(ActionKind.WAIT), 1.0, 2.0),
        TraceEvent(0, Action(ActionKind.FORWARD, 0), 0.0, 1.0),
        TraceEvent(1, Action(ActionKind.STEP), 0.0, 0.0),
    ]
    assert action_order(events) == {0: ["F0", "B0"], 1: ["S"]}


# ------------------------------------------------------------------ CLI


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_cli_prints_one_json_object_and_writes_the_timeline_and_plot(tmp_path):
    timeline, plot = tmp_path / "t.json", tmp_path / "p.png"
    proc = cli(
        "--schedule",
        "paci",
        "--stages",
        "4",
        "--microbatches",
        "2",
        "--steps",
        "5",
        "--fwd",
        "1,1,3,1",
        "--bwd",
        "2",
        "--timeline",
        str(timeline),
        "--plot",
        str(plot),
        "--paci-inflight-limit",
        "flush",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # exactly one JSON document
    assert report["schedule"] == "paci" and report["costs"]["forward"] == [1, 1, 3, 1]
    assert len(report["max_drift_per_stage"]) == 4
    assert report["peak_inflight_per_stage"] == [2, 2, 2, 1]  # capped at flush's min(N - s, 2)
    assert read_chrome_trace(str(timeline))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schedule", "nope"], "invalid choice"),
        (["--schedule", "1f1b", "--stages", "4", "--fwd", "1,2"], "--fwd: 2 values for 4 stages"),
        (["--schedule", "2bw", "--stages", "8", "--microbatches", "2"], "2bw needs at least 7"),
        (["--schedule", "1f1b", "--paci-inflight-limit", "flush"], "applies to the paci schedule"),
    ],
)
def test_cli_bad_input_is_one_error_line(args, message):
    proc = cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
