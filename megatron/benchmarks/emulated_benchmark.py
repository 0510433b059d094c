"""Emulated-compute schedule benchmark: the real runtime against the simulator's prediction.

`tools/benchmark_schedules.py` is its command line.

Launches `pretrain_gpt.py` through torchrun (gloo, one process per stage) once per schedule,
with each stage's model replaced by a stand-in that sleeps ``--fwd-ms`` per forward and
``--bwd-ms`` per backward (`megatron.model.emulated_stage`) and a tiny hidden size, so what is
measured is the schedule, the runtime and the transfers, not the CPU. Each run writes its
Chrome trace (``--timeline-file``) and ``summary.json`` (``--metrics-dir``). The simulator then
runs the same schedule definition with costs and p2p latency measured from that trace, and
both timelines are reduced to the same steady-state throughput. Prints one JSON object (also
written to ``OUTPUT/report.json``, beside each run's log, trace and summary).

    python tools/benchmark_schedules.py --stages 4 --microbatches 8 --fwd-ms 50 --bwd-ms 100
    python tools/benchmark_schedules.py --stages 4 --microbatches 4 --fwd-ms 20,40,20,20 \
        --bwd-ms 40,80,40,40 --noise-cv 0.2 --schedules 1f1b paci paci:backward-first

Virtual stages: ``--virtual-stages v`` runs v model chunks per rank (interleaved 1F1B for
``1f1b``, PACI over virtual stages for ``paci``); costs are then per chunk pass, one value or
one per virtual stage (chunk c of rank r is virtual stage c N + r), and the replay measures
them, and the transfers, per virtual stage.

Uneven and noisy stages: ``--fwd-ms``/``--bwd-ms`` take one value per stage, and ``--noise-cv``
draws each emulated action's time around them (seeded by ``--seed``; `CostNoise`). A schedule
``paci:RULE`` runs PACI with ``--paci-arrival-rule RULE``.

With ``--repeats R`` every schedule runs R times, interleaved with the other schedules so both
see the same machine, and the top-level figures are each schedule's median run (by measured
throughput; its prediction comes from its own trace); ``runs`` lists every run. On a shared
machine other jobs' CPU bursts stall the pipeline now and then (a stage's wake-up comes tens
to hundreds of ms late): the median run is the robust figure.

Definitions (the same functions read the real and the simulated timeline):

* steady-state throughput: `megatron.pipeline.simulation.results.steady_state_throughput`,
  from the end of step 1 to the last step before the final drain.
* p2p latency (`estimate_p2p_latency`): the mean, over transfers whose receiving stage was
  already idle when the sender finished, of (receiver's start) - (sender's end). It includes
  the receiving thread's wake-up and the decision, i.e. all the delay a transfer adds.
* simulator costs (`measured_costs`): per stage, the mean duration of its forwards and of its
  backwards in the trace (compute plus the runtime's own work inside the action); one step
  cost for all stages, the smallest per-stage mean (1F1B-flush's step all-reduces the
  gradient norm over the whole pipeline, so the other stages' steps include waiting for the
  last stage to get there). Means, not medians: throughput is linear in the durations, so the
  occasional slow action (another process had the CPU) must count with its weight.
  ``simulated_throughput_nominal`` uses the nominal F and B and no step cost instead;
  ``simulated_throughput_with_overhead`` adds each rank's runtime overhead per action (below)
  to its passes, the work between actions the trace's durations leave out. With
  noise, the simulator replays the run's own draws (same `CostNoise` seed): each stage's
  nominal cost is its measured mean divided by the mean factor drawn for that stage and kind.
* runtime overhead per action: ``runtime_overhead_us_per_action`` of summary.json
  (`RankRuntime.overhead_per_action_us`): time in training calls that was neither compute,
  nor posting a send, nor waiting; mean and max over stages.

Acceptance: PACI/flush >= 95% of the simulated ratio (uniform stages: of ``(m + N - 1) / m``),
every prediction within 5%, overhead under 1 ms per action; reported under ``acceptance``.
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron.pipeline.schedules import get_schedule, virtual_schedule
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.paci import with_paci_options
from megatron.pipeline.simulation.costs import CostNoise
from megatron.pipeline.simulation.engine import simulate
from megatron.pipeline.simulation.results import (
    by_stage,
    steady_state_throughput,
    steady_state_window,
)
from megatron.pipeline.trace import read_chrome_trace

# pretrain_gpt.py is installed as a module beside this package; runs start in its directory.
PRETRAIN_SCRIPT = importlib.util.find_spec("pretrain_gpt").origin
REPO = os.path.dirname(PRETRAIN_SCRIPT)

# The stand-in stage carries a (seq, micro-batch, hidden) activation of 2048 floats (8 KiB):
# transfers cost next to nothing. The sequence is not shorter because megatron-core's mock
# dataset (100k documents of up to 4096 tokens) builds one sample index entry per sequence:
# 30+ s at 4 tokens, well under a second at 1024.
MODEL_FLAGS = {
    "--hidden-size": 2,
    "--num-attention-heads": 1,
    "--seq-length": 1024,
    "--micro-batch-size": 1,
    "--vocab-size": 128,
    "--lr": 1e-3,
}
RATIO_TOLERANCE = 0.95  # measured ratio >= 95% of the closed form
PREDICTION_TOLERANCE = 0.05  # simulator within 5% of each measurement
OVERHEAD_LIMIT_US = 1000.0


# ---------------------------------------------------------------------------- launching
def emulated_run_args(
    *,
    schedule: str,
    stages: int,
    microbatches: int,
    fwd_ms: float | list[float],
    bwd_ms: float | list[float],
    steps: int,
    metrics_dir: str,
    timeline_file: str | None,
    extra: list[str] | None = None,
    noise_cv: float | list[float] = 0.0,
    seed: int = 1234,
    virtual_stages: int = 1,
) -> list[str]:
    """`pretrain_gpt.py` flags for an emulated run: no evaluation or checkpoint, so the only
    drain is at the end, as in the simulator (`forward_limit = steps * m` on every call)."""
    args = [
        "--num-layers",
        str(stages * virtual_stages),
        "--pipeline-model-parallel-size",
        str(stages),
        "--pipeline-schedule",
        schedule,
        "--global-batch-size",
        str(microbatches * MODEL_FLAGS["--micro-batch-size"]),
        "--train-iters",
        str(steps),
        "--emulated-forward-ms",
        comma_list(fwd_ms),
        "--emulated-backward-ms",
        comma_list(bwd_ms),
        "--emulated-noise-cv",
        comma_list(noise_cv),
        "--seed",
        str(seed),
        "--mock-data",
        "--untie-embeddings-and-output-weights",
        "--tokenizer-type",
        "NullTokenizer",
        "--distributed-backend",
        "gloo",
        "--eval-iters",
        "0",
        "--log-interval",
        str(steps),
        "--metrics-dir",
        metrics_dir,
    ]
    for flag, value in MODEL_FLAGS.items():
        args += [flag, str(value)]
    if timeline_file:
        args += ["--timeline-file", timeline_file]
    if virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(virtual_stages)]
    return args + list(extra or [])


def comma_list(values: float | list[float]) -> str:
    """A per-stage flag's value: one number, or a comma list."""
    if isinstance(values, (int, float)):
        return repr(float(values))
    return ",".join(repr(float(v)) for v in values)


def schedule_and_rule(name: str) -> tuple[str, str | None]:
    """'paci:backward-first' -> ('paci', 'backward-first'); '1f1b' -> ('1f1b', None)."""
    schedule, _, rule = name.partition(":")
    return schedule, rule or None


def torchrun_command(nproc: int, script: str, script_args: list[str]) -> list[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", f"--nproc-per-node={nproc}", script, *script_args]


def launch(command: list[str], log_file: str, timeout_s: float) -> None:
    """Run a torchrun command from the repository root; raise with the log's tail on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log_file, "w") as log:
        completed = subprocess.run(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    if completed.returncode != 0:
        with open(log_file) as log:
            tail = log.read()[-4000:]
        raise RuntimeError(f"{' '.join(command)} failed (exit {completed.returncode}):\n{tail}")


# ---------------------------------------------------------------------------- trace analysis
def virtual_stage_of(event, num_stages: int) -> int:
    """Chunk c of rank r is virtual stage c N + r (one chunk: the stage itself)."""
    return (event.action.chunk or 0) * num_stages + event.stage


def p2p_latency_samples(events, chunks: int = 1) -> list[float]:
    """(receiver start) - (sender end) for every transfer the receiver was idle for; a
    forward comes from the previous virtual stage, a backward from the next."""
    stages = by_stage(events)
    n = len(stages)
    ends: dict[tuple[int, ActionKind, int], float] = {}
    for stage_events in stages.values():
        for e in stage_events:
            if e.action.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                ends[(virtual_stage_of(e, n), e.action.kind, e.action.microbatch)] = e.end_s
    last = n * chunks - 1
    samples = []
    for stage_events in stages.values():
        for previous, event in zip(stage_events, stage_events[1:]):
            kind, microbatch = event.action.kind, event.action.microbatch
            here = virtual_stage_of(event, n)
            if kind is ActionKind.FORWARD and here > 0:
                sender = (here - 1, kind, microbatch)
            elif kind is ActionKind.BACKWARD and here < last:
                sender = (here + 1, kind, microbatch)
            else:
                continue
            sent = ends.get(sender)
            if sent is not None and previous.end_s < sent:  # idle before the tensor was sent
                samples.append(event.start_s - sent)
    return samples


def estimate_p2p_latency(events, chunks: int = 1) -> float:
    samples = p2p_latency_samples(events, chunks)
    return statistics.fmean(samples) if samples else 0.0


def measured_costs(events, num_stages: int, chunks: int = 1) -> dict:
    """Per (virtual) stage mean forward/backward durations and one step cost (see the
    docstring)."""
    by_virtual: dict[tuple[ActionKind, int], list[float]] = {}
    for e in events:
        key = (e.action.kind, virtual_stage_of(e, num_stages))
        by_virtual.setdefault(key, []).append(e.duration_s)

    def means(kind: ActionKind, count: int) -> list[float]:
        durations = [by_virtual.get((kind, s), []) for s in range(count)]
        return [statistics.fmean(d) if d else 0.0 for d in durations]

    return {
        "forward_cost": means(ActionKind.FORWARD, num_stages * chunks),
        "backward_cost": means(ActionKind.BACKWARD, num_stages * chunks),
        "step_cost": min(means(ActionKind.STEP, num_stages)),  # steps carry no chunk
    }


def simulated_definition(schedule: str, chunks: int = 1):
    """What the runtime runs for `schedule` (with `chunks` model chunks per rank)."""
    name, rule = schedule_and_rule(schedule)
    if chunks > 1:
        return virtual_schedule(name, arrival_rule=rule)
    return with_paci_options(get_schedule(name, simulated=True), rule)


def simulated_steady_throughput(
    schedule: str,
    *,
    num_stages: int,
    microbatches: int,
    steps: int,
    p2p_latency: float,
    chunks: int = 1,
    **costs,
) -> float:
    result = simulate(
        simulated_definition(schedule, chunks),
        num_stages=num_stages,
        chunks_per_rank=chunks if chunks > 1 else None,
        microbatches_per_step=microbatches,
        steps=steps,
        p2p_latency=p2p_latency,
        record_timeline=True,
        **costs,
    )
    return steady_state_throughput(result.timeline, num_stages, microbatches, steps)


# ---------------------------------------------------------------------------- one benchmark
def run_schedule(schedule: str, options, run_dir: str) -> dict:
    """One real emulated run of `schedule`; its trace, summary and the simulator's figures."""
    os.makedirs(run_dir, exist_ok=True)
    timeline = os.path.join(run_dir, "timeline.json")
    name, rule = schedule_and_rule(schedule)
    args = emulated_run_args(
        schedule=name,
        stages=options.stages,
        microbatches=options.microbatches,
        fwd_ms=options.fwd_ms,
        bwd_ms=options.bwd_ms,
        steps=options.steps,
        metrics_dir=run_dir,
        timeline_file=timeline,
        extra=["--paci-arrival-rule", rule] if rule else None,
        noise_cv=options.noise_cv,
        seed=options.seed,
        virtual_stages=options.virtual_stages,
    )
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    launch(
        torchrun_command(options.stages, PRETRAIN_SCRIPT, args),
        os.path.join(run_dir, "log.txt"),
        options.timeout,
    )
    launch_s = time.perf_counter() - started
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    overheads = [stage["runtime_overhead_us_per_action"] for stage in summary["stages"]]
    figures = trace_figures(schedule, options, read_chrome_trace(timeline), overheads)
    total = summary["iterations"] * summary["num_microbatches"]
    return {
        **figures,
        "overhead_us_per_action": {
            "per_stage": overheads,
            "mean": statistics.fmean(overheads),
            "max": max(overheads),
        },
        "whole_run_throughput": total / summary["elapsed_s"],
        "elapsed_s": summary["elapsed_s"],
        "launch_s": launch_s,
        "load_average_1min_before": load_before,
        "timeline": timeline,
    }


def trace_figures(schedule: str, options, events, overheads_us: list[float] | None = None) -> dict:
    """A run's measured steady-state throughput and the simulator's prediction of it from the
    costs and p2p latency measured in the same trace (and from the nominal costs; and with
    each rank's measured runtime work between actions, `overheads_us`, added to its passes)."""
    n, m, steps, v = options.stages, options.microbatches, options.steps, options.virtual_stages
    measured = steady_state_throughput(events, n, m, steps)
    latency_samples = p2p_latency_samples(events, v)
    if options.p2p_ms is not None:
        latency = options.p2p_ms / 1000.0
    else:
        latency = estimate_p2p_latency(events, v)
    costs = measured_costs(events, n, v)
    noise = CostNoise(options.noise_cv, options.seed) if has_noise(options.noise_cv) else None
    shape = dict(
        num_stages=n, microbatches=m, steps=steps, p2p_latency=latency, noise=noise, chunks=v
    )
    replayed = without_mean_noise(costs, noise, n * v, steps * m)
    simulated = simulated_steady_throughput(schedule, **shape, **replayed)
    nominal = simulated_steady_throughput(
        schedule,
        **shape,
        forward_cost=per_stage_seconds(options.fwd_ms, n * v),
        backward_cost=per_stage_seconds(options.bwd_ms, n * v),
    )
    figures = {}
    if overheads_us is not None:
        with_overhead = {
            key: [cost + overheads_us[k % n] / 1e6 for k, cost in enumerate(replayed[key])]
            for key in ("forward_cost", "backward_cost")
        }
        figures["simulated_with_overhead"] = simulated_steady_throughput(
            schedule, **shape, **{**replayed, **with_overhead}
        )
    return {
        **figures,
        "measured": measured,
        "simulated": simulated,
        "prediction_error": relative_error(simulated, measured),
        "simulated_nominal": nominal,
        "p2p_latency_ms": 1000.0 * latency,
        "p2p_latency_samples": len(latency_samples),
        "costs_ms": {
            "forward": [round(1000.0 * c, 3) for c in costs["forward_cost"]],
            "backward": [round(1000.0 * c, 3) for c in costs["backward_cost"]],
            "step": round(1000.0 * costs["step_cost"], 3),
        },
    }


def has_noise(cv: float | list[float]) -> bool:
    return any(c > 0 for c in ([cv] if isinstance(cv, (int, float)) else cv))


def per_stage_seconds(ms: float | list[float], num_stages: int) -> list[float]:
    values = [ms] * num_stages if isinstance(ms, (int, float)) else ms
    return [v / 1000.0 for v in values]


def without_mean_noise(costs: dict, noise: CostNoise | None, num_stages: int, count: int) -> dict:
    """Measured mean costs divided by the mean noise factor the run drew per stage and kind, so
    that simulating them with the same `noise` replays the run's actions (see the docstring)."""
    if noise is None:
        return costs
    scaled = dict(costs)
    for key, kind in (("forward_cost", "F"), ("backward_cost", "B")):
        scaled[key] = [
            cost / statistics.fmean(noise.factor(s, kind, i) for i in range(count))
            for s, cost in enumerate(costs[key])
        ]
    return scaled


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def median_run(runs: list[dict]) -> dict:
    """The run with the median measured throughput (the lower one of two middle runs)."""
    ordered = sorted(runs, key=lambda r: r["measured"])
    return ordered[(len(ordered) - 1) // 2]


def ratio_figures(report, acceptance, name, measured, simulated, closed_form, uniform) -> None:
    """PACI (`name`) over flush, measured and simulated, and its acceptance: >= 95% of the
    closed form for uniform stages, else of the simulated ratio."""
    ratio = measured[name] / measured["1f1b"]
    simulated_ratio = simulated[name] / simulated["1f1b"]
    suffix = "" if name == "paci" else "_" + name.split(":", 1)[1]
    report["ratio_paci_over_flush" + suffix] = ratio
    report["simulated_ratio_paci_over_flush" + suffix] = simulated_ratio
    report["ratio_over_simulated_ratio" + suffix] = ratio / simulated_ratio
    if uniform:
        report["ratio_over_closed_form" + suffix] = ratio / closed_form
        acceptance["ratio_at_least_95_percent_of_closed_form" + suffix] = (
            ratio >= RATIO_TOLERANCE * closed_form
        )
    acceptance["ratio_at_least_95_percent_of_simulated" + suffix] = (
        ratio >= RATIO_TOLERANCE * simulated_ratio
    )


def slowest_stage_bound(fwd_ms, bwd_ms, num_stages: int, chunks: int = 1) -> float:
    """Microbatches per second of the slowest rank (its chunks' forwards and backwards per
    microbatch)."""
    count = num_stages * chunks
    passes = [
        f + b for f, b in zip(per_stage_seconds(fwd_ms, count), per_stage_seconds(bwd_ms, count))
    ]
    return 1.0 / max(sum(passes[rank::num_stages]) for rank in range(num_stages))


def benchmark(options) -> dict:
    """Run every schedule `options.repeats` times (interleaved, so both see the same machine)
    and report each schedule's median run."""
    n, m = options.stages, options.microbatches
    steady_state_window(n, m, options.steps)  # reject too few steps before launching anything
    uniform = isinstance(options.fwd_ms, (int, float)) and isinstance(options.bwd_ms, (int, float))
    workdir = options.output or tempfile.mkdtemp(prefix="benchmark_schedules_")
    all_runs: dict[str, list[dict]] = {schedule: [] for schedule in options.schedules}
    for repeat in range(options.repeats):
        for schedule in options.schedules:
            run_dir = os.path.join(workdir, f"{schedule.replace(':', '_')}-{repeat}")
            all_runs[schedule].append(run_schedule(schedule, options, run_dir))
    runs = {schedule: median_run(results) for schedule, results in all_runs.items()}
    measured = {s: r["measured"] for s, r in runs.items()}
    simulated = {s: r["simulated"] for s, r in runs.items()}
    errors = {s: r["prediction_error"] for s, r in runs.items()}
    closed_form = (m + n - 1) / m
    overheads = {s: max(r["overhead_us_per_action"]["max"] for r in all_runs[s]) for s in runs}
    report = _report(options, runs, all_runs, measured, simulated, errors, closed_form, overheads)
    acceptance = {
        "prediction_within_5_percent": all(abs(e) <= PREDICTION_TOLERANCE for e in errors.values()),
        "overhead_under_1_ms": all(value < OVERHEAD_LIMIT_US for value in overheads.values()),
    }
    if "1f1b" in measured:
        for name in measured:
            if name.startswith("paci"):
                ratio_figures(report, acceptance, name, measured, simulated, closed_form, uniform)
    report["acceptance"] = acceptance
    report["runs"] = all_runs
    report["output_dir"] = workdir
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def _report(options, runs, all_runs, measured, simulated, errors, closed_form, overheads) -> dict:
    n, m = options.stages, options.microbatches
    return {
        "stages": n,
        "microbatches": m,
        "steps": options.steps,
        "fwd_ms": options.fwd_ms,
        "bwd_ms": options.bwd_ms,
        "noise_cv": options.noise_cv,
        "seed": options.seed,
        "repeats": options.repeats,
        "measured_throughput": measured,
        "simulated_throughput": simulated,
        "prediction_error": errors,
        "ratio_paci_over_flush": None,
        "closed_form_ratio": closed_form,
        "runtime_overhead_us_per_action": {
            s: r["overhead_us_per_action"]["mean"] for s, r in runs.items()
        },
        "runtime_overhead_us_per_action_max": overheads,
        "simulated_throughput_nominal": {s: r["simulated_nominal"] for s, r in runs.items()},
        "simulated_throughput_with_overhead": {
            s: r["simulated_with_overhead"] for s, r in runs.items()
        },
        "virtual_stages": options.virtual_stages,
        "slowest_stage_bound": slowest_stage_bound(
            options.fwd_ms, options.bwd_ms, n, options.virtual_stages
        ),
        "load_average_1min_before_runs": {
            s: [r["load_average_1min_before"] for r in rs] for s, rs in all_runs.items()
        },
        "p2p_latency_ms": {s: r["p2p_latency_ms"] for s, r in runs.items()},
    }
