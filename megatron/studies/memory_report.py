"""Memory per pipeline stage for several run configurations, side by side.

Each configuration is one real pretraining launch (`torchrun ... pretrain_gpt.py`, its own
processes, so no run inherits another's heap); the figures come from its summary.json:
parameters, gradients, optimizer state, the activations autograd held at the peak (accounted
with saved-tensor hooks) and the real peak of the process since set-up (resident set on CPU,
the allocator's peak on CUDA; see megatron/pipeline/accounting.py).

Rows: every schedule x every recomputation mode; `--variant LABEL=FLAGS` adds rows (e.g.
`--variant "bf16=--bf16"`), `--paci-variant LABEL=FLAGS` a PACI row with PACI-only flags,
`--extra-flags` goes to every run (e.g. a data-parallel layout).

    python tools/memory_report.py --preset demo --iters 6 --output runs/memory
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_DATA = [
    "--data-path", "data/stdlib_text_document", "--split", "969,30,1",
    "--data-cache-path", "data/cache", "--tokenizer-type", "SentencePieceTokenizer",
    "--tokenizer-model", "data/tokenizer/stdlib.model",
]  # fmt: skip
_COMMON = [
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--distributed-backend", "gloo",
    "--untie-embeddings-and-output-weights", "--log-interval", "1", "--eval-iters", "0",
    "--seed", "1234", "--deterministic-mode",
]  # fmt: skip
# Model shapes: the demo's (examples/paci/demo_cpu.sh) and a larger one on 4 stages.
PRESETS = {
    "demo": [
        "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "512",
        "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "4", "--global-batch-size", "16",
        "--pipeline-model-parallel-size", "4",
    ],
    "8x512": [
        "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
        "--seq-length", "256", "--max-position-embeddings", "256",
        "--micro-batch-size", "4", "--global-batch-size", "32",
        "--pipeline-model-parallel-size", "4",
    ],
}  # fmt: skip
RECOMPUTE_MODES = {
    "off": [],
    "selective": ["--recompute-activations"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"],
}  # fmt: skip
SCHEDULES = ("1f1b", "paci")


def configurations(options) -> list[tuple[str, list[str]]]:
    """(label, flags) per row: schedule x recomputation mode, then the variants."""
    rows = []
    for recompute in options.recompute:
        for schedule in options.schedules:
            label = schedule if recompute == "off" else f"{schedule} {recompute}"
            rows.append((label, ["--pipeline-schedule", schedule, *RECOMPUTE_MODES[recompute]]))
    for variant in options.variant:
        label, _, flags = variant.partition("=")
        for schedule in options.schedules:
            rows.append((f"{schedule} {label}", ["--pipeline-schedule", schedule,
                                                   *shlex.split(flags)]))  # fmt: skip
    for variant in options.paci_variant:  # PACI's own flags: no flush row
        label, _, flags = variant.partition("=")
        rows.append((f"paci {label}", ["--pipeline-schedule", "paci", *shlex.split(flags)]))
    return rows


def launch(flags: list[str], metrics_dir: str, options) -> dict:
    """One pretraining run in its own processes; its summary.json."""
    command = [
        options.torchrun, "--standalone", f"--nproc-per-node={options.nproc}", "pretrain_gpt.py",
        *PRESETS[options.preset], *_COMMON, *_DATA, "--train-iters", str(options.iters),
        *shlex.split(options.extra_flags), *flags, "--metrics-dir", metrics_dir,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        tail = (completed.stdout + completed.stderr)[-3000:]
        raise RuntimeError(f"run failed (exit {completed.returncode}): {shlex.join(flags)}\n{tail}")
    with open(os.path.join(metrics_dir, "summary.json")) as handle:
        return json.load(handle)


def stage_rows(label: str, summary: dict) -> list[dict]:
    """One row per stage, in MiB."""
    mib = 2.0**-20
    rows = []
    for stage in summary["stages"]:
        rows.append(
            {
                "run": label,
                "stage": stage["stage"],
                "params": stage["param_bytes"] * mib,
                "grads": stage["grad_bytes"] * mib,
                "optimizer": stage["optimizer_state_bytes"] * mib,
                "activations": stage["peak_activation_bytes"] * mib,
                "in_flight": stage["peak_inflight_microbatches"],
                "real_peak": (stage.get("real_peak_bytes") or 0) * mib,
                "baseline": (stage.get("baseline_rss_bytes") or 0) * mib,
                "final_loss": summary["final_loss"],
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Per-stage table; real peak relative to the first row's run of the same stage."""
    header = ("| run | stage | params | grads | optimizer state | peak activations (accounted) "
              "| in flight | real peak since set-up | vs first run | set-up baseline (RSS) |")  # fmt: skip
    lines = [header, "|" + "---|" * 10]
    first = {row["stage"]: row["real_peak"] for row in rows if row["run"] == rows[0]["run"]}
    for row in sorted(rows, key=lambda r: (r["stage"], rows.index(r))):
        reference = first.get(row["stage"]) or 0.0
        change = f"{100 * (row['real_peak'] / reference - 1):+.1f}%" if reference else "-"
        lines.append(
            f"| {row['run']} | {row['stage']} | {row['params']:.2f} | {row['grads']:.2f} | "
            f"{row['optimizer']:.2f} | {row['activations']:.2f} | {row['in_flight']} | "
            f"{row['real_peak']:.1f} | {change} | {row['baseline']:.1f} |"
        )
    return "\n".join(lines)


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--preset", default="demo", choices=sorted(PRESETS), help="model shape")
    add("--iters", type=int, default=6, help="iterations per run")
    add("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    add("--recompute", nargs="+", default=list(RECOMPUTE_MODES), choices=list(RECOMPUTE_MODES))
    add("--variant", action="append", default=[],
        help="LABEL=FLAGS: extra rows, one per schedule, with these flags (repeatable)")  # fmt: skip
    add("--paci-variant", action="append", default=[],
        help="LABEL=FLAGS: an extra PACI row with PACI-only flags, e.g. "
        "'capped=--paci-inflight-limit flush' (repeatable)")  # fmt: skip
    add("--extra-flags", default="", help="flags for every run (quoted)")
    add("--nproc", type=int, default=4, help="processes per run")
    add("--output", default="runs/memory_report", help="run directories and memory.json")
    add("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    options = parser.parse_args(argv)
    if options.iters < 1 or options.nproc < 1:
        parser.error("--iters and --nproc must be >= 1")
    return options


def main(argv=None) -> int:
    options = parse_options(argv)
    rows = []
    for index, (label, flags) in enumerate(configurations(options)):
        metrics_dir = os.path.join(options.output, f"run{index}")
        print(f"> {label}: {shlex.join(flags)}", flush=True)
        try:
            summary = launch(flags, metrics_dir, options)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        rows.extend(stage_rows(label, summary))
    os.makedirs(options.output, exist_ok=True)
    with open(os.path.join(options.output, "memory.json"), "w") as handle:
        json.dump(rows, handle, indent=2)
    print("sizes in MiB")
    print(markdown_table(rows))
    return 0
