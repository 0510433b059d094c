"""For uniform costs, a real run's per-stage action order equals the simulator's.

One torchrun launch (gloo, 4 processes) runs 1F1B-flush and PACI under its reactive
backward-first arrival rule (`--paci-arrival-rule backward-first`) with emulated compute: every
stage sleeps F per forward and B per backward. A last run uses the default fixed-order rule with
uneven, noisy stages and micro batch 2: its order depends on counters only, so it too must equal
the simulation of the nominal costs. Two more run 2 model chunks per rank: interleaved 1F1B and
PACI over virtual stages in its counter-only (`fixed`) order. Each run writes its
Chrome trace (`--timeline-file`); `action_order` of that trace must equal `action_order` of
`simulate` for the same stages, microbatches per step and steps. Evaluation is off, so the
runtime drains only at the end of the run, as the simulator does: call k of both targets k*m
backwards, and no forward goes beyond steps*m (`microbatches_before_drain`).

Why this is not timing-flaky. 1F1B-flush's order depends on counters only. PACI's depends on
which of a stage's input and gradient arrives first, so a real run may legitimately take
another order than the simulation of the nominal costs. With uniform costs the only contested
decision is on stage s < N-1 right after backward j: forward j+N-s (its input is there) or
backward j+1, whose gradient arrives exactly one forward time F later, whatever the p2p
latency (the latency delays both paths alike). The simulator takes the forward; the real run
takes the backward only if timing noise (sleep overshoot, wake-ups, the training loop between
calls, other processes on the CPUs) shifts the two paths by F or more against each other.
`test_paci_contested_decisions_have_a_margin_of_one_forward` checks the margin in the
simulator; the real runs use F = 100 ms (50 ms was once overrun on a loaded two-core
machine), far above the few-millisecond noise of this
runtime, and a failure message shows the run's largest action overrun so an overloaded machine
is recognisable.
"""

import json
import os

import pytest

from megatron.benchmarks import emulated_benchmark as bench
from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.paci import FIXED_ORDER, with_paci_options
from megatron.pipeline.simulation import results, simulate
from megatron.pipeline.trace import action_order, read_chrome_trace

HERE = os.path.dirname(os.path.abspath(__file__))

STAGES, STEPS = 4, 3
FWD_MS, BWD_MS = 100.0, 200.0
# (name, schedule, microbatches per step): m < N leaves microbatches in flight across calls.
RUNS = [
    ("flush_m4", "1f1b", 4),
    ("paci_m4", "paci", 4),
    ("paci_m2", "paci", 2),
    ("paci_fixed_uneven_mbs2", "paci", 4),
    ("interleaved_flush_v2_m4", "1f1b", 4),
    ("interleaved_paci_fixed_v2_m4", "paci", 4),
]
CHUNKS = {"interleaved_flush_v2_m4": 2, "interleaved_paci_fixed_v2_m4": 2}
REACTIVE = ["--paci-arrival-rule", "backward-first"]
EXTRA_ARGS = {
    "paci_m4": REACTIVE,
    "paci_m2": REACTIVE,
    "paci_fixed_uneven_mbs2": [
        "--emulated-forward-ms", "50,100,50,40", "--emulated-backward-ms", "100,200,100,80",
        "--emulated-noise-cv", "0.2", "--micro-batch-size", "2", "--global-batch-size", "8",
    ],
    "interleaved_paci_fixed_v2_m4": ["--paci-arrival-rule", "fixed"],
}  # fmt: skip


def schedule_of(name: str, schedule: str):
    if name in CHUNKS:
        return bench.simulated_definition(schedule + (":fixed" if "fixed" in name else ""), 2)
    rule = "backward-first" if EXTRA_ARGS.get(name) == REACTIVE else None
    return with_paci_options(get_schedule(schedule), rule)


def simulated_order(schedule, microbatches: int, chunks: int = 1, **costs) -> dict:
    result = simulate(
        schedule,
        num_stages=STAGES,
        chunks_per_rank=chunks if chunks > 1 else None,
        microbatches_per_step=microbatches,
        steps=STEPS,
        forward_cost=costs.pop("forward_cost", FWD_MS / 1000.0),
        backward_cost=costs.pop("backward_cost", BWD_MS / 1000.0),
        **costs,
    )
    return action_order(result.timeline)


@pytest.fixture(scope="module")
def real_traces(tmp_path_factory):
    """Every run of RUNS in one torchrun launch; name -> trace events."""
    output = str(tmp_path_factory.mktemp("runtime_vs_simulator"))
    cases = []
    for name, schedule, microbatches in RUNS:
        run_dir = os.path.join(output, name)
        args = bench.emulated_run_args(
            schedule=schedule,
            stages=STAGES,
            microbatches=microbatches,
            fwd_ms=FWD_MS,
            bwd_ms=BWD_MS,
            steps=STEPS,
            metrics_dir=run_dir,
            timeline_file=os.path.join(run_dir, "timeline.json"),
            extra=EXTRA_ARGS.get(name),
            virtual_stages=CHUNKS.get(name, 1),
        )
        cases.append({"name": name, "args": args, "metrics_dir": run_dir})
    spec = os.path.join(output, "cases.json")
    with open(spec, "w") as f:
        json.dump(cases, f)
    command = bench.torchrun_command(STAGES, os.path.join(HERE, "multi_run.py"), [spec])
    bench.launch(command, os.path.join(output, "log.txt"), timeout_s=600)
    return {
        c["name"]: read_chrome_trace(os.path.join(c["metrics_dir"], "timeline.json")) for c in cases
    }


def largest_overrun_ms(events) -> float:
    """How much longer than nominal the slowest forward or backward of the run took."""
    nominal = {ActionKind.FORWARD: FWD_MS, ActionKind.BACKWARD: BWD_MS}
    return max(
        1000.0 * e.duration_s - nominal[e.action.kind] for e in events if e.action.kind in nominal
    )  # (uneven runs: against the nominal uniform costs)


def first_difference(real: list[str], expected: list[str]) -> str:
    index = next(
        (i for i, (a, b) in enumerate(zip(real, expected)) if a != b), min(len(real), len(expected))
    )
    window = slice(max(0, index - 3), index + 4)
    return f"at action {index}: real {real[window]} vs simulated {expected[window]}"


@pytest.mark.parametrize("name, schedule, microbatches", RUNS)
def test_real_action_order_equals_simulated(real_traces, name, schedule, microbatches):
    events = real_traces[name]
    real = action_order(events)
    chunks = CHUNKS.get(name, 1)
    expected = simulated_order(schedule_of(name, schedule), microbatches, chunks)
    assert sorted(real) == list(range(STAGES))
    passes = STEPS * microbatches * chunks
    for stage in range(STAGES):
        counts = {k: sum(a.startswith(k) for a in real[stage]) for k in ("F", "B", "S")}
        assert counts == {"F": passes, "B": passes, "S": STEPS}
    differences = {
        stage: first_difference(real[stage], expected[stage])
        for stage in range(STAGES)
        if real[stage] != expected[stage]
    }
    assert not differences, (
        f"{name}: real order differs from the simulation {differences}; largest action "
        f"overrun in the run {largest_overrun_ms(events):.1f} ms (a PACI reorder needs timing "
        f"noise of about F = {FWD_MS:.0f} ms: see the module docstring)"
    )


@pytest.mark.parametrize("microbatches", [2, 4])
def test_simulated_order_is_insensitive_to_latency_and_jitter(microbatches):
    """Reactive PACI's simulated order for nominal costs is the fixed 1F1B order without a
    flush, and it survives p2p latency and per-stage cost differences up to 10%: what a real
    run adds."""
    paci = with_paci_options(get_schedule("paci"), "backward-first")
    nominal = simulated_order(paci, microbatches)
    assert nominal == simulated_order(FIXED_ORDER, microbatches)
    f, b = FWD_MS / 1000.0, BWD_MS / 1000.0
    perturbed = [
        dict(p2p_latency=0.002),
        dict(p2p_latency=0.02, step_cost=0.005),
        dict(forward_cost=[f * 1.1, f, f * 0.9, f], backward_cost=[b, b * 0.9, b * 1.1, b]),
        dict(forward_cost=[f * 0.9, f * 1.1, f, f * 1.1], backward_cost=[b * 1.1, b, b, b * 0.9]),
    ]
    for costs in perturbed:
        assert simulated_order(paci, microbatches, **costs) == nominal, costs


def contested_margins(timeline, microbatches: int, latency: float) -> list[float]:
    """For every PACI decision on stage s < N-1 where both a forward (admitted, not past the
    data) and a backward were possible: how far in time the gradient's arrival is from
    flipping the choice. The stage takes the backward iff the gradient arrives no later than
    max(decision time, input arrival); the margin is the distance between the two."""
    stages = results.by_stage(timeline)
    end = {
        (s, e.action.kind, e.action.microbatch): e.end_s for s, evs in stages.items() for e in evs
    }
    margins = []
    for s in range(STAGES - 1):
        forwards = backwards = 0
        for event in stages[s]:
            forwards += event.action.kind is ActionKind.FORWARD
            backwards += event.action.kind is ActionKind.BACKWARD
            admitted = forwards - backwards < STAGES - s and forwards < STEPS * microbatches
            if not (admitted and backwards < forwards):
                continue
            input_at = -1.0 if s == 0 else end[(s - 1, ActionKind.FORWARD, forwards)] + latency
            grad_at = end[(s + 1, ActionKind.BACKWARD, backwards)] + latency
            margins.append(abs(grad_at - max(input_at, event.end_s)))
    return margins


@pytest.mark.parametrize("microbatches, latency", [(4, 0.0), (4, 0.002), (2, 0.002), (1, 0.005)])
def test_paci_contested_decisions_have_a_margin_of_one_forward(microbatches, latency):
    """The claim the real-run comparison rests on: with uniform costs every decision that
    depends on arrival order is F away from going the other way, whatever the latency."""
    f = FWD_MS / 1000.0
    result = simulate(
        with_paci_options(get_schedule("paci"), "backward-first"),
        num_stages=STAGES,
        microbatches_per_step=microbatches,
        steps=STEPS,
        forward_cost=f,
        backward_cost=BWD_MS / 1000.0,
        p2p_latency=latency,
    )
    margins = contested_margins(result.timeline, microbatches, latency)
    assert margins and min(margins) == pytest.approx(f, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# The benchmark's measurements, applied to simulated timelines where the answer is known.
@pytest.mark.parametrize("microbatches", [1, 4, 8])
def test_steady_state_throughput_matches_closed_forms(microbatches):
    f, b, steps = 0.05, 0.1, 8
    for name, expected in [
        ("1f1b", microbatches / ((microbatches + STAGES - 1) * (f + b))),
        ("paci", 1.0 / (f + b)),
    ]:
        result = simulate(
            get_schedule(name),
            num_stages=STAGES,
            microbatches_per_step=microbatches,
            steps=steps,
            forward_cost=f,
            backward_cost=b,
        )
        measured = results.steady_state_throughput(result.timeline, STAGES, microbatches, steps)
        assert measured == pytest.approx(expected, rel=1e-9), name


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_p2p_latency_estimate_recovers_the_simulated_latency(schedule):
    result = simulate(
        get_schedule(schedule),
        num_stages=STAGES,
        microbatches_per_step=4,
        steps=4,
        forward_cost=0.05,
        backward_cost=0.1,
        p2p_latency=0.003,
    )
    samples = bench.p2p_latency_samples(result.timeline)
    assert len(samples) >= STAGES
    assert bench.estimate_p2p_latency(result.timeline) == pytest.approx(0.003, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_replay_reads_virtual_stages_from_a_trace(schedule):
    """With 2 chunks per rank the trace analysis finds the transfers between virtual stages
    (the last rank's chunk 0 feeds the first rank's chunk 1) and each virtual stage's costs."""
    forward = [0.01 * (1 + k) for k in range(2 * STAGES)]  # one per virtual stage
    result = simulate(
        bench.simulated_definition(schedule, 2), num_stages=STAGES, microbatches_per_step=4,
        steps=4, forward_cost=forward, backward_cost=[2 * f for f in forward], p2p_latency=0.003,
        chunks_per_rank=2,
    )  # fmt: skip
    samples = bench.p2p_latency_samples(result.timeline, chunks=2)
    assert len(samples) >= 2 * STAGES
    assert bench.estimate_p2p_latency(result.timeline, 2) == pytest.approx(0.003, rel=1e-9)
    costs = bench.measured_costs(result.timeline, STAGES, 2)
    assert costs["forward_cost"] == pytest.approx(forward)
    assert costs["backward_cost"] == pytest.approx([2 * f for f in forward])
