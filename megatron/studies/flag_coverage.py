"""Which of Megatron-LM's GPT pretraining command lines our parser accepts (the library behind
tools/megatron_flag_coverage.py, whose docstring says what the command lines are).

Each command line is parsed by `build_parser()` and validated by `validate_args(...,
check_files=False)` with data parallel size 1. Outcomes: `accepted`; `not supported yet`
(parsed, then rejected naming a feature we do not have; every such flag is listed); `other
error` (parsed, then rejected for another reason); `parse error` (unknown flag or bad value).
"""

import collections
import contextlib
import glob
import io
import json
import math
import os
import re
import unittest.mock

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.megatron_flags import (
    DEPRECATED,
    NO_EFFECT,
    NOT_SUPPORTED,
    NOT_YET,
    OUR_BEHAVIOUR,
    apply_megatron_fallbacks,
    unsupported_flags,
)

PLACEHOLDERS = {  # what a placeholder stands for when the command line is parsed
    "<data-prefix>": "data/stdlib_text_document",
    "<vocab.json>": "data/gpt2/vocab.json",
    "<merges.txt>": "data/gpt2/merges.txt",
    "<tokenizer.model>": "data/tokenizer/stdlib.model",
    "<dir>": "runs/megatron_flag_coverage",
    "<file>": "runs/megatron_flag_coverage/file",
    "<seed>": "1234",
}
MULTI_VALUE_FLAGS = ("--hierarchical-context-parallel-sizes", "--data-path", "--rampup-batch-size")


# ---------------------------------------------------------------------------- storage
def encode(command_lines: dict) -> dict:
    """Store each distinct [flag] or [flag, value] once; a command line is a list of indices."""
    table, index = [], {}
    encoded = {}
    for name, flags in command_lines.items():
        encoded[name] = [index.setdefault(tuple(f), len(index)) for f in flags]
    table = [list(pair) for pair, _ in sorted(index.items(), key=lambda item: item[1])]
    return {"flags": table, "command_lines": encoded}


def decode(stored: dict) -> dict:
    table = stored["flags"]
    return {name: [table[i] for i in indices] for name, indices in stored["command_lines"].items()}


# ---------------------------------------------------------------------------- extraction
def _placeholder(flag: str, value: str) -> str:
    if "${" not in value and "$" not in value:
        return value
    if flag == "--data-path":
        return "<data-prefix>"
    if flag == "--seed":
        return "<seed>"
    if value.endswith("vocab.json"):
        return "<vocab.json>"
    if value.endswith("merges.txt"):
        return "<merges.txt>"
    if value.endswith(".model"):
        return "<tokenizer.model>"
    return "<file>" if os.path.splitext(value)[1] else "<dir>"


def extract_functional_configs(megatron_dir: str, families: tuple[str, ...] = ("gpt",)) -> dict:
    """The pretraining configs of Megatron-LM's functional tests of these model families
    (`tests/functional_tests/test_cases/<family>/*/model_config.yaml`)."""
    import yaml

    paths = []
    for family in families:
        pattern = os.path.join(
            megatron_dir, f"tests/functional_tests/test_cases/{family}/*/model_config.yaml"
        )
        paths += sorted(glob.glob(pattern))
    configs = {}
    for path in paths:
        with open(path) as handle:
            config = yaml.safe_load(handle)
        if config.get("MODE") in ("inference", "rl") or not config.get("MODEL_ARGS"):
            continue
        flags = []
        for flag, value in config["MODEL_ARGS"].items():
            if value is True:
                flags.append([flag])
            elif value is not False:
                flags.append([flag, _placeholder(flag, str(value))])
        configs[os.path.basename(os.path.dirname(path))] = flags
    return configs


# ---------------------------------------------------------------------------- measurement
def command_line(flags: list) -> list[str]:
    argv = []
    for entry in flags:
        argv.append(entry[0])
        if len(entry) > 1:
            value = PLACEHOLDERS.get(entry[1], entry[1])
            if entry[0] in MULTI_VALUE_FLAGS:  # "[2 2]" and "2 2": two values
                argv.extend(re.sub(r"[\[\]]", "", value).split())
            else:
                argv.append(value)
    return argv


def world_size_of(flags: list) -> int:
    """The smallest world the command line's layout runs on: PP x lcm(TP x CP, ETP x EP)
    (the dense and the expert layouts must both fill it; megatron-core's rule), times the
    number of distributed optimizer copies it asks for."""
    values = {entry[0]: entry[1] for entry in flags if len(entry) > 1}
    tp = int(values.get("--tensor-model-parallel-size", 1))
    pp = int(values.get("--pipeline-model-parallel-size", 1))
    cp = int(values.get("--context-parallel-size", 1))
    ep = int(values.get("--expert-model-parallel-size", 1))
    etp = int(values.get("--expert-tensor-parallel-size", tp))
    copies = int(values.get("--num-distributed-optimizer-instances", 1))
    return pp * math.lcm(tp * cp, etp * ep) * copies


def classify(flags: list) -> tuple[str, list[str]]:
    """(outcome, details): details are the unsupported flags or the error line."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(command_line(flags))
    except SystemExit:
        return "parse error", [stderr.getvalue().strip().splitlines()[-1]]
    with contextlib.redirect_stdout(io.StringIO()):  # its warnings are not the report's
        apply_megatron_fallbacks(args)
    missing = unsupported_flags(args)
    if missing:
        return "not supported yet", missing
    try:
        # Megatron's command lines target GPU nodes (--bf16, NCCL): validate as on one,
        # whatever this machine is.
        with unittest.mock.patch("torch.cuda.is_available", return_value=True):
            validate_args(args, world_size=world_size_of(flags), check_files=False)
    except UserError as error:
        # a combination of supported flags that is not (`--foo with ... is not supported yet`)
        unsupported = re.match(r"^(.*) is not supported yet", str(error))
        if unsupported:
            return "not supported yet", [unsupported.group(1)]
        return "other error", [str(error)]
    return "accepted", []


def _checkpoint_format(flags: list) -> str:
    given = [f[1] for f in flags if f[0] == "--ckpt-format" and len(f) > 1]
    return given[-1] if given else "torch_dist"  # Megatron's default


def with_schedule(flags: list, schedule: str) -> list:
    """The command line with `--pipeline-schedule SCHEDULE` added (or replacing one given)."""
    return [f for f in flags if f[0] != "--pipeline-schedule"] + [["--pipeline-schedule", schedule]]


VIRTUAL_STAGE_FLAGS = ("--num-layers-per-virtual-pipeline-stage",
                       "--num-virtual-stages-per-pipeline-rank")  # fmt: skip


def uses_virtual_stages(flags: list) -> bool:
    return any(flag[0] in VIRTUAL_STAGE_FLAGS for flag in flags)


def report(command_lines: dict, schedule: str = "paci", examples: int = 2) -> str:
    """The outcomes of the command lines as they are, then with `--pipeline-schedule
    SCHEDULE` added (what a Megatron user who switches to it gets)."""
    total = len(command_lines)
    sources = f"{total - examples} functional-test configs"
    sources += f", {examples} examples" if examples else ""
    lines = [
        f"Command lines: {total} ({sources})",
        "",
        "### As they are (Megatron's default schedule, 1F1B-flush)",
        "",
    ]
    lines += _outcome_report(command_lines)
    changed = {name: with_schedule(flags, schedule) for name, flags in command_lines.items()}
    lines += ["", f"### With `--pipeline-schedule {schedule}` added", ""]
    lines += _outcome_report(changed)
    virtual = [name for name, flags in command_lines.items() if uses_virtual_stages(flags)]
    accepted = [sum(classify(lines_of[name])[0] == "accepted" for name in virtual)
                for lines_of in (command_lines, changed)]  # fmt: skip
    lines += ["", f"Command lines with virtual pipeline stages: {len(virtual)}; accepted as they "
              f"are: {accepted[0]}, with `--pipeline-schedule {schedule}`: {accepted[1]}."]  # fmt: skip
    return "\n".join(lines)


def _outcome_report(command_lines: dict) -> list[str]:
    outcomes = {name: classify(flags) for name, flags in command_lines.items()}
    total = len(outcomes)
    counts = collections.Counter(outcome for outcome, _ in outcomes.values())
    parsed = total - counts["parse error"]
    lines = [
        "| outcome | command lines | share |",
        "|---|---|---|",
    ]
    for outcome in ("accepted", "not supported yet", "other error", "parse error"):
        lines.append(f"| {outcome} | {counts[outcome]} | {100 * counts[outcome] / total:.1f}% |")
    dist_format = sum(
        outcome == "accepted" and _checkpoint_format(command_lines[name]) == "torch_dist"
        for name, (outcome, _) in outcomes.items()
    )
    lines += ["", f"Parsed: {parsed} of {total} ({100 * parsed / total:.1f}%).",
              f"Accepted with the `torch_dist` checkpoint format (given, or Megatron's default): "
              f"{dist_format}.", ""]  # fmt: skip
    lines += _blocking_table(outcomes)
    lines += _error_list(outcomes)
    return lines


def _blocking_table(outcomes: dict) -> list[str]:
    by_flag = collections.Counter()
    alone = collections.Counter()
    for outcome, details in outcomes.values():
        if outcome != "not supported yet":
            continue
        names = sorted(set(details))
        by_flag.update(names)
        if len(names) == 1:
            alone[names[0]] += 1
    lines = [
        "Flags (or flag values) that are not supported yet, by the number of command lines",
        "that use them (and that nothing else blocks):",
        "",
        "| flag | command lines | only blocker |",
        "|---|---|---|",
    ]
    lines += [f"| `{flag}` | {n} | {alone[flag]} |" for flag, n in by_flag.most_common()]
    return lines + [""]


def _error_list(outcomes: dict) -> list[str]:
    errors = [(name, outcome, details[0]) for name, (outcome, details) in sorted(outcomes.items())
              if outcome in ("other error", "parse error")]  # fmt: skip
    if not errors:
        return ["No command line fails to parse or fails for a reason other than a feature."]
    return ["Other failures:", ""] + [
        f"- {name}: {outcome}: {line}" for name, outcome, line in errors
    ]


# ---------------------------------------------------------------------------- parser flags
# Megatron-LM's pretraining flags left aside (the scope of docs/megatron_flags.md): RL,
# inference, vision, BERT/T5/retro, Mamba and hybrid models, FSDP, CUDA graphs, and mixture of
# experts with multi-token prediction.
LEFT_ASIDE_GROUPS = ("rl", "inference", "vision", "biencoder", "moe")
LEFT_ASIDE_NAMES = re.compile(
    r"moe|expert|mamba|hybrid|fsdp|cuda-graph|inference|^--rl-|grpo|bert|t5|retro|mtp"
)


def in_scope(group: str, flag: str) -> bool:
    return group not in LEFT_ASIDE_GROUPS and not LEFT_ASIDE_NAMES.search(flag)


def extract_parser_flags(megatron_dir: str, script: str) -> list:
    """[group, flag, kind] of every in-scope flag of a Megatron-LM checkout's parser, read by
    `script` (tools/megatron_parser_flags.py) in a process of its own."""
    import subprocess
    import sys

    listed = subprocess.run([sys.executable, script, megatron_dir], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    return [entry for entry in json.loads(listed) if in_scope(entry[0], entry[1])]


def status_of(flag: str, known: set) -> str:
    """How our parser treats one of Megatron's flags."""
    if flag not in known:
        return "unknown"
    if flag in DEPRECATED:
        return "deprecated: Megatron's error"
    if flag in NO_EFFECT:
        return "deprecated: no effect, Megatron's notice"
    behaviour = {f.name: f for f in OUR_BEHAVIOUR}
    if flag in behaviour:
        partly = behaviour[flag].type is not None and behaviour[flag].supported not in (None,)
        return "our behaviour (other values: not supported yet)" if partly else "our behaviour"
    if flag in {f.name for f in NOT_SUPPORTED + NOT_YET}:
        return "not supported yet"
    return "implemented"


def parser_flag_statuses(parser_flags: list) -> list[tuple[str, str, str]]:
    """(flag, Megatron's group, status) for each stored Megatron flag."""
    known = set(build_parser()._option_string_actions)
    return [(flag, group, status_of(flag, known)) for group, flag, _ in parser_flags]


def parser_flag_report(parser_flags: list) -> str:
    statuses = parser_flag_statuses(parser_flags)
    counts = collections.Counter(status for _, _, status in statuses)
    lines = [f"Megatron-LM pretraining flags in scope: {len(statuses)}", "",
             "| status | flags |", "|---|---|"]  # fmt: skip
    lines += [f"| {status} | {n} |" for status, n in sorted(counts.items())]
    unknown = [f"{flag} ({group})" for flag, group, status in statuses if status == "unknown"]
    lines += ["", f"Unknown to our parser: {len(unknown)}" + (":" if unknown else ".")]
    return "\n".join(lines + [f"- {entry}" for entry in unknown])


def parser_flag_table(parser_flags: list) -> str:
    """One markdown row per Megatron flag (docs/megatron_flags.md)."""
    rows = ["| flag | Megatron's group | here |", "|---|---|---|"]
    rows += [f"| `{flag}` | {group} | {status} |"
             for flag, group, status in parser_flag_statuses(parser_flags)]  # fmt: skip
    return "\n".join(rows)
