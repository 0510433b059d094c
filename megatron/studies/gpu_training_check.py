"""The training pass of tools/gpu_check.sh: short real pretraining runs on CUDA, one per feature
and schedule, each reported PASS, FAIL or SKIPPED (not supported yet).

Every run is `pretrain_gpt.py` under torchrun with Megatron's flag names, on a small GPT (4
layers, hidden 256, seq 256, mock data) with the layer spec a run picks (Transformer Engine's
when it is installed, else the portable one), under `--pipeline-schedule 1f1b` and `paci`:

* `bf16`: `--bf16`;  `fp16`: `--fp16` (loss scaling);
* `distributed-optimizer`: `--bf16 --use-distributed-optimizer`;
* `recompute-selective`: `--bf16 --recompute-activations`;
* `recompute-full`: `--bf16 --recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1`;
* `fused-cross-entropy`: `--bf16 --cross-entropy-loss-fusion` (megatron-core's fused cross
  entropy, compiled by `torch.compile` at the first step);
* `fsdp`: `--bf16 --use-megatron-fsdp` (torch's fully_shard over NCCL);
* `dsa`: DeepSeek sparse attention on MLA (`--experimental-attention-variant dsa`).

Layouts follow the GPUs there are: NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so with one GPU every run is one process (PP = 1, where PACI runs its one stage);
with 2 GPUs and more the runs take 2 pipeline stages, and the distributed optimizer and FSDP
also 2 data-parallel ranks when there are 4.

A run that ends with status 0 and a finite final loss in its summary.json passes. One that
ends with status 2 and `error: ... is not supported yet` is SKIPPED: the feature has not
landed, which is not a failure of this check. Anything else fails, with its last error line.
Each run's measurements are printed: final loss, time per iteration (the log's last
`elapsed time per iteration (ms)`) and the peak memory figures of each stage from
summary.json.

Only the standard library is imported here: the check runs on a bare GPU machine.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

MODEL = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "3e-4", "--min-lr", "3e-5",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--eval-iters", "0",
    "--untie-embeddings-and-output-weights", "--seed", "1234", "--distributed-backend", "nccl",
]  # fmt: skip
FEATURES = {
    "bf16": ["--bf16"],
    "fp16": ["--fp16"],
    "distributed-optimizer": ["--bf16", "--use-distributed-optimizer"],
    "recompute-selective": ["--bf16", "--recompute-activations"],
    "recompute-full": ["--bf16", "--recompute-granularity", "full", "--recompute-method",
                       "uniform", "--recompute-num-layers", "1"],
    "fused-cross-entropy": ["--bf16", "--cross-entropy-loss-fusion"],
    # torch's fully_shard over NCCL (fsdp.py), a one-rank mesh on one GPU
    "fsdp": ["--bf16", "--use-megatron-fsdp"],
    # DeepSeek sparse attention on MLA (dsa.py): the torch Hadamard rotation on the GPU
    "dsa": ["--bf16", "--multi-latent-attention", "--qk-head-dim", "32", "--qk-pos-emb-head-dim",
            "16", "--v-head-dim", "32", "--kv-lora-rank", "64", "--q-lora-rank", "96",
            "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "8",
            "--dsa-indexer-head-dim", "64", "--dsa-indexer-topk", "64",
            "--dsa-indexer-loss-coeff", "0.01"],
}  # fmt: skip
SCHEDULES = ("1f1b", "paci")
NOT_SUPPORTED = re.compile(r"^error: (.*) is not supported yet", re.MULTILINE)
# A flag this version's parser does not know at all is not supported yet either.
UNKNOWN_FLAG = re.compile(r"error: unrecognized arguments: (.*)$", re.MULTILINE)


@dataclass
class Check:
    name: str
    schedule: str
    pipeline: int
    data_parallel: int
    flags: list[str]

    @property
    def processes(self) -> int:
        return self.pipeline * self.data_parallel

    @property
    def label(self) -> str:
        return f"{self.name}/{self.schedule}"


@dataclass
class Outcome:
    check: Check
    result: str  # PASS, FAIL or SKIPPED
    reason: str = ""
    final_loss: float | None = None
    iteration_ms: float | None = None
    stage_memory: list[dict] = field(default_factory=list)


def plan_checks(gpus: int) -> list[Check]:
    """Every feature under both schedules, on the layout the GPUs allow (module docstring)."""
    pipeline = 2 if gpus >= 2 else 1
    checks = []
    for name, flags in FEATURES.items():
        sharded = name in ("distributed-optimizer", "fsdp")
        data_parallel = 2 if sharded and gpus >= 2 * pipeline else 1
        for schedule in SCHEDULES:
            checks.append(Check(name, schedule, pipeline, data_parallel, list(flags)))
    return checks


def command(check: Check, python: str, repo: str, output_dir: str, train_iters: int) -> list[str]:
    """The torchrun command line of one check."""
    metrics = os.path.join(output_dir, check.name + "-" + check.schedule)
    return [
        python, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(check.processes), os.path.join(repo, "pretrain_gpt.py"),
        *MODEL, "--train-iters", str(train_iters), "--log-interval", str(max(1, train_iters // 4)),
        "--pipeline-model-parallel-size", str(check.pipeline),
        "--pipeline-schedule", check.schedule, *check.flags, "--metrics-dir", metrics,
    ]  # fmt: skip


def classify(check: Check, returncode: int, log: str, summary: dict | None) -> Outcome:
    """PASS / FAIL / SKIPPED from the exit status, the log (stdout and stderr) and summary.json."""
    unsupported = NOT_SUPPORTED.search(log) or UNKNOWN_FLAG.search(log)
    if returncode == 2 and unsupported:
        return Outcome(check, "SKIPPED", f"not supported yet: {unsupported.group(1).strip()}")
    if returncode != 0:
        return Outcome(check, "FAIL", f"exit status {returncode}: {_last_error(log)}")
    final = None if summary is None else summary.get("final_loss")
    if final is None or not math.isfinite(final):
        found = "no summary.json" if summary is None else f"final loss {final}"
        return Outcome(check, "FAIL", f"exit status 0 but {found}")
    return Outcome(check, "PASS", "", final, _iteration_ms(log), _stage_memory(summary))


def _last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def _iteration_ms(log: str) -> float | None:
    times = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)
    return float(times[-1]) if times else None


def _stage_memory(summary: dict) -> list[dict]:
    """Per stage, every peak memory figure of summary.json (`*peak*_bytes`)."""
    memory = []
    for stage in summary.get("stages", []):
        figures = {
            key: value
            for key, value in stage.items()
            if isinstance(value, (int, float)) and key.endswith("bytes") and "peak" in key
        }  # fmt: skip
        memory.append({"stage": stage.get("stage"), **figures})
    return memory


def run_check(check: Check, cmd: list[str], output_dir: str, timeout_s: int) -> Outcome:
    log_path = os.path.join(output_dir, f"{check.name}-{check.schedule}.log")
    metrics = cmd[cmd.index("--metrics-dir") + 1]
    try:
        completed = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        returncode, log = completed.returncode, completed.stdout + completed.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = -1
        log = (
            f"{_text(expired.stdout)}{_text(expired.stderr)}\nerror: timed out after {timeout_s} s"
        )
    with open(log_path, "w", encoding="utf-8") as handle:
        handle.write(log)
    summary = None
    if os.path.exists(os.path.join(metrics, "summary.json")):
        with open(os.path.join(metrics, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
    return classify(check, returncode, log, summary)


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def describe(outcome: Outcome) -> str:
    check = outcome.check
    layout = f"PP={check.pipeline} DP={check.data_parallel}"
    head = f"  {outcome.result:<7} {check.label:<32} {layout:<10}"
    if outcome.result != "PASS":
        return f"{head} {outcome.reason}"
    step = "?" if outcome.iteration_ms is None else f"{outcome.iteration_ms:.1f} ms"
    memory = "; ".join(_memory_text(stage) for stage in outcome.stage_memory)
    return f"{head} loss {outcome.final_loss:.4f}, {step}/iteration, peak memory {memory}"


def _memory_text(stage: dict) -> str:
    figures = ", ".join(
        f"{key.replace('_bytes', '')} {value / 2**20:.1f} MiB"
        for key, value in stage.items()
        if key != "stage"
    )
    return f"s{stage['stage']}: {figures or 'none reported'}"


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="tools/gpu_check.sh's training pass")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    checks = plan_checks(args.gpus)
    commands = [
        command(c, args.python, args.repo, args.output_dir, args.train_iters) for c in checks
    ]
    if args.dry_run:
        for check, cmd in zip(checks, commands):
            print(f"  [{check.label}] " + " ".join(shlex.quote(word) for word in cmd))
        return 0
    os.makedirs(args.output_dir, exist_ok=True)
    return _run_all(
        checks,
        commands,
        train_iters=args.train_iters,
        gpus=args.gpus,
        output_dir=args.output_dir,
        timeout_s=args.timeout,
    )


def _run_all(
    checks: list[Check],
    commands: list[list[str]],
    *,
    train_iters: int,
    gpus: int,
    output_dir: str,
    timeout_s: int,
) -> int:
    print(f"gpu_check: training pass, {len(checks)} runs of {train_iters} iterations "
          f"({gpus} GPU(s)); logs and summaries in {output_dir}", flush=True)  # fmt: skip
    outcomes = []
    for check, cmd in zip(checks, commands):
        start = time.perf_counter()
        outcomes.append(run_check(check, cmd, output_dir, timeout_s))
        print(describe(outcomes[-1]) + f" [{time.perf_counter() - start:.0f} s]", flush=True)
    counts = {r: sum(o.result == r for o in outcomes) for r in ("PASS", "FAIL", "SKIPPED")}
    print("gpu_check: training pass: " + ", ".join(f"{n} {r}" for r, n in counts.items()))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
