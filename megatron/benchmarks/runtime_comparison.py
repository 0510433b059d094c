"""Every schedule the runtime runs, measured side by side on one model's stage costs.

`tools/benchmark_schedules.py --model NAME` is its command line. For each schedule it launches
`pretrain_gpt.py` (torchrun, gloo, one process per rank) with emulated stages
(`megatron.model.emulated_stage`) that sleep for the schedule's own per-virtual-stage costs from
the comparison's FLOP model (`comparison.virtual_stage_costs`: forward, input gradient and
weight gradient per virtual stage, for the schedule's placement; a schedule that does not split
its backward sleeps both gradient parts in one pass), scaled to `ms_per_layer` milliseconds per
layer forward. So every schedule does the same work per microbatch, and the runtime's split
backward, paired slots and V placement run for real.

Per schedule it reports:

* **measured pace**: microbatches per second in the steady state over the physical limit (the
  total work of a microbatch over the ranks: no bubble, a perfect split). The steady state is
  measured the same way for every schedule, from the trace: per rank, the time its last pass of
  step k ends (`step_completions`); the pace is (steps between step 1 and the last step before
  the drain) x m over that span, averaged over the ranks;
* **replay**: the simulator on the costs and point-to-point latency measured in the run's own
  trace, measured the same way (how far the runtime is from the schedule's ideal on this
  machine);
* **projected pace**: `comparison.compare` on the nominal costs, no communication;
* **peak activations**: the most microbatch-chunks a rank held (summary.json), in whole-stage
  microbatches (a chunk holds 1/v), against the projection's.
"""

import dataclasses
import json
import os
import statistics
import tempfile

from megatron.pipeline.schedules import VIRTUAL_STAGE_SCHEDULES
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.vocab_passes import splits_input, with_vocab_passes
from megatron.pipeline.simulation.engine import simulate
from megatron.pipeline.trace import read_chrome_trace

from .comparison import MODELS, compare, virtual_stage_costs, vocab_pass_costs
from .emulated_benchmark import (
    PRETRAIN_SCRIPT,
    emulated_run_args,
    estimate_p2p_latency,
    launch,
    torchrun_command,
)

# --model runs: the runtime's name of each compared schedule and its chunks per rank (None:
# the model's interleaved v)
RUNTIME_NAMES = {
    "1f1b": ("1f1b", 1),
    "interleaved-1f1b": ("1f1b", None),
    "zb-h1": ("zb-h1", 1),
    "zb-v": ("zb-v", 2),
    "dualpipe-v": ("dualpipe-v", 2),
    "zb-interleaved": ("zb-interleaved", 2),
    "2bw": ("2bw", 1),
    "pipedream": ("pipedream", 1),
    "paci": ("paci", 1),
    "paci-interleaved": ("paci", None),
    # the output layer split by vocabulary over the ranks (--enable-vocab-parallel)
    "1f1b+vocab": ("1f1b", 1),
    "zb-h1+vocab": ("zb-h1", 1),
    "paci+vocab": ("paci", 1),
}
VOCAB_SUFFIX = "+vocab"


def splits_vocabulary(schedule: str) -> bool:
    return schedule.endswith(VOCAB_SUFFIX)


def base_schedule(schedule: str) -> str:
    """The comparison's schedule name of a compared entry ("paci+vocab" -> "paci")."""
    return schedule.removesuffix(VOCAB_SUFFIX)


def model_for(model, schedule: str):
    """The model as the entry runs it: with the vocabulary split for a "+vocab" entry."""
    return dataclasses.replace(model, vocab_parallel=splits_vocabulary(schedule))


def definition_of(schedule: str):
    """The simulator's definition of a compared entry (with the vocabulary passes for a
    "+vocab" one)."""
    from megatron.pipeline.schedules import SIMULATED_SCHEDULES

    definition = SIMULATED_SCHEDULES[base_schedule(schedule)]
    if not splits_vocabulary(schedule):
        return definition
    return with_vocab_passes(definition, splits_input(definition))


def schedule_costs_ms(model, schedule: str, chunks: int, ms_per_layer: float) -> dict:
    """Per virtual stage forward, full backward and weight-gradient milliseconds of `schedule`
    (its placement) on `model`; per rank VF and VB of a "+vocab" entry (else 0)."""
    definition, split = definition_of(schedule), splits_vocabulary(schedule)
    placed = definition.placement is not None
    shape = definition.placement(model.ranks, chunks).shape if placed else "interleaved"
    model = model_for(model, schedule)
    forward, backward, wgrad = virtual_stage_costs(model, chunks, shape, vocab_passes=split)
    vocab_forward, vocab_backward = vocab_pass_costs(model) if split else (0.0, 0.0)
    scale = lambda values: [round(ms_per_layer * v, 4) for v in values]  # noqa: E731
    return {
        "forward": scale(forward),
        "backward": scale([b + w for b, w in zip(backward, wgrad)]),  # B + W: the full pass
        "weight_grad": scale(wgrad),
        "vocab_forward": round(ms_per_layer * vocab_forward, 4),
        "vocab_backward": round(ms_per_layer * vocab_backward, 4),
    }


def microbatch_ms(costs_ms: dict, ranks: int) -> float:
    """The whole work of one microbatch, every rank's share: the physical limit's unit."""
    passes = sum(costs_ms["forward"]) + sum(costs_ms["backward"])
    return passes + ranks * (costs_ms["vocab_forward"] + costs_ms["vocab_backward"])


_EMBEDDING_PASSES = (ActionKind.EMBED_FORWARD, ActionKind.EMBED_BACKWARD)


def step_completions(events, microbatches: int) -> dict[int, dict[int, float]]:
    """Per rank, step k -> when its last pass of step k's microbatches ended (the input
    embedding's lookups and gradients left out: they run ahead of and behind the rank's own
    work, as the first stage needs and sends them)."""
    done: dict[int, dict[int, float]] = {}
    for event in events:
        for part in event.action.passes:
            if part.microbatch is None or part.kind in _EMBEDDING_PASSES:
                continue
            step = part.microbatch // microbatches
            ends = done.setdefault(event.stage, {})
            ends[step] = max(ends.get(step, 0.0), event.end_s)
    return done


def steady_pace(events, microbatches: int, steps: int) -> float:
    """Microbatches per second between the end of step 1 and of the last step before the
    drain, averaged over the ranks."""
    first, last = 1, steps - 2
    if last <= first:
        raise ValueError(f"{steps} steps leave no steady state (at least 4 are needed)")
    spans = [ends[last] - ends[first] for ends in step_completions(events, microbatches).values()]
    return (last - first) * microbatches / statistics.fmean(spans)


def measured_pass_costs(events, placement, num_virtual: int, nominal: dict) -> dict:
    """Per virtual stage mean seconds of single passes in the trace (slots of several passes
    left out), F, B and W apart; the nominal value where a stage ran none alone."""
    durations: dict[tuple[ActionKind, int], list[float]] = {}
    for event in events:
        action = event.action
        if action.together or action.microbatch is None:
            continue
        chunk = action.chunk or 0
        stage = event.stage if placement is None else placement.virtual_stage(event.stage, chunk)
        durations.setdefault((action.kind, stage), []).append(event.duration_s)

    def means(kind, fallback):
        return [
            statistics.fmean(durations[(kind, k)]) if durations.get((kind, k)) else f
            for k, f in zip(range(num_virtual), fallback)
        ]

    costs = {
        "forward_cost": means(ActionKind.FORWARD, nominal["forward_cost"]),
        "backward_cost": means(ActionKind.BACKWARD, nominal["backward_cost"]),
        "weight_grad_cost": means(ActionKind.WEIGHT_GRAD, nominal["weight_grad_cost"]),
    }
    per_rank = {  # the rank is the stage of a one-chunk plan
        "vocab_forward_cost": ActionKind.VOCAB_FORWARD,
        "vocab_backward_cost": ActionKind.VOCAB_BACKWARD,
        "embed_forward_cost": ActionKind.EMBED_FORWARD,
        "embed_backward_cost": ActionKind.EMBED_BACKWARD,
    }
    for name, kind in per_rank.items():
        if name in nominal:
            costs[name] = means(kind, nominal[name])
    return costs


def _nominal_seconds(costs_ms: dict, splits: bool, ranks: int = 0, embedding=False) -> dict:
    """The simulator's costs in seconds; with `ranks`, also every rank's VF and VB (and with
    `embedding` its EF and EB, nominally free: a lookup and its gradient)."""
    forward = [f / 1000 for f in costs_ms["forward"]]
    if splits:
        backward = [(b - w) / 1000 for b, w in zip(costs_ms["backward"], costs_ms["weight_grad"])]
        wgrad = [w / 1000 for w in costs_ms["weight_grad"]]
    else:
        backward, wgrad = [b / 1000 for b in costs_ms["backward"]], [0.0] * len(forward)
    costs = {"forward_cost": forward, "backward_cost": backward, "weight_grad_cost": wgrad}
    if ranks:
        costs["vocab_forward_cost"] = [costs_ms["vocab_forward"] / 1000] * ranks
        costs["vocab_backward_cost"] = [costs_ms["vocab_backward"] / 1000] * ranks
    if ranks and embedding:
        costs["embed_forward_cost"] = costs["embed_backward_cost"] = [0.0] * ranks
    return costs


def _replay(schedule: str, name: str, chunks: int, events, costs_ms, n: int, m: int, steps: int):
    """The simulator on the costs and the p2p latency a run's trace measured."""
    from megatron.pipeline.plan import resolve_plan

    definition = definition_of(schedule)
    plan = resolve_plan(name, num_stages=n, chunks_per_rank=chunks if chunks > 1 else None)
    ranks = n if definition.vocab_passes else 0
    nominal = _nominal_seconds(costs_ms, definition.splits_backward, ranks,
                               definition.embedding_passes)  # fmt: skip
    replay_costs = measured_pass_costs(events, plan.placement, n * chunks, nominal)
    return simulate(
        definition,
        num_stages=n,
        microbatches_per_step=m,
        steps=steps,
        p2p_latency=estimate_p2p_latency_on(events, plan.placement),
        chunks_per_rank=chunks if definition.placement is not None else None,
        record_timeline=True,
        **replay_costs,
    )


def run_one(model, schedule: str, options, run_dir: str) -> dict:
    """One emulated run of `schedule` on `model`'s costs and its figures."""
    name, chunks = RUNTIME_NAMES[schedule]
    chunks = model.interleaved_chunks if chunks is None else chunks
    costs_ms = schedule_costs_ms(model, schedule, chunks, options.ms_per_layer)
    os.makedirs(run_dir, exist_ok=True)
    timeline = os.path.join(run_dir, "timeline.json")
    n, m, steps = model.ranks, options.microbatches, options.steps
    extra = ["--emulated-weight-grad-ms", ",".join(map(str, costs_ms["weight_grad"]))]
    if splits_vocabulary(schedule):
        extra += ["--enable-vocab-parallel",
                  "--emulated-vocab-forward-ms", str(costs_ms["vocab_forward"]),
                  "--emulated-vocab-backward-ms", str(costs_ms["vocab_backward"])]  # fmt: skip
    args = emulated_run_args(
        schedule=name,
        stages=n,
        microbatches=m,
        fwd_ms=costs_ms["forward"],
        bwd_ms=costs_ms["backward"],
        steps=steps,
        metrics_dir=run_dir,
        timeline_file=timeline,
        extra=extra,
        virtual_stages=chunks if name in VIRTUAL_STAGE_SCHEDULES else 1,
    )
    if name not in VIRTUAL_STAGE_SCHEDULES:  # its own placement: the layers of its chunks
        args[args.index("--num-layers") + 1] = str(n * chunks)
    launch(
        torchrun_command(n, PRETRAIN_SCRIPT, args),
        os.path.join(run_dir, "log.txt"),
        options.timeout,
    )
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    events = read_chrome_trace(timeline)
    replay = _replay(schedule, name, chunks, events, costs_ms, n, m, steps)
    limit = n / microbatch_ms(costs_ms, n) * 1000
    measured = steady_pace(events, m, steps)
    replayed = steady_pace(replay.timeline, m, steps)
    projected = compare(model_for(model, schedule), base_schedule(schedule), chunks, m)
    peaks = [stage["peak_inflight_microbatches"] / chunks for stage in summary["stages"]]
    return {
        "schedule": schedule,
        "chunks_per_rank": chunks,
        "measured_microbatches_per_s": measured,
        "measured_pace": measured / limit,
        "replay_microbatches_per_s": replayed,
        "measured_over_replay": measured / replayed,
        "projected_pace": projected.pace,
        "peak_activations": max(peaks),
        "projected_peak_activations": projected.peak_activations,
        "max_drift": max(stage["max_drift"] for stage in summary["stages"]),
        "weight_copies": projected.weight_copies,
        "physical_limit_microbatches_per_s": limit,
        "costs_ms": costs_ms,
        "run_dir": run_dir,
    }


def estimate_p2p_latency_on(events, placement) -> float:
    """The emulation's p2p latency estimate (it reads virtual stages in the interleaved
    placement; on the V its estimate is left out: 0)."""
    if placement is not None and placement.shape == "v":
        return 0.0
    chunks = 1 if placement is None else placement.chunks_per_rank
    return estimate_p2p_latency(events, chunks)


def compare_in_runtime(options) -> dict:
    """Run every schedule of `options.schedules` on `options.model` and tabulate them."""
    model = MODELS[options.model]
    workdir = options.output or tempfile.mkdtemp(prefix="runtime_comparison_")
    rows = [
        run_one(model, schedule, options, os.path.join(workdir, schedule))
        for schedule in options.schedules
    ]
    report = {
        "model": model.name,
        "ranks": model.ranks,
        "microbatches": options.microbatches,
        "steps": options.steps,
        "ms_per_layer": options.ms_per_layer,
        "rows": rows,
        "table_markdown": markdown(rows),
        "output_dir": workdir,
    }
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def markdown(rows: list[dict]) -> str:
    lines = [
        "| schedule | chunks/rank | measured microbatches/s | measured pace | replay on the "
        "run's costs | projected pace | peak activations (measured / projected) | drift |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['chunks_per_rank']} | {r['measured_microbatches_per_s']:.2f}"
            f" | {r['measured_pace']:.3f} | {r['measured_over_replay']:.3f} of "
            f"{r['replay_microbatches_per_s']:.2f} | {r['projected_pace']:.3f} | "
            f"{r['peak_activations']:g} / {r['projected_peak_activations']:g} | "
            f"{r['max_drift']} |"
        )
    return "\n".join(lines)
