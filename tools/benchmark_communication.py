"""What the data-parallel gradient reduction costs, and how much of it the schedules hide.

Runs a matrix of training runs, each on 4 processes (gloo over loopback), with all ranks'
traffic on one tbf-shaped loopback (`tools/shaped_link.py`: ONE queue for every rank, a hub),
at each rate, and prints a table per rate and one JSON object (also OUTPUT/report.json):

    nice .venv/bin/python tools/benchmark_communication.py [--quick] \
        [--rates none 1gbit 200mbit] [--rows 'emulated/pp2xdp2/*'] [--iterations 10] \
        [--repeats 1] [--output runs/communication]

A row is COMPUTE/TOPOLOGY/SCHEDULE/OPTIMIZER/REDUCTION, `--rows` takes shell patterns of it:

* COMPUTE: `real` (GPT, 4 layers, hidden 256, the corpus's vocabulary of 8192, untied: 29.5 MB
  of fp32 gradients) or `emulated` (`--emulated-forward-ms` / `--emulated-backward-ms` stages
  that wait fixed times, with `--emulated-param-count` parameters: what the schedules do, apart
  from the CPU contention of four real-compute ranks on a small machine).
* TOPOLOGY: `pp2xdp2` (pipeline 2 x data parallel 2) or `dp4` (one stage, 4 replicas: the
  schedules coincide, so only `1f1b` runs). 4 microbatches of 2 per replica either way; the
  emulated dp4 stage is both pp2xdp2 stages in one (twice the times and the parameters).
* SCHEDULE: `1f1b` (1F1B with a flush) or `paci`.
* OPTIMIZER: `plain` (replicated Adam: the reduction is an all-reduce) or `distopt`
  (`--use-distributed-optimizer`: a reduce-scatter, and an all-gather after the step).
* REDUCTION: `at-step` (one blocking reduction of the same buckets at the step), `overlap`
  (`--overlap-grad-reduce --ddp-bucket-size B`, buckets launched from the backward's hooks) or
  a variant of `VARIANTS` (e.g. PACI's deferred step), included when the parser has its flags.

All runs of a rate share one launch (`tools/run_pretrain_cases.py`: torch and megatron-core are
imported once); a run that fails is reported and the launch goes on with the next. Figures per
run: the iteration time (the median over the iterations after the first `--warmup`, and its
range), tokens/s at that median, and per stage the reduction's time in flight (`dp_reduce_s`)
and the time the step waited for it (`dp_exposed_s`) per iteration (means over the run, from
summary.json) with the hidden share 1 - exposed / in flight (over the stages). With
`--repeats R` every run is repeated R times, interleaved, and a row gives the median run's
figures and the range of the repeats' medians.

Every launch imports the code of the checkout it runs from: on a shared working tree that others
edit, run it from a snapshot (`git worktree add --detach DIR HEAD`, with `data/` linked in and
PYTHONPATH=DIR), so that a half-made edit elsewhere cannot fail or change a launch.

A benchmark, not a test (needs root for the network namespace). The full matrix (78 runs) took
57 minutes on the shared 2-core machine at a load average of 40-100 (docs/communication.md),
a third of it the real dp4 rows at 200 Mbit/s; `--quick` runs the 1 Gbit/s pp2xdp2 rows with
the plain optimizer (10 runs, about 6 minutes).
"""

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = ("none", "1gbit", "200mbit")
NPROC = 4
MICROBATCHES = 4  # per replica and step
MICRO_BATCH = 2

REAL_MODEL = (
    "--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 "
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 "
    "--clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0 "
    "--data-path data/stdlib_text_document --split 969,30,1 --data-cache-path data/cache "
    "--tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer/stdlib.model "
    "--untie-embeddings-and-output-weights --eval-iters 0 --log-interval 1 --seed 1234"
).split()
# The stand-in stages carry a (1024, 2, 2) activation (16 KiB per transfer); the sequence is
# long because megatron-core's mock dataset indexes one entry per sequence (slow when short).
EMULATED_MODEL = (
    "--num-layers 2 --hidden-size 2 --num-attention-heads 1 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 2 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --untie-embeddings-and-output-weights "
    "--eval-iters 0 --log-interval 1 --seed 1234"
).split()


@dataclasses.dataclass(frozen=True)
class Topology:
    pipeline: int
    # emulated: ms per forward and backward, parameters per stage; the real model's bucket
    forward_ms: float
    backward_ms: float
    param_count: int
    emulated_bucket: int
    real_bucket: int


# pp2xdp2's emulated stage: 4 backwards of 60 ms per step, and 2M parameters (8 MB of fp32
# gradients per stage) whose reduction takes about as long at 1 Gbit/s (both stages' pairs
# share the hub). The buckets: about 4-8 per stage (a parameter is never split: the 2.1M-row
# embedding and output layer are a bucket each).
TOPOLOGIES = {
    "pp2xdp2": Topology(2, 30.0, 60.0, 2_000_000, 500_000, 750_000),
    "dp4": Topology(1, 60.0, 120.0, 4_000_000, 1_000_000, 1_500_000),
}
SCHEDULES = ("1f1b", "paci")
OPTIMIZERS = {"plain": (), "distopt": ("--use-distributed-optimizer",)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A further way of reducing, on top of the bucketed overlap, for the rows it applies to."""

    name: str
    flags: tuple
    schedules: tuple = SCHEDULES
    optimizers: tuple = tuple(OPTIMIZERS)


# One line per variant; a variant whose flags the parser lacks is left out (and said so).
# --paci-deferred-step: the stage goes on computing while its reduction is in flight, and
# steps when it lands (not with the distributed optimizer).
VARIANTS = (Variant("deferred-step", ("--paci-deferred-step",), ("paci",), ("plain",)),)


@dataclasses.dataclass(frozen=True)
class Row:
    compute: str  # real | emulated
    topology: str
    schedule: str
    optimizer: str
    reduction: str  # at-step | overlap | a variant's name

    @property
    def name(self) -> str:
        return "/".join((self.compute, self.topology, self.schedule, self.optimizer,
                         self.reduction))  # fmt: skip


def all_rows(variants=VARIANTS) -> list[Row]:
    rows = []
    for compute in ("emulated", "real"):
        for topology, shape in TOPOLOGIES.items():
            # one stage: both schedules are the same order of passes, so one of them runs
            schedules = SCHEDULES if shape.pipeline > 1 else SCHEDULES[:1]
            for schedule in schedules:
                for optimizer in OPTIMIZERS:
                    reductions = ["at-step", "overlap"]
                    reductions += [v.name for v in variants if schedule in v.schedules
                                   and optimizer in v.optimizers and shape.pipeline > 1]  # fmt: skip
                    for reduction in reductions:
                        rows.append(Row(compute, topology, schedule, optimizer, reduction))
    return rows


QUICK = ("*/pp2xdp2/*/plain/*",)
QUICK_RATES = ("1gbit",)


def select(rows: list[Row], patterns) -> list[Row]:
    if not patterns:
        return rows
    return [row for row in rows if any(fnmatch.fnmatchcase(row.name, p) for p in patterns)]


def available_variants(parser_flags) -> tuple[list[Variant], list[str]]:
    """The variants whose flags all exist in pretrain_gpt.py's parser, and notes on the rest."""
    kept, notes = [], []
    for variant in VARIANTS:
        missing = [f for f in variant.flags if f.startswith("--") and f not in parser_flags]
        if missing:
            notes.append(f"variant {variant.name} left out: the parser has no {' '.join(missing)}")
        else:
            kept.append(variant)
    return kept, notes


def parser_flags() -> set:
    from megatron.training.arguments import build_parser

    return {s for action in build_parser()._actions for s in action.option_strings}


# ---------------------------------------------------------------------------- commands
def case_args(row: Row, iterations: int) -> list[str]:
    """pretrain_gpt.py's flags for one run of `row` (without --metrics-dir)."""
    shape = TOPOLOGIES[row.topology]
    replicas = NPROC // shape.pipeline
    args = list(REAL_MODEL if row.compute == "real" else EMULATED_MODEL)
    args += ["--pipeline-model-parallel-size", str(shape.pipeline),
             "--pipeline-schedule", row.schedule,
             "--global-batch-size", str(MICROBATCHES * MICRO_BATCH * replicas),
             "--train-iters", str(iterations)]  # fmt: skip
    if row.compute == "emulated":
        args += ["--emulated-forward-ms", repr(shape.forward_ms),
                 "--emulated-backward-ms", repr(shape.backward_ms),
                 "--emulated-param-count", str(shape.param_count)]  # fmt: skip
    args += list(OPTIMIZERS[row.optimizer])
    if row.reduction != "at-step":
        bucket = shape.real_bucket if row.compute == "real" else shape.emulated_bucket
        args += ["--overlap-grad-reduce", "--ddp-bucket-size", str(bucket)]
    variant = next((v for v in VARIANTS if v.name == row.reduction), None)
    if variant is not None:
        args += list(variant.flags)
    return args


def case_name(rate: str, row: Row, repeat: int) -> str:
    return f"{rate} {row.name} #{repeat}"


def metrics_dir(output: str, rate: str, row: Row, repeat: int) -> str:
    return os.path.join(output, rate, row.name.replace("/", "_"), f"r{repeat}")


def cases(rate: str, rows: list[Row], repeats: int, iterations: int, output: str) -> list[dict]:
    """The launch's runs: every row once per round, `repeats` rounds (interleaved, so that a
    busy spell of the machine does not fall on one row's repeats)."""
    return [
        {"name": case_name(rate, row, repeat), "args": case_args(row, iterations),
         "metrics_dir": metrics_dir(output, rate, row, repeat)}
        for repeat in range(repeats) for row in rows
    ]  # fmt: skip


def launch_command(rate: str, cases_file: str, python: str = sys.executable) -> list[str]:
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    return [python, os.path.join(REPO, "tools", "shaped_link.py"), "--rate", rate, "--",
            torchrun, "--standalone", f"--nproc-per-node={NPROC}",
            os.path.join(REPO, "tools", "run_pretrain_cases.py"), cases_file]  # fmt: skip


def shown_command(rate: str, row: Row, iterations: int) -> str:
    """The one-run command line of a row (what a launch's case runs), for the docs."""
    return " ".join(
        [".venv/bin/python", "tools/shaped_link.py", "--rate", rate, "--", ".venv/bin/torchrun",
         "--standalone", f"--nproc-per-node={NPROC}", "pretrain_gpt.py",
         *case_args(row, iterations)]
    )  # fmt: skip


# ---------------------------------------------------------------------------- the log
CASE_LINE = re.compile(r"^=== case (.+)$")
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)"
)
REDUCTION_FIELD = re.compile(r"dp reduce/exposed per iteration \(ms\): ([\d.]+)/([\d.]+)")


def split_log(text: str) -> dict[str, list[str]]:
    """A launch's log cut at run_pretrain_cases.py's `=== case NAME` lines: {name: lines}."""
    parts: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = CASE_LINE.match(line.strip())
        if match:
            current = match.group(1)
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return parts


def iterations_of(lines: list[str]) -> list[dict]:
    """The logging rank's iteration lines: iteration, ms, and the reduction's fields if any."""
    found = []
    for line in lines:
        match = ITERATION_LINE.search(line)
        if not match:
            continue
        entry = {"iteration": int(match.group(1)), "ms": float(match.group(2))}
        reduction = REDUCTION_FIELD.search(line)
        if reduction:
            entry["reduce_ms"], entry["exposed_ms"] = map(float, reduction.groups())
        found.append(entry)
    return found


# ---------------------------------------------------------------------------- figures
def run_figures(summary: dict, lines: list[str], warmup: int) -> dict:
    """One run's figures: the iteration time after `warmup` iterations (median, range), tokens
    per second at that median, and per stage the reduction per iteration (ms, means over the
    run) and the share hidden."""
    logged = [entry for entry in iterations_of(lines) if entry["iteration"] > warmup]
    times = [entry["ms"] for entry in logged]
    if not times:
        raise ValueError(f"no iteration after the first {warmup} in the log")
    median_ms = statistics.median(times)
    tokens = summary["global_batch_size"] * summary["seq_length"]
    iterations = summary["iterations"]
    stages = summary["stages"]
    reduce_ms = [1000.0 * s.get("dp_reduce_s", 0.0) / iterations for s in stages]
    exposed_ms = [1000.0 * s.get("dp_exposed_s", 0.0) / iterations for s in stages]
    buckets = [
        (s.get("dp_buckets_in_backward", 0) + s.get("dp_buckets_at_step", 0)) / iterations
        for s in stages
    ]
    total = sum(reduce_ms)
    figures = {
        "iteration_ms": median_ms,
        "iteration_ms_range": [min(times), max(times)],
        "iterations_measured": len(times),
        "tokens_per_s": tokens / (median_ms / 1000.0),
        "reduce_ms_per_stage": reduce_ms,
        "exposed_ms_per_stage": exposed_ms,
        "hidden_share": 1.0 - sum(exposed_ms) / total if total > 0 else None,
        "buckets_per_step_per_stage": buckets,
        "reduced_mb_per_step_per_stage": [
            s.get("dp_reduced_bytes", 0) / iterations / 1e6 for s in stages
        ],
    }
    reduced = [e for e in logged if "reduce_ms" in e]
    if reduced:  # the logging stage's, after the warm-up: a check on the run's means
        figures["logging_stage_median_reduce_ms"] = statistics.median(
            e["reduce_ms"] for e in reduced
        )
        figures["logging_stage_median_exposed_ms"] = statistics.median(
            e["exposed_ms"] for e in reduced
        )
    return figures


def row_figures(runs: list[dict]) -> dict:
    """A row over its repeats: the median run (by iteration time), the repeats' iteration
    times and hidden shares (the median run's share need not be the median share)."""
    ordered = sorted(runs, key=lambda run: run["iteration_ms"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["repeats"] = len(runs)
    if len(runs) > 1:
        middle["repeat_iteration_ms"] = [run["iteration_ms"] for run in runs]
        middle["repeat_hidden_share"] = [run["hidden_share"] for run in runs]
    return middle


def _stages_text(values, form="{:.0f}") -> str:
    return "/".join(form.format(v) for v in values)


COLUMNS = ("row", "iteration ms (range)", "tokens/s", "reduce ms/it by stage",
           "exposed ms/it by stage", "hidden", "buckets/step")  # fmt: skip


def table_lines(rate: str, results: dict[str, dict]) -> list[str]:
    """A markdown table of one rate's rows: {row name: row_figures or {"error": ...}}."""
    lines = [f"rate {rate}:", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]  # fmt: skip
    for name, figures in results.items():
        if "error" in figures:
            lines.append(f"| {name} | failed: {figures['error']} |" + " |" * (len(COLUMNS) - 2))
            continue
        low, high = figures["iteration_ms_range"]
        spread = f"{low:.0f}-{high:.0f}"
        if figures.get("repeats", 1) > 1:  # the range of the repeats' medians instead
            repeats = figures["repeat_iteration_ms"]
            spread = f"{min(repeats):.0f}-{max(repeats):.0f} over {len(repeats)} runs"
        hidden = "-" if figures["hidden_share"] is None else f"{100 * figures['hidden_share']:.0f}%"
        shares = [h for h in figures.get("repeat_hidden_share", ()) if h is not None]
        if len(shares) > 1 and min(shares) < max(shares):  # the median run's, and the range
            hidden += f" ({100 * min(shares):.0f}-{100 * max(shares):.0f}%)"
        cells = [
            name,
            f"{figures['iteration_ms']:.0f} ({spread})",
            f"{figures['tokens_per_s']:.0f}",
            _stages_text(figures["reduce_ms_per_stage"]),
            _stages_text(figures["exposed_ms_per_stage"]),
            hidden,
            _stages_text(figures["buckets_per_step_per_stage"], "{:.0f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------- launching
def run_launch(
    rate: str, launch_cases: list[dict], output: str, stall_s: float, load: list | None = None
) -> dict:
    """Run `launch_cases` in as many launches as failures take: a run that fails (or makes no
    progress for `stall_s`) is recorded and the rest go on in a fresh launch.
    {case name: {"lines": [...]} or {"error": text}}; `load` gets the 1-minute load average
    every few seconds (the machine is shared: how busy it was belongs with the figures)."""
    outcome: dict[str, dict] = {}
    pending = list(launch_cases)
    attempt, retried = 0, False
    while pending:
        attempt += 1
        cases_file = os.path.join(output, rate, f"cases_{attempt}.json")
        log_file = os.path.join(output, rate, f"launch_{attempt}.log")
        os.makedirs(os.path.dirname(cases_file), exist_ok=True)
        with open(cases_file, "w") as file:
            json.dump(pending, file, indent=1)
        returncode = _launch(launch_command(rate, cases_file), log_file, stall_s, load)
        with open(log_file, errors="replace") as file:
            text = file.read()
        parts = split_log(text)
        done = [case for case in pending if case["name"] in parts]
        if not done:  # failed before its first run: once more (a port taken, say), then stop
            if returncode != 0 and not retried:
                retried = True
                print(f"  launch at {rate} failed before any run; trying once more", flush=True)
                continue
            raise RuntimeError(f"launch at {rate} failed before any run:\n{text[-3000:]}")
        for case in done:
            outcome[case["name"]] = {"lines": parts[case["name"]]}
        if returncode == 0:
            break
        failed = done[-1]["name"]  # the run the launch was in when it ended
        tail = "\n".join(parts[failed][-40:])
        outcome[failed] = {"error": _first_error(parts[failed]) or f"exit {returncode}",
                           "log_tail": tail}  # fmt: skip
        print(f"  {failed}: failed ({outcome[failed]['error']}); going on", flush=True)
        pending = pending[pending.index(done[-1]) + 1 :]
    return outcome


def _first_error(lines: list[str]) -> str | None:
    for line in lines:
        if line.startswith("error:") or "Error:" in line:
            return line.strip()[:200]
    return None


def _launch(command: list[str], log_file: str, stall_s: float, load: list | None = None) -> int:
    """Run `command` into `log_file`; stop it (SIGTERM: shaped_link.py then ends what runs in
    its namespace and removes it) once the log has not grown for `stall_s`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)  # fmt: skip
        size, since = -1, time.monotonic()
        while process.poll() is None:
            time.sleep(2.0)
            if load is not None:
                load.append(os.getloadavg()[0])
            now_size = os.path.getsize(log_file)
            if now_size != size:
                size, since = now_size, time.monotonic()
            elif time.monotonic() - since > stall_s:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                with open(log_file, "a") as tail:
                    tail.write(f"\nerror: no progress for {stall_s:.0f} s: stopped\n")
                return -signal.SIGTERM
    return process.returncode


def load_figures(samples: list) -> dict | None:
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def benchmark(options) -> dict:
    variants, notes = available_variants(parser_flags())
    rows = select(all_rows(variants), options.rows or (QUICK if options.quick else ()))
    rates = options.rates or (QUICK_RATES if options.quick else RATES)
    if not rows:
        raise SystemExit("error: --rows selects no row")
    for note in notes:
        print(note, flush=True)
    report = {"rates": {}, "notes": notes, "iterations": options.iterations,
              "warmup": options.warmup, "repeats": options.repeats,
              "load_average_before": os.getloadavg(), "commands": {}}  # fmt: skip
    for rate in rates:
        started = time.monotonic()
        print(f"rate {rate}: {len(rows)} rows x {options.repeats}", flush=True)
        launch_cases = cases(rate, rows, options.repeats, options.iterations, options.output)
        load: list = []
        outcome = run_launch(rate, launch_cases, options.output, options.stall_s, load)
        results = {}
        for row in rows:
            runs, errors = [], []
            for repeat in range(options.repeats):
                name = case_name(rate, row, repeat)
                got = outcome.get(name, {"error": "not run"})
                if "error" in got:
                    errors.append(got["error"])
                    continue
                path = os.path.join(metrics_dir(options.output, rate, row, repeat),
                                    "summary.json")  # fmt: skip
                try:
                    with open(path) as file:
                        summary = json.load(file)
                    runs.append(run_figures(summary, got["lines"], options.warmup))
                except (OSError, ValueError, KeyError) as problem:
                    errors.append(f"{type(problem).__name__}: {problem}")
            results[row.name] = row_figures(runs) if runs else {"error": errors[0]}
            if errors and runs:
                results[row.name]["failed_repeats"] = errors
            report["commands"][row.name] = shown_command("RATE", row, options.iterations)
        report["rates"][rate] = {
            "rows": results,
            "wall_s": time.monotonic() - started,
            "load_1min_during": load_figures(load),
        }
        print("\n".join(table_lines(rate, results)), flush=True)
        print(f"(1-minute load average during the runs: {load_figures(load)}, 2 cores)\n",
              flush=True)  # fmt: skip
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", choices=RATES, help="default: all three")
    parser.add_argument("--rows", nargs="+", metavar="PATTERN",
                        help="shell patterns of COMPUTE/TOPOLOGY/SCHEDULE/OPTIMIZER/REDUCTION")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="1gbit, the plain pp2xdp2 rows (unless --rates/--rows say)")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3,
                        help="iterations left out of the iteration time's median")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--stall-s", type=float, default=300.0,
                        help="stop a launch whose log has not grown for this long")  # fmt: skip
    parser.add_argument("--output", default=os.path.join(REPO, "runs", "communication"))
    parser.add_argument("--list", action="store_true", help="print the selected rows and exit")
    options = parser.parse_args(argv)
    if options.iterations <= options.warmup:
        parser.error("--iterations must exceed --warmup")
    if options.list:
        variants, _ = available_variants(parser_flags())
        for row in select(all_rows(variants), options.rows or (QUICK if options.quick else ())):
            print(row.name)
        return 0
    report = benchmark(options)
    os.makedirs(options.output, exist_ok=True)
    with open(os.path.join(options.output, "report.json"), "w") as file:
        json.dump(report, file, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
