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

import json
import os
import statistics
import subprocess
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEMO_MODEL = [
    "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "512",
    "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "16",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--data-path", "data/stdlib_text_document", "--split", "969,30,1",
    "--data-cache-path", "data/cache",
    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
    "data/tokenizer/stdlib.model",
    "--pipeline-model-parallel-size", "4", "--distributed-backend", "gloo",
    "--untie-embeddings-and-output-weights",
]  # fmt: skip
NUM_PROCESSES = 4


@dataclass(frozen=True)
class Configuration:
    """A schedule with its optimizer, LR and mitigation flags."""

    name: str
    schedule: str
    lr: float
    flags: tuple = ()

    def args(self, iterations: int, eval_interval: int, seed: int) -> list[str]:
        return DEMO_MODEL + [
            "--pipeline-schedule", self.schedule,
            "--lr", str(self.lr), "--min-lr", str(self.lr / 10),
            "--train-iters", str(iterations), "--eval-interval", str(eval_interval),
            "--eval-iters", "5", "--log-interval", str(eval_interval), "--seed", str(seed),
            *self.flags,
        ]  # fmt: skip


def parse_configuration(text: str) -> Configuration:
    """'NAME=SCHEDULE:LR[:flag,flag,...]', e.g. 'paci-ef=paci:1e-3:--async-error-feedback'.
    Flags with values are written with '=': '--optimizer=muon'."""
    name, _, spec = text.partition("=")
    parts = spec.split(":", 2)
    if not name or len(parts) < 2:
        raise ValueError(f"configuration {text!r}: expected NAME=SCHEDULE:LR[:FLAGS]")
    flags = []
    for flag in parts[2].split(",") if len(parts) == 3 and parts[2] else []:
        flags.extend(flag.split("=", 1))
    return Configuration(name, parts[0], float(parts[1]), tuple(flags))


@dataclass
class Run:
    configuration: str
    seed: int
    validation: list = field(default_factory=list)  # [(iteration, lm loss)]


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


def _read_run(output: str, configuration: str, seed: int) -> Run:
    with open(os.path.join(run_directory(output, configuration, seed), "summary.json")) as f:
        summary = json.load(f)
    curve = [(entry["iteration"], entry["lm loss"]) for entry in summary["validation"]]
    return Run(configuration, seed, curve)


def iterations_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """First crossing of `target`, interpolated linearly from the evaluation before it."""
    previous = None
    for iteration, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(iteration)
            (i0, l0), fraction = previous, (previous[1] - target) / (previous[1] - loss)
            return i0 + fraction * (iteration - i0)
        previous = (iteration, loss)
    return None


def spread(values: list[float]) -> dict | None:
    """Median and range; None when a seed did not reach (the median would hide it)."""
    if not values or any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def iteration_table(runs: list[Run], targets: list[float]) -> dict:
    """{configuration: {"final": spread of the last validation loss, str(target): spread}}."""
    table = {}
    for name in dict.fromkeys(r.configuration for r in runs):
        mine = [r for r in runs if r.configuration == name]
        entry = {"final": spread([r.validation[-1][1] for r in mine]), "seeds": len(mine)}
        for target in targets:
            reached = [iterations_to(r.validation, target) for r in mine]
            entry[str(target)] = spread(reached)
            entry[f"{target} reached"] = sum(v is not None for v in reached)
        table[name] = entry
    return table


def projected_speed(schedules=("1f1b", "paci"), global_batches=(128, 256)) -> dict:
    """{schedule: {global batch: its best samples/s over the best flush's}} from the paper-scale
    projection with its default assumptions (docs/projection.md, row A)."""
    from megatron.pipeline.simulation import projection

    args = projection.parse_args([
        "--global-batch-sizes", ",".join(map(str, global_batches)),
        "--schedules", ",".join(dict.fromkeys(("1f1b", *schedules))),
    ])  # fmt: skip
    summary = projection.run(args)["summary"]
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
    ratios = {}
    for target in map(str, targets):
        flush = [t[target]["median"] for n, t in table.items()
                 if configs[n].schedule == "1f1b" and t[target]]  # fmt: skip
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
