"""The schedule comparison in miniature: write the runs' case lists, then the figures and report.

Used by `examples/paci/replicate_cpu.sh` (which runs the cases with torchrun in between):

    python tools/replicate.py cases --seed 1 --iterations 150 --runs runs/replicate > cases.json
    python tools/replicate.py report --runs runs/replicate --seeds 1 2 3 \\
        --calibration runs/replicate/calibration.json --output docs/results

Every run trains the same model on the default corpus at the same global batch; the runs differ
only in the schedule: 1F1B-flush, and PACI with accumulation a in {1, 2, 4, 8} (the micro batch
is global batch / a). `report` reads each run's summary.json and timeline.json, and projects
each configuration's time per iteration with the pipeline simulator on per-microbatch costs
measured by tools/calibrate_stage.py.
"""

import argparse
import json
import os
import statistics
import sys

from megatron.common.errors import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = 4
GLOBAL_BATCH = 16
SEQ_LENGTH = 64
# (run name, schedule, microbatches per step: flush's m, PACI's a)
CONFIGS = [("flush", "1f1b", 8)] + [(f"paci_a{a}", "paci", a) for a in (1, 2, 4, 8)]
MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": SEQ_LENGTH}
LOSS_WINDOW = 10  # iterations averaged for the final-loss figure and the smoothed curves


def micro_batch_size(microbatches: int) -> int:
    return GLOBAL_BATCH // microbatches


def training_flags(iterations: int, seed: int, cache: str) -> list[str]:
    """The flags every run shares (the model of MODEL; AdamW with a cosine schedule)."""
    return [
        "--num-layers", str(MODEL["num_layers"]), "--hidden-size", str(MODEL["hidden_size"]),
        "--num-attention-heads", str(MODEL["num_attention_heads"]),
        "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
        "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(iterations),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "10", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--data-path", os.path.join(REPO, "data", "stdlib_text_document"), "--split", "969,30,1",
        "--data-cache-path", cache, "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(REPO, "data", "tokenizer", "stdlib.model"),
        "--pipeline-model-parallel-size", str(STAGES), "--distributed-backend", "gloo",
        "--log-interval", "10", "--eval-interval", str(iterations), "--eval-iters", "10",
        "--seed", str(seed), *embedding_flags(),
    ]  # fmt: skip


def embedding_flags() -> list[str]:
    """Untied embeddings, the only kind PACI runs, where the parser has the switch for it."""
    from megatron.training.arguments import build_parser

    untie = "--untie-embeddings-and-output-weights"
    return [untie] if untie in build_parser()._option_string_actions else []


def run_directory(runs: str, seed: int, name: str) -> str:
    return os.path.join(runs, f"seed{seed}", name)


def write_cases(options: argparse.Namespace) -> int:
    """Print the case list of one seed for tests/functional_tests/multi_run.py."""
    cases = []
    for name, schedule, microbatches in CONFIGS:
        directory = run_directory(options.runs, options.seed, name)
        flags = training_flags(
            options.iterations, options.seed, os.path.join(options.runs, "cache")
        )
        flags += ["--pipeline-schedule", schedule]
        flags += ["--micro-batch-size", str(micro_batch_size(microbatches))]
        flags += ["--timeline-file", os.path.join(directory, "timeline.json")]
        cases.append(
            {"name": f"seed{options.seed}/{name}", "args": flags, "metrics_dir": directory}
        )
    json.dump(cases, sys.stdout, indent=1)
    return 0


# ----------------------------------------------------------------------------- projection
def simulate(schedule: str, microbatches: int, steps: int, costs: list[str], *extra: str) -> dict:
    """tools/simulate_pipeline.py's report for this pipeline, run in this process."""
    import simulate_pipeline

    flags = [
        "--schedule", schedule, "--stages", str(STAGES), "--microbatches", str(microbatches),
        "--steps", str(steps), *costs, *extra,
    ]  # fmt: skip
    return simulate_pipeline.run(simulate_pipeline.parse_args(flags))


def cost_flags(calibration: str, microbatches: int, balanced: bool) -> list[str]:
    """The simulator's cost flags: the calibrated model split over the stages as the run splits
    it, or (balanced) the same total work spread evenly over the stages."""
    size = micro_batch_size(microbatches)
    if not balanced:
        return ["--calibration", calibration, "--micro-batch-size", str(size)]
    profile = next(
        p for p in json.load(open(calibration))["profiles"] if p["micro_batch_size"] == size
    )

    def total(key: str) -> float:
        layers = profile["num_layers"] * profile["layer"].get(key, 0.0)
        ends = sum(profile.get(part, {}).get(key, 0.0) for part in ("embedding", "output"))
        return (layers + ends) / STAGES

    return ["--fwd", str(total("forward_s")), "--bwd", str(total("backward_s")),
            "--step-cost", str(total("step_s"))]  # fmt: skip


def linear_calibration(measured: str, output: str) -> str:
    """A calibration with one profile per micro batch size of CONFIGS, each the largest measured
    profile's forward/backward costs scaled by size (optimizer step unchanged). At these tiny
    shapes the measured costs of small microbatches are dominated by noisy per-call overheads;
    scaling keeps the projection about the schedules' idle time, reproducibly."""
    calibration = json.load(open(measured))
    base = max(calibration["profiles"], key=lambda profile: profile["micro_batch_size"])
    profiles = []
    for size in sorted({micro_batch_size(m) for _, _, m in CONFIGS}):
        factor = size / base["micro_batch_size"]
        profile = json.loads(json.dumps(base))
        profile["micro_batch_size"] = size
        for part in ("layer", "embedding", "output"):
            for key in ("forward_s", "backward_s", "weight_grad_s"):
                if key in profile.get(part, {}):
                    profile[part][key] *= factor
        profile.pop("p2p_s", None)
        profiles.append(profile)
    with open(output, "w") as out:
        json.dump({"profiles": profiles}, out, indent=1)
    return output


def projected_iteration(schedule: str, microbatches: int, calibration: str) -> dict:
    """Steady-state seconds per iteration (difference of a 40- and a 20-step simulation, so the
    pipeline's fill is left out) with the run's stage costs and with balanced stages, and how
    busy the busiest (bottleneck) stage is with the run's stage costs."""
    result = {}
    for balanced in (False, True):
        costs = cost_flags(calibration, microbatches, balanced)
        short, long = (simulate(schedule, microbatches, n, costs) for n in (20, 40))
        seconds = (long["makespan"] - short["makespan"]) / 20
        busy = [
            (b - s) / (20 * seconds)
            for b, s in zip(long["busy_per_stage"], short["busy_per_stage"])
        ]
        result["balanced_seconds" if balanced else "seconds"] = seconds
        result.setdefault("bottleneck_busy", max(busy))
    return result


# ----------------------------------------------------------------------------- statistics
def load_summaries(runs: str, seeds: list[int]) -> dict[str, list[dict]]:
    return {
        name: [
            json.load(open(os.path.join(run_directory(runs, seed, name), "summary.json")))
            for seed in seeds
        ]
        for name, _, _ in CONFIGS
    }


def smoothed(losses: list[float], window: int = LOSS_WINDOW) -> list[float]:
    """Trailing mean over up to `window` iterations."""
    return [statistics.fmean(losses[max(0, i + 1 - window) : i + 1]) for i in range(len(losses))]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def final_loss(summary: dict) -> float:
    return statistics.fmean(summary["loss"][-LOSS_WINDOW:])


def paired_gaps(summaries: list[dict], flush: list[dict]) -> dict:
    """Relative final-loss gap to flush run on the same seed (same data, same initialization)."""
    return spread([final_loss(s) / final_loss(f) - 1 for s, f in zip(summaries, flush)])


def run_statistics(summaries: list[dict]) -> dict:
    final = [final_loss(s) for s in summaries]
    validation = [s["validation"][-1]["lm loss"] for s in summaries]
    stages = summaries[0]["stages"]
    return {
        "final_loss": spread(final),
        "validation_loss": spread(validation),
        "max_drift": [max(s["stages"][i]["max_drift"] for s in summaries) for i in range(STAGES)],
        "mean_drift": [
            statistics.fmean(s["stages"][i]["mean_drift"] for s in summaries) for i in range(STAGES)
        ],
        "peak_activation_mib": [stage["peak_activation_bytes"] / 2**20 for stage in stages],
        "state_mib": [
            (stage["param_bytes"] + stage["grad_bytes"] + stage["optimizer_state_bytes"]) / 2**20
            for stage in stages
        ],
        "peak_inflight": [stage["peak_inflight_microbatches"] for stage in stages],
        "measured_seconds": spread([s["elapsed_s"] for s in summaries]),
    }


def drift_histograms(summaries: list[dict]) -> list[dict[int, int]]:
    """Per stage, the drift histogram of all seeds together."""
    totals = [dict() for _ in range(STAGES)]
    for summary in summaries:
        for stage, data in enumerate(summary["stages"]):
            for drift, count in data["drift_histogram"].items():
                totals[stage][int(drift)] = totals[stage].get(int(drift), 0) + count
    return totals


# ----------------------------------------------------------------------------- figures
def loss_curves(summaries, seconds_per_iteration=None) -> tuple[list[float], list[list[float]]]:
    """x values (tokens, or projected seconds) and the smoothed loss of every seed."""
    iterations = range(1, len(summaries[0]["loss"]) + 1)
    if seconds_per_iteration is None:
        xs = [i * GLOBAL_BATCH * SEQ_LENGTH for i in iterations]
    else:
        xs = [i * seconds_per_iteration for i in iterations]
    return xs, [smoothed(s["loss"]) for s in summaries]


def timeline_figure(options, name: str, schedule: str, microbatches: int, iterations: int) -> str:
    """Measured (seed 1) and simulated (this model's stages; balanced stages) timelines of three
    iterations in mid-run."""
    import plot_results

    measured_path = os.path.join(
        run_directory(options.runs, options.seeds[0], name), "timeline.json"
    )
    measured = plot_results.trace_events(measured_path)
    simulated_path = os.path.join(options.runs, f"simulated_{name}.json")
    simulated = {}
    for balanced in (False, True):
        costs = cost_flags(options.calibration, microbatches, balanced)
        simulate(schedule, microbatches, 8, costs, "--timeline", simulated_path)
        simulated[balanced] = plot_results.trace_events(simulated_path)
    label = f"{name} ({schedule}, {microbatches} microbatches of {micro_batch_size(microbatches)})"
    panels = [
        (f"{label}: measured, iterations {iterations // 2 + 1}-{iterations // 2 + 3}, 4 processes "
         "sharing 2 CPU cores (gaps include waiting for a core)", measured,
         plot_results.step_window(measured, iterations // 2, 3)),
        (f"{label}: simulated with the calibrated costs, one core per stage, steps 4-6",
         simulated[False], plot_results.step_window(simulated[False], 3, 3)),
        (f"{label}: simulated, the same work balanced over the stages, steps 4-6",
         simulated[True], plot_results.step_window(simulated[True], 3, 3)),
    ]  # fmt: skip
    filename = f"timeline_{name}.png"
    plot_results.plot_timelines(panels, os.path.join(options.output, filename))
    return filename


def make_figures(options, summaries, projections) -> dict[str, str]:
    import plot_results

    out = lambda filename: os.path.join(options.output, filename)  # noqa: E731
    plot_results.plot_loss_curves(
        {name: loss_curves(summaries[name]) for name, _, _ in CONFIGS},
        "tokens",
        f"Loss against tokens: median of {len(options.seeds)} seeds, band = min-max",
        out("loss_vs_tokens.png"),
    )
    for key, filename, stages in (
        ("seconds", "loss_vs_projected_time.png", "this model's stages (output layer dominates)"),
        ("balanced_seconds", "loss_vs_projected_time_balanced.png", "the same work, balanced"),
    ):
        plot_results.plot_loss_curves(
            {name: loss_curves(summaries[name], projections[name][key]) for name in projections},
            "projected time (s): pipeline simulator on calibrated CPU costs, one core per stage",
            f"Loss against projected time, {stages} (not measured: see the text)",
            out(filename),
        )
    plot_results.plot_drift_histograms(
        {name: drift_histograms(summaries[name]) for name, schedule, _ in CONFIGS},
        out("drift_histograms.png"),
    )
    plot_results.plot_memory(
        {name: run_statistics(summaries[name]) for name, _, _ in CONFIGS},
        out("memory_per_stage.png"),
    )
    iterations = len(summaries[CONFIGS[0][0]][0]["loss"])
    return {
        name: timeline_figure(options, name, schedule, microbatches, iterations)
        for name, schedule, microbatches in CONFIGS
    }


# ----------------------------------------------------------------------------- report
def fmt_spread(values: dict, digits: int = 3) -> str:
    return f"{values['median']:.{digits}f} [{values['min']:.{digits}f}, {values['max']:.{digits}f}]"


def joined(values, pattern: str = "{}") -> str:
    return " ".join(pattern.format(v) for v in values)


def loss_table(stats: dict) -> list[str]:
    rows = [
        "| run | schedule, microbatches x size | final loss, median [min, max] "
        "| vs flush, same seed: median [min, max] "
        "| validation loss, median [min, max] | max drift by stage | mean drift by stage |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, schedule, microbatches in CONFIGS:
        s = stats[name]
        gap = {key: 100 * value for key, value in s["gap_to_flush"].items()}
        rows.append(
            f"| {name} | {schedule}, {microbatches} x {micro_batch_size(microbatches)} "
            f"| {fmt_spread(s['final_loss'])} "
            f"| {gap['median']:+.2f}% [{gap['min']:+.2f}, {gap['max']:+.2f}] "
            f"| {fmt_spread(s['validation_loss'])} "
            f"| {joined(s['max_drift'])} | {joined(s['mean_drift'], '{:.2f}')} |"
        )
    return rows


def cost_table(stats: dict, projections: dict) -> list[str]:
    flush = projections["flush"]["seconds"]
    balanced = projections["flush"]["balanced_seconds"]
    rows = [
        "| run | projected s/iteration | vs flush | bottleneck stage busy "
        "| balanced stages: s/iteration | vs flush "
        "| peak in-flight by stage | peak activations by stage (MiB) "
        "| params+grads+Adam, largest stage (MiB) "
        "| measured training time (s), median [min, max] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _, _ in CONFIGS:
        s, p = stats[name], projections[name]
        rows.append(
            f"| {name} | {p['seconds']:.4f} | {flush / p['seconds']:.2f}x "
            f"| {100 * p['bottleneck_busy']:.0f}% "
            f"| {p['balanced_seconds']:.4f} | {balanced / p['balanced_seconds']:.2f}x "
            f"| {joined(s['peak_inflight'])} | {joined(s['peak_activation_mib'], '{:.1f}')} "
            f"| {max(s['state_mib']):.2f} | {fmt_spread(s['measured_seconds'], 1)} |"
        )
    return rows


def observations(stats: dict) -> list[str]:
    """Statements computed from the numbers: each PACI run against flush's seed spread."""
    flush = stats["flush"]["final_loss"]
    lines = [
        f"* Flush's final loss varies by {flush['max'] - flush['min']:.3f} across seeds "
        f"({flush['min']:.3f} to {flush['max']:.3f})."
    ]
    for name, schedule, _ in CONFIGS:
        if schedule == "1f1b":
            continue
        loss = stats[name]["final_loss"]
        overlap = loss["min"] <= flush["max"] and flush["min"] <= loss["max"]
        relation = "overlaps flush's seed range" if overlap else "lies outside flush's seed range"
        paired = {key: 100 * value for key, value in stats[name]["gap_to_flush"].items()}
        behind = "behind flush on every seed" if paired["min"] > 0 else "not behind on every seed"
        lines.append(
            f"* {name}: median {loss['median']:.3f}; its seed range {relation}; against flush on "
            f"the same seed {paired['min']:+.2f}% to {paired['max']:+.2f}% ({behind}); max drift "
            f"by stage {joined(stats[name]['max_drift'])}."
        )
    return lines


def calibration_profiles(path: str) -> str:
    calibration = json.load(open(path))
    parts = []
    for profile in calibration["profiles"][-1:]:  # the largest micro batch, the one scaled
        layer, output = profile["layer"], profile["output"]
        parts.append(
            f"* micro batch {profile['micro_batch_size']}: a layer forward/backward "
            f"{1000 * layer['forward_s']:.2f}/{1000 * layer['backward_s']:.2f} ms, output layer "
            f"and loss {1000 * output['forward_s']:.2f}/{1000 * output['backward_s']:.2f} ms"
        )
    return "\n".join(parts)


def readme(options, stats, projections, timelines) -> str:
    return (
        _readme_setup(options, stats)
        + _readme_loss_against_tokens(stats)
        + _readme_loss_against_projected_time(options, stats, projections)
        + _readme_drift_timelines_memory(options, timelines)
    )


def _readme_setup(options, stats) -> str:
    """The page's title, the setup of the runs and the commands that made them."""
    iterations = stats["_iterations"]
    tokens = iterations * GLOBAL_BATCH * SEQ_LENGTH
    commands = "\n".join(options.command)
    return f"""# Results: 1F1B-flush against PACI with a in {{1, 2, 4, 8}}, on CPU

Generated by `examples/paci/replicate_cpu.sh` ({options.date}, {options.machine}). Every number
and figure on this page comes from that run; re-running the script rewrites the page.

**Setup.** GPT ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']},
{MODEL['num_attention_heads']} heads, seq {SEQ_LENGTH}, 8k sentencepiece vocabulary, untied
embeddings) on the default corpus (the Python standard library's sources, `make data`),
{STAGES} pipeline stages on {STAGES} processes (gloo), global batch
{GLOBAL_BATCH} sequences for every run, so every run sees the same tokens
in the same order for a given seed. AdamW (betas 0.9/0.95, weight decay 0.1), peak LR 1e-3 with
10 warmup iterations and cosine decay to 1e-4, clip-grad 1.0, {iterations} iterations
({tokens:,} tokens), seeds {', '.join(map(str, options.seeds))} (the seed sets the
initialization and the data order). Runs: `flush` is 1F1B-flush with m = 8 microbatches of 2;
`paci_aA` is PACI (reactive order) with a = A microbatches of {GLOBAL_BATCH}/A per step.

## Commands

```bash
{commands}
```

"""


def _readme_loss_against_tokens(stats) -> str:
    return f"""## Loss against tokens

![loss against tokens](loss_vs_tokens.png)

Final loss = mean training loss of the last {LOSS_WINDOW} iterations; validation loss at the end
({'10'} batches of the validation split). Median over seeds, [min, max] in brackets. Drift per
stage over all seeds.

{chr(10).join(loss_table(stats))}

{chr(10).join(observations(stats))}

"""


def _readme_loss_against_projected_time(options, stats, projections) -> str:
    return f"""## Loss against projected time

![loss against projected time](loss_vs_projected_time.png)

![loss against projected time, balanced stages](loss_vs_projected_time_balanced.png)

The x axis is **projected, not measured**: four processes share two cores here, so wall time
says nothing about the schedules. Each run's seconds per iteration come from the pipeline
simulator (`tools/simulate_pipeline.py`, the same schedule code the runtime runs), steady state,
with per-microbatch forward/backward/step costs of this model measured on one core by
`tools/calibrate_stage.py`, i.e. what a machine with one core per stage would take, without
communication. Measured at micro batch {GLOBAL_BATCH}:

{calibration_profiles(options.calibration)}

and scaled in proportion to the micro batch size for the smaller microbatches (the optimizer
step unchanged). At these tiny shapes the measured costs of small microbatches are dominated by
per-call overheads that vary by 50% from one measurement to the next on this shared machine;
scaling leaves them out, so the projection shows the schedules' idle time only, not how a
device's efficiency changes with the microbatch size (which would favour small a). The last
stage carries the output layer and loss over an 8k vocabulary, which dominates the costs, so it
is the bottleneck and flush's bubble costs little: it is the other stages that wait. The second
figure and the "balanced stages" columns spread the same total work evenly over the 4 stages,
as a pipeline split for balance would (the PACI paper's 8 stages of 3 GPT-2 Medium layers are
close to it); there flush idles `(N - 1) / (m + N - 1)` = 3/11 of each step. The costs are
measured afresh each time the script runs and move with the machine's load: while this page was
being prepared (2026-11-30, shared 2-core machine) four measurements put flush between 0.110 and
0.135 s per iteration, and the ratios between the runs moved by at most 0.02.

{chr(10).join(cost_table(stats, projections))}

Measured training time is listed for completeness only (2 shared cores, other jobs running).

"""


def _readme_drift_timelines_memory(options, timelines) -> str:
    figures = "\n\n".join(f"![{name} timeline]({filename})" for name, filename in timelines.items())
    return f"""## Drift

![drift histograms](drift_histograms.png)

The fraction of microbatches whose backward ran that many optimizer steps after their forward,
per stage (all seeds). PACI's bound is `ceil((N - i) / a)` on stage i of N = {STAGES}; flush
never drifts.

## Timelines

One figure per run: three measured iterations in mid-run (seed {options.seeds[0]}), above the
simulator's timelines with the calibrated costs of this model's stages and with the same work
balanced over the stages.

{figures}

## Memory per stage

![memory per stage](memory_per_stage.png)

Measured by the runtime (seed {options.seeds[0]}): activations saved for backward at their
peak, and parameter, gradient and Adam state bytes. At the same global batch a smaller a means
larger microbatches, so more activation memory per in-flight microbatch; PACI holds the same
number of microbatches in flight as flush (1F1B's `N - s` on stage s) and no extra weight
version.
"""


def write_report(options: argparse.Namespace) -> int:
    os.makedirs(options.output, exist_ok=True)
    summaries = load_summaries(options.runs, options.seeds)
    measured_calibration = options.calibration
    options.calibration = linear_calibration(
        measured_calibration, os.path.join(options.runs, "calibration_scaled.json")
    )
    projections = {
        name: projected_iteration(schedule, microbatches, options.calibration)
        for name, schedule, microbatches in CONFIGS
    }
    stats = {name: run_statistics(summaries[name]) for name, _, _ in CONFIGS}
    for name in stats:
        stats[name]["gap_to_flush"] = paired_gaps(summaries[name], summaries["flush"])
    timelines = make_figures(options, summaries, projections)
    stats["_iterations"] = len(summaries["flush"][0]["loss"])
    options.calibration = measured_calibration
    with open(os.path.join(options.output, "README.md"), "w") as out:
        out.write(readme(options, stats, projections, timelines))
    results = {"statistics": stats, "projections": projections, "seeds": options.seeds}
    with open(os.path.join(options.output, "results.json"), "w") as out:
        json.dump(results, out, indent=1)
    print("\n".join(loss_table(stats) + [""] + cost_table(stats, projections)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command_name", required=True)
    cases = commands.add_parser("cases", help="print one seed's case list (JSON)")
    cases.add_argument("--seed", type=int, required=True)
    cases.add_argument("--iterations", type=int, required=True)
    cases.add_argument("--runs", required=True)
    report = commands.add_parser("report", help="figures, README.md and results.json")
    report.add_argument("--runs", required=True)
    report.add_argument("--seeds", type=int, nargs="+", required=True)
    report.add_argument("--calibration", required=True)
    report.add_argument("--output", required=True)
    report.add_argument("--command", action="append", default=[], help="commands to cite")
    report.add_argument("--date", default="")
    report.add_argument("--machine", default="")
    options = parser.parse_args(argv)
    return write_cases(options) if options.command_name == "cases" else write_report(options)


if __name__ == "__main__":
    sys.exit(run_tool(main))
