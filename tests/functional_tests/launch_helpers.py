"""Shared by the launcher tests: run examples/paci/pretrain_gpt2_medium.sh with a CPU-sized
model whose flags are exactly those of the functional case `gpt_pp4_paci_a4`, so a launched run
can be checked against that case's golden losses."""

import os
import shlex
import subprocess
import sys

import run_cases

REPO = run_cases.REPO
MEDIUM_SCRIPT = os.path.join(REPO, "examples", "paci", "pretrain_gpt2_medium.sh")
REFERENCE_CASE = "gpt_pp4_paci_a4"

# The reference case's model, batch and optimizer through the script's own variables ...
CPU_CASE_VARIABLES = {
    "NUM_LAYERS": "4", "HIDDEN": "64", "HEADS": "4", "SEQ": "32",
    "PP": "4", "TP": "1", "GLOBAL_BATCH": "8", "A": "4", "TRAIN_ITERS": "8",
    "WARMUP_ITERS": "2", "LR": "1e-3", "MIN_LR": "1e-4", "SEED": "1234", "SCHEDULE": "paci",
    "MOCK_DATA": "1", "TOKENIZER_TYPE": "NullTokenizer", "VOCAB_SIZE": "1000",
    "PRECISION": "fp32", "BACKEND": "gloo",
}  # fmt: skip
# ... and the flags the script leaves at its GPT-2 Medium run's values, passed after it.
CPU_CASE_EXTRA_FLAGS = [
    "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2", "--deterministic-mode",
]  # fmt: skip
# Flags that say where output goes or how processes meet: they do not change the numbers.
NOT_NUMERIC = {
    "metrics_dir", "tensorboard_dir", "save", "save_interval", "data_cache_path", "split",
    "distributed_backend", "distributed_timeout_minutes", "optimizer", "timeline_file",
}  # fmt: skip


def script_environment(**variables: str) -> dict[str, str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return {**os.environ, "TORCHRUN": torchrun, "OMP_NUM_THREADS": "1", **variables}


def dry_run(variables: dict[str, str], extra: list[str] = ()) -> subprocess.CompletedProcess:
    environment = script_environment(DRY_RUN="1", **variables)
    return subprocess.run(
        ["bash", MEDIUM_SCRIPT, *extra], capture_output=True, text=True, env=environment
    )


def split_command(line: str) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, pretrain_gpt.py's arguments) of a printed command line."""
    words = shlex.split(line)
    script = next(i for i, word in enumerate(words) if word.endswith("pretrain_gpt.py"))
    return words[1:script], words[script + 1 :]


def launcher_flags(torchrun_args: list[str]) -> dict[str, str]:
    """torchrun's `--flag value` pairs; a bare flag such as --standalone maps to ''."""
    result, index = {}, 0
    while index < len(torchrun_args):
        flag = torchrun_args[index]
        has_value = index + 1 < len(torchrun_args) and not torchrun_args[index + 1].startswith("--")
        result[flag] = torchrun_args[index + 1] if has_value else ""
        index += 2 if has_value else 1
    return result


def reference_case_flags(output: str) -> list[str]:
    case = run_cases.discover_cases()[REFERENCE_CASE]
    return run_cases.flags(case["MODEL_ARGS"], output)


def reference_environment() -> dict[str, str]:
    case = run_cases.discover_cases()[REFERENCE_CASE]
    return {key: str(value) for key, value in case.get("ENV_VARS", {}).items()}
