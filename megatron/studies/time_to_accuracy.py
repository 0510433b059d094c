"""Time to accuracy: iterations to a target validation loss, per schedule and optimizer,
combined with the simulator's per-iteration time at the paper's scale.

The runs train the CPU demo's model (`examples/paci/demo_cpu.sh`: 4 layers, hidden 128, 4
stages on 4 processes, micro batch 4, global batch 16, so a = 4) on the default corpus and
evaluate every `eval_interval` iterations. A configuration is a schedule plus flags (optimizer,
LR, mitigations); each runs with several seeds (initial weights and data order).

Iterations to a target: the first evaluation at or below the target, linearly interpolated
with the evaluation before it (the curve between two evaluations is not measured; the
interpolation only removes the eval-interval staircase). A run that never reaches it counts as
not reached.

Projected time to accuracy at the paper's scale (GPT-2 Medium, 8 stages, global batch 128 and
256): (iterations of the configuration / iterations of the best flush configuration) times
(the best flush's / the best PACI's per-sample time from the projection). It assumes that the
iteration ratio measured here carries over to that scale: it is a projection, not a
measurement.
"""

import functools
import json
import os
import statistics
import subprocess
from dataclasses import dataclass, field

from megatron.common.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What both study models train with: 4 stages, micro batch 4, global batch 16 (a = 4), AdamW
# 0.9/0.95 with weight decay 0.1, cosine decay, clipping at 1, no dropout.
RECIPE = [
    "--micro-batch-size", "4", "--global-batch-size", "16",
    "--lr-decay-style", "cosine",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--split", "969,30,1", "--tokenizer-type", "SentencePieceTokenizer",
    "--pipeline-model-parallel-size", "4", "--untie-embeddings-and-output-weights",
]  # fmt: skip


def study_model(hidden: int, seq: int, data: str, tokenizer_model: str,
                layers: int = 4) -> list[str]:  # fmt: skip
    """A GPT of `layers` layers of width `hidden` on the corpus under the prefix `data`, with
    RECIPE."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--ffn-hidden-size", str(4 * hidden),
        "--num-attention-heads", "4", "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
        "--data-path", f"{data}/stdlib_text_document", "--data-cache-path", f"{data}/cache",
        "--tokenizer-model", tokenizer_model, *RECIPE,
    ]  # fmt: skip


DEMO_MODEL = study_model(128, 128, "data", "data/tokenizer/stdlib.model") + [
    "--distributed-backend",
    "gloo",
]
NUM_PROCESSES = 4

# The long-horizon study's model, sized for the single-process engine on one shared CPU core
# (about 40 ms an iteration): the demo's shape at half the width and a quarter of the
# sequence, on the default corpus tokenized with a 1,024-token SentencePiece model (8k logits
# would cost more than the 4 layers). Build its data with the commands of docs/convergence.md.
SMALL_DATA = "runs/data_v1k"
SMALL_MODEL = study_model(64, 32, SMALL_DATA, f"{SMALL_DATA}/tokenizer/stdlib1k.model")
# The MoE study's model: the small model with each FFN an MoE layer of 8 experts, top-2 routing
# with the auxiliary load-balancing loss; each expert is half the dense FFN's width, so a
# token's two experts cost what the dense FFN costs.
SMALL_MOE_MODEL = SMALL_MODEL + [
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
]  # fmt: skip
# The scale check's models: the small model widened to about 2x and 4x its parameters (hidden
# 96: 1.9x, hidden 144: 3.9x, the 1,024-token embedding and output layer counted), same data.
SMALL_2X_MODEL = study_model(96, 32, SMALL_DATA, f"{SMALL_DATA}/tokenizer/stdlib1k.model")
SMALL_4X_MODEL = study_model(144, 32, SMALL_DATA, f"{SMALL_DATA}/tokenizer/stdlib1k.model")
# The depth check's model: 16 layers of hidden 112 (8.0x the small model's parameters: 4x its
# depth, 1.75x its width), for 4 stages (4 layers each) or 8 (2 each, with
# --pipeline-model-parallel-size=8 among a configuration's flags).
DEEP_8X_MODEL = study_model(112, 32, SMALL_DATA, f"{SMALL_DATA}/tokenizer/stdlib1k.model", 16)
MODELS = {
    "demo": DEMO_MODEL + ["--lr-warmup-iters", "10"],
    "small": SMALL_MODEL,
    "small-moe": SMALL_MOE_MODEL,
    "small-2x": SMALL_2X_MODEL,
    "small-4x": SMALL_4X_MODEL,
    "deep-8x": DEEP_8X_MODEL,
}


def parameter_count(flags: list[str]) -> int:
    """A study model's parameters by the GPT's closed form, from its flags: per layer
    12h^2 + 13h (attention and a 4h MLP with biases, two norms), the token and position
    embeddings, the untied output layer and the final norm (what the built model counts)."""

    def value(name: str) -> int:
        return int(flags[flags.index(name) + 1])

    hidden, layers, vocabulary = value("--hidden-size"), value("--num-layers"), 1024
    assert value("--ffn-hidden-size") == 4 * hidden and "--num-experts" not in flags
    per_layer = 12 * hidden * hidden + 13 * hidden
    return layers * per_layer + (2 * vocabulary + value("--seq-length") + 2) * hidden


@dataclass(frozen=True)
class Configuration:
    """A schedule with its optimizer, LR and mitigation flags."""

    name: str
    schedule: str
    lr: float
    flags: tuple = ()

    def args(self, iterations: int, eval_interval: int, seed: int, *, model: str = "demo",
             eval_iters: int = 5, warmup_iters: int | None = None) -> list[str]:  # fmt: skip
        """The run's flags; the configuration's own flags last, so they override (e.g. a
        shorter --train-iters for the same tokens)."""
        warmup = [] if warmup_iters is None else ["--lr-warmup-iters", str(warmup_iters)]
        return MODELS[model] + warmup + [
            "--pipeline-schedule", self.schedule,
            "--lr", str(self.lr), "--min-lr", str(self.lr / 10),
            "--train-iters", str(iterations), "--eval-interval", str(eval_interval),
            "--eval-iters", str(eval_iters), "--log-interval", str(eval_interval),
            "--seed", str(seed),
            *self.flags,
        ]  # fmt: skip


def parse_configuration(text: str) -> Configuration:
    """'NAME=SCHEDULE:LR[:flag,flag,...]', e.g. 'paci-ef=paci:1e-3:--async-error-feedback'.
    Flags with values are written with '=': '--optimizer=muon'; a value's own commas as ';'
    ('--paci-accumulation-schedule=8:100;6:100')."""
    name, _, spec = text.partition("=")
    parts = spec.split(":", 2)
    if not name or len(parts) < 2:
        raise ValueError(f"configuration {text!r}: expected NAME=SCHEDULE:LR[:FLAGS]")
    flags = []
    for flag in parts[2].split(",") if len(parts) == 3 and parts[2] else []:
        flags.extend(part.replace(";", ",") for part in flag.split("=", 1))
    return Configuration(name, parts[0], float(parts[1]), tuple(flags))


@dataclass
class Run:
    configuration: str
    seed: int
    validation: list = field(default_factory=list)  # [(iteration, lm loss)]
    tokens: list = field(default_factory=list)  # tokens consumed at each evaluation
    args: list = field(default_factory=list)  # the run's flags (single-process runs)
    # the engine's final evaluation on the validation split's first batches (None: not made)
    final_validation: float | None = None

    @property
    def by_tokens(self) -> list[tuple[int, float]]:
        return [(t, loss) for t, (_, loss) in zip(self.tokens, self.validation)]


def run_directory(output: str, configuration: str, seed: int) -> str:
    return os.path.join(output, f"{configuration}-seed{seed}")


def run_all(configurations, seeds, iterations, eval_interval, output) -> list[Run]:
    """Every (configuration, seed) without a summary yet, in one torchrun launch; then every
    run's validation curve (already finished runs are reused: the study resumes)."""
    todo = []  # seed-major: a cut-short study still has every configuration at its first seeds
    for seed in seeds:
        for config in configurations:
            directory = run_directory(output, config.name, seed)
            if not os.path.exists(os.path.join(directory, "summary.json")):
                todo.append({"name": f"{config.name} seed {seed}", "metrics_dir": directory,
                             "args": config.args(iterations, eval_interval, seed)})  # fmt: skip
    if todo:
        _launch(todo, output)
    return [_read_run(output, c.name, s) for c in configurations for s in seeds]


def _launch(cases: list[dict], output: str) -> None:
    os.makedirs(output, exist_ok=True)
    spec = os.path.join(output, "cases.json")
    with open(spec, "w") as f:
        json.dump(cases, f)
    command = [
        os.path.join(REPO, ".venv", "bin", "torchrun"), "--standalone",
        f"--nproc-per-node={NUM_PROCESSES}",
        os.path.join(REPO, "tools", "run_pretrain_cases.py"), spec,
    ]  # fmt: skip
    log = os.path.join(output, "log.txt")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "a") as f:
        completed = subprocess.run(command, cwd=REPO, env=environment, stdout=f, stderr=f)
    if completed.returncode != 0:
        raise RuntimeError(f"the runs failed (exit {completed.returncode}): see {log}")


def check_model_data(model: str) -> None:
    """The small models read a corpus that `make data-small` builds: one line if it is not."""
    dataset = f"{SMALL_DATA}/stdlib_text_document"
    if model != "demo" and not os.path.exists(dataset + ".idx"):
        raise UserError(
            f"--model {model} reads {dataset}, which is not built: run `make data-small` first"
        )


def run_all_single_process(configurations, seeds, output, *, log=print, **run_options):
    """`run_all` with the single-process engine (`single_process_engine`), one run after the
    other in this process; `run_options` go to `Configuration.args`. Each finished run writes
    its summary.json at once, so a cut-short study resumes where it stopped, and a run in
    progress goes on from its checkpoint."""
    from megatron.studies.single_process_engine import parse_engine_args, resumable, train
    from megatron.training.config import RunConfig

    check_model_data(run_options.get("model", "demo"))
    exit_interval = run_options.pop("exit_interval", None)
    stopped = {}  # runs --exit-interval stopped: (name, seed) -> Run so far
    for seed in seeds:  # seed-major, as run_all
        for config in configurations:
            directory = run_directory(output, config.name, seed)
            if os.path.exists(os.path.join(directory, "summary.json")):
                continue
            flags = config.args(seed=seed, **run_options)
            stop = ["--exit-interval", str(exit_interval)] if exit_interval else []
            os.makedirs(directory, exist_ok=True)
            # a stopped run goes on from its last drain point's checkpoint (at most ten
            # minutes of training lost), with the numbers of an uninterrupted run; the
            # schedules that stash weight versions have none and start over
            args = parse_engine_args(flags + stop)
            checkpoint = os.path.join(directory, "checkpoint.pt")
            if not resumable(RunConfig.from_args(args)):
                checkpoint = None
                log(f"{config.name} seed {seed}: no checkpoint (the schedule stashes weights)")
            result = train(
                args,
                checkpoint=checkpoint,
                log=lambda line: log(f"{config.name} seed {seed}: {line}"),
            )
            if result.stopped_at is not None:  # no summary: the next call goes on
                log(f"{config.name} seed {seed}: stopped at iteration {result.stopped_at}")
                curve = [(e["iteration"], e["lm loss"]) for e in result.validation]
                stopped[config.name, seed] = Run(config.name, seed, curve, [], flags)
                continue
            summary = {**result.to_dict(), "args": flags}
            with open(os.path.join(directory, "summary.json.tmp"), "w") as f:
                json.dump(summary, f)
            os.replace(os.path.join(directory, "summary.json.tmp"),
                       os.path.join(directory, "summary.json"))  # fmt: skip
            if checkpoint and os.path.exists(checkpoint):
                os.remove(checkpoint)
            final = result.final_validation
            log(f"{config.name} seed {seed}: final validation {final or float('nan'):.4f}, "
                f"{summary['cpu_s']:.0f} s CPU, {result.wall_s:.0f} s wall")  # fmt: skip
    return [stopped.get((c.name, s)) or _read_run(output, c.name, s)
            for c in configurations for s in seeds]  # fmt: skip


def _read_run(output: str, configuration: str, seed: int) -> Run:
    with open(os.path.join(run_directory(output, configuration, seed), "summary.json")) as f:
        summary = json.load(f)
    curve = [(entry["iteration"], entry["lm loss"]) for entry in summary["validation"]]
    tokens = [entry.get("tokens") for entry in summary["validation"]]
    return Run(configuration, seed, curve, tokens if None not in tokens else [],
               summary.get("args", []), summary.get("final_validation"))  # fmt: skip


def iterations_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """First crossing of `target`, interpolated linearly from the evaluation before it."""
    previous = None
    for iteration, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(iteration)
            (i0, _), fraction = previous, (previous[1] - target) / (previous[1] - loss)
            return i0 + fraction * (iteration - i0)
        previous = (iteration, loss)
    return None


def spread(values: list[float]) -> dict | None:
    """Median and range; None when a seed did not reach (the median would hide it)."""
    if not values or any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def final_losses(runs: list[Run]) -> list[float]:
    """Each run's final validation loss: its final evaluation on the split's first batches when
    every run has one (the same batches for all), else its last periodic evaluation (which reads
    the same batches as another run's only where both evaluated as often)."""
    if all(r.final_validation is not None for r in runs):
        return [r.final_validation for r in runs]
    return [r.validation[-1][1] for r in runs]


def iteration_table(runs: list[Run], targets: list[float]) -> dict:
    """{configuration: {"final": spread of the final validation loss (`final_losses`),
    str(target): spread of the iterations to it, f"{target} tokens": of the tokens to it (runs
    that count them)}}."""
    table = {}
    finals = dict(zip(map(id, runs), final_losses(runs)))
    for name in dict.fromkeys(r.configuration for r in runs):
        mine = [r for r in runs if r.configuration == name]
        entry = {"final": spread([finals[id(r)] for r in mine]), "seeds": len(mine)}
        for target in targets:
            reached = [iterations_to(r.validation, target) for r in mine]
            entry[str(target)] = spread(reached)
            entry[f"{target} reached"] = sum(v is not None for v in reached)
            if all(r.tokens for r in mine):
                entry[f"{target} tokens"] = spread([iterations_to(r.by_tokens, target)
                                                    for r in mine])  # fmt: skip
        table[name] = entry
    return table


def paired_gaps(runs: list[Run], name: str, reference: str) -> dict | None:
    """Final validation loss (`final_losses`) of `name` over `reference`'s on the same seed,
    minus one: spread over the seeds both have."""
    pair = [r for r in runs if r.configuration in (name, reference)]
    finals = {(r.configuration, r.seed): loss for r, loss in zip(pair, final_losses(pair))}
    seeds = sorted(s for (c, s) in finals if c == name and (reference, s) in finals)
    return spread([finals[(name, s)] / finals[(reference, s)] - 1 for s in seeds])


def projected_speed(schedules=("1f1b", "paci"), global_batches=(128, 256)) -> dict:
    """{schedule: {global batch: its best samples/s over the best flush's}} from the paper-scale
    projection with its default assumptions (docs/projection.md, row A)."""
    from megatron.benchmarks import projection

    options = projection.parse_args([
        "--global-batch-sizes", ",".join(map(str, global_batches)),
        "--schedules", ",".join(dict.fromkeys(("1f1b", *schedules))),
    ])  # fmt: skip
    summary = projection.run(options)["summary"]
    return {
        name: {int(gb): e[f"best_{name}"]["samples_per_s"] / e["best_1f1b"]["samples_per_s"]
               for gb, e in summary.items()}
        for name in schedules
    }  # fmt: skip


def synchronous_iterations(config: Configuration, iterations: float, total: int) -> float:
    """Of the first `iterations`, how many run synchronously (flush) under the configuration's
    --async-sync-warmup-iters / --async-sync-cooldown-iters (the last ones of `total`)."""
    flags = list(config.flags)

    def value(flag: str) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else 0

    warmup, cooldown = value("--async-sync-warmup-iters"), value("--async-sync-cooldown-iters")
    return min(iterations, warmup) + max(0.0, iterations - (total - cooldown))


def projected_ratios(table: dict, configs: dict, targets: list[float], speed: dict,
                     total: int) -> dict:  # fmt: skip
    """Time-to-accuracy speed-up over the best flush configuration, per target and global
    batch: best flush iterations / the configuration's time in flush iterations, where an
    iteration of schedule S takes 1 / speed[S] (the projection's best S over best flush) and
    a synchronous warmup or cooldown iteration takes 1. Medians over seeds; a configuration
    that did not reach a target in every seed has no ratio there."""
    from megatron.pipeline.schedules import get_schedule

    ratios = {}
    for target in map(str, targets):
        flush = [t[target]["median"] for n, t in table.items()
                 if get_schedule(configs[n].schedule).flushes_every_call and t[target]]  # fmt: skip
        if not flush:
            continue
        best_flush = min(flush)
        for name, entry in table.items():
            if not entry[target]:
                continue
            iterations = entry[target]["median"]
            synchronous = synchronous_iterations(configs[name], iterations, total)
            for gb, factor in speed[configs[name].schedule].items():
                time = synchronous + (iterations - synchronous) / factor
                ratios.setdefault(name, {}).setdefault(target, {})[gb] = best_flush / time
    return ratios


def _cell(value: dict | None, digits: int) -> str:
    if value is None:
        return "not reached"
    form = f"{{:.{digits}f}}"
    return (
        f"{form.format(value['median'])} [{form.format(value['min'])}, {form.format(value['max'])}]"
    )


def markdown(report: dict, targets: list[float]) -> str:
    """The iterations-to-target table with the projected ratios (median [min, max])."""
    gbs = sorted({gb for s in report["projected_speed_over_flush"].values() for gb in s})
    head = ["configuration", "final valid. loss"] + [f"it. to {t}" for t in targets]
    head += [f"projected TTA vs best flush, {t}, GB {gb}" for t in targets for gb in gbs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = report["projected_time_to_accuracy_over_best_flush"]
    for name, entry in report["iterations_to_target"].items():
        row = [name, _cell(entry["final"], 3)] + [_cell(entry[str(t)], 1) for t in targets]
        for target in map(str, targets):
            for gb in gbs:
                value = ratios.get(name, {}).get(target, {}).get(gb)
                row.append("-" if value is None else f"{value:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def long_horizon_markdown(runs: list[Run], targets: list[float], references: dict) -> str:
    """Final validation loss, the paired gap to each configuration's reference (`references`:
    {configuration: reference configuration}), and iterations and tokens (millions) to each
    target: median [min, max] over seeds."""
    table = iteration_table(runs, targets)
    head = ["configuration", "seeds", "final valid. loss", "gap vs reference"]
    head += [f"it. to {t}" for t in targets] + [f"Mtokens to {t}" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in table.items():
        reference = references.get(name)
        gap = paired_gaps(runs, name, reference) if reference else None
        gap_text = "-" if gap is None else (
            f"{100 * gap['median']:+.2f}% [{100 * gap['min']:+.2f}, {100 * gap['max']:+.2f}] "
            f"vs {reference}"
        )  # fmt: skip
        row = [name, str(entry["seeds"]), _cell(entry["final"], 3), gap_text]
        row += [_cell(entry[str(t)], 0) for t in targets]
        for target in targets:
            tokens = entry.get(f"{target} tokens")
            row.append("not reached" if tokens is None else _cell(
                {k: v / 1e6 for k, v in tokens.items()}, 2))  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# Projected time: the simulator's pace for the run's own pipeline (N stages, its a by phase,
# PACI drained at each of its drain points) with per-stage costs from a calibration file.
@functools.cache
def _segment_seconds(schedule: str, stages: int, a: int, steps: int, calibration: str,
                     micro_batch: int) -> float:  # fmt: skip
    """Simulated time of `steps` iterations of `schedule` from an empty pipeline to an empty
    one (flush empties it every step; PACI only at the segment's end)."""
    from megatron.benchmarks.calibration_file import load_stage_costs
    from megatron.pipeline.schedules import get_schedule
    from megatron.pipeline.simulation import simulate

    costs = load_stage_costs(calibration, stages, micro_batch)
    result = simulate(get_schedule(schedule), num_stages=stages, microbatches_per_step=a,
                      steps=steps, **costs.simulate_kwargs())  # fmt: skip
    return result.makespan


def simulated_times(flags: list[str], calibration: str) -> dict[int, float]:
    """{iteration: projected seconds after it} at every drain point of the run `flags`
    describe (evaluations, changes of a, the end): each segment between two drain points is
    simulated with the calibration's costs for the run's pipeline size and micro batch."""
    from megatron.training.arguments import build_parser, validate_args
    from megatron.training.batch_schedule import accumulation_phases
    from megatron.training.config import RunConfig
    from megatron.training.training import drain_points

    flags = build_parser().parse_args(flags)
    validate_args(flags, world_size=flags.pipeline_model_parallel_size, check_files=False)
    config = RunConfig.from_args(flags)
    ends, end = [], 0
    for a, iterations in accumulation_phases(config):
        end += iterations
        ends.append((end, a))
    plan, micro_batch = config.pipeline.plan, config.training.micro_batch_size
    times, iteration, seconds = {}, 0, 0.0
    for point in drain_points(config, 0):
        while iteration < point:
            phase_end, a = next((e, a) for e, a in ends if e > iteration)
            count = min(point, phase_end) - iteration
            seconds += _segment_seconds(plan.name, plan.num_stages, a, count, calibration,
                                        micro_batch)  # fmt: skip
            iteration += count
            times[iteration] = seconds
    return times


def by_projected_time(run: Run, calibration: str) -> list[tuple[float, float]]:
    """The run's validation curve against projected seconds (`simulated_times`)."""
    times = simulated_times(run.args, calibration)
    return [(times[iteration], loss) for iteration, loss in run.validation]


def projected_time_markdown(runs: list[Run], targets: list[float], references: dict,
                            calibration: str) -> str:  # fmt: skip
    """Projected seconds to each target (median [min, max] over seeds) and the speed-up over
    the reference configuration, paired by seed: the reference's time over the
    configuration's (> 1: faster)."""
    curves = {(r.configuration, r.seed): by_projected_time(r, calibration) for r in runs}
    head = ["configuration", "seeds"] + [f"projected s to {t}" for t in targets]
    head += [f"speed-up vs reference at {t}" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(r.configuration for r in runs):
        seeds = [s for (c, s) in curves if c == name]
        reference = references.get(name)
        row, speedups = [name, str(len(seeds))], []
        for target in targets:
            times = {s: iterations_to(curves[(name, s)], target) for s in seeds}
            row.append(_cell(spread(list(times.values())), 0))
            if not reference:
                speedups.append("-")
                continue
            paired = []
            for seed in seeds:
                mine = times[seed]
                theirs = iterations_to(curves.get((reference, seed), []), target)
                paired.append(theirs / mine if mine and theirs else None)
            value = spread(paired)
            speedups.append("not reached" if value is None else (
                f"{value['median']:.2f}x [{value['min']:.2f}, {value['max']:.2f}]"))  # fmt: skip
        lines.append("| " + " | ".join(row + speedups) + " |")
    return "\n".join(lines)
