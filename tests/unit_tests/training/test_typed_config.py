"""The run's typed configuration: built once from the flags, read everywhere else.

The parsed namespace stays at the edges (parsing, the flag checks, the entry points that build
the configuration); the rest of megatron/ takes typed sections, and decides by the pipeline
plan's properties rather than by schedule names. These checks read the source."""

import ast
import dataclasses
import pathlib
import re

import pytest
from small_run_flags import validated

from megatron.training import config as run_config

ROOT = pathlib.Path(__file__).resolve().parents[3] / "megatron"
# The flag modules: the parser, its checks, Megatron's flags we refuse or accept as ours
ARGUMENT_MODULES = {"training/arguments.py", "training/validation.py",
                    "training/megatron_flags.py", "model/moe/flags.py",
                    "training/optimizer/flags.py", "training/pipeline_flags.py",
                    "training/layout_flags.py", "training/loop_flags.py"}  # fmt: skip
CONFIG_MODULES = {"training/config.py", "training/optimizer/config.py"}
# Flag checks and parser groups that live beside what they check (e.g. batch_schedule.py's
# validate_rampup): the edge too
FLAG_CHECK = re.compile(r"^_?(add_\w*args|validate\w*|reject\w*)$")
SECTIONS = [
    run_config.ModelConfig, run_config.MoEConfig, run_config.ParallelConfig,
    run_config.PipelineConfig, run_config.TrainingConfig, run_config.DataConfig,
    run_config.CheckpointConfig, run_config.LoggingConfig,
]  # fmt: skip
# Section fields that are no flag: resolved from the flags or the run
DERIVED = {"plan", "source", "run_id", "flags"}


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative not in ARGUMENT_MODULES | CONFIG_MODULES:
            yield relative, ast.parse(path.read_text())


def functions_taking_args() -> list[str]:
    found = []
    for relative, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if "args" in (p.arg for p in params) and not FLAG_CHECK.match(node.name):
                    found.append(f"{relative}:{node.name}")
    return found


def getattr_of_args() -> list[str]:
    """`getattr(args, ...)` outside the flag checks."""
    found = []
    for relative, tree in modules():
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef) or FLAG_CHECK.match(function.name):
                continue
            for node in ast.iter_child_nodes(function):
                for call in ast.walk(node):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                            and call.func.id == "getattr" and call.args
                            and isinstance(call.args[0], ast.Name)
                            and call.args[0].id == "args"):  # fmt: skip
                        found.append(f"{relative}:{function.name}:{call.lineno}")
    return sorted(set(found))


def test_args_stays_at_the_edges():
    taking = functions_taking_args()
    assert not [f for f in taking if f.startswith("pipeline/")], taking
    assert len(taking) <= 20, taking
    reads = getattr_of_args()
    assert not [r for r in reads if r.startswith("pipeline/")], reads
    assert len(reads) <= 10, reads


SCHEDULE_NAMES = r"(paci|1f1b|2bw|pipedream|zb-h1|zb-v|dualpipe-v|gpipe)"
COMPARED = re.compile(
    rf"""(==|!=)\s*["']{SCHEDULE_NAMES}["']|["']{SCHEDULE_NAMES}["']\s*(==|!=)"""
    rf"""|\bin\s*\(\s*["']{SCHEDULE_NAMES}["']"""
)


def test_the_loop_and_the_runtime_ask_the_plan_not_the_schedule_name():
    """Schedule facts are properties of the plan; names are compared only where flags are
    read (the parser and its checks) and in the schedules' own definitions."""
    compared = []
    for relative, _ in modules():
        if not relative.startswith(("training/", "pipeline/", "model/", "distributed/")):
            continue  # benchmarks and studies label their reports by name
        if relative.startswith(("pipeline/schedules/", "pipeline/simulation/")):
            continue
        for number, line in enumerate((ROOT / relative).read_text().splitlines(), 1):
            if COMPARED.search(line) and "def validate" not in line:
                compared.append(f"{relative}:{number}: {line.strip()}")
    # batch_schedule.validate_accumulation_schedule checks the flag's schedule
    assert compared == [
        line for line in compared if line.startswith("training/batch_schedule.py")
    ], compared


def test_every_section_field_is_a_flag_or_derived():
    """A field whose name is no flag would keep its default silently."""
    args = validated([])
    for section in SECTIONS:
        for spec in dataclasses.fields(section):
            assert spec.name in DERIVED or hasattr(args, spec.name), (section, spec.name)


def test_the_configuration_is_the_flags_typed_and_frozen():
    args = validated(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "paci",
                      "--untie-embeddings-and-output-weights", "--bf16",
                      "--eval-iters", "0"], world_size=4)  # fmt: skip
    config = run_config.RunConfig.from_args(args, vocab_size=100)
    assert config.model.hidden_size == args.hidden_size == 64
    assert config.model.padded_vocab_size == 128  # Megatron's padding to 128 x TP
    assert config.parallel.data_parallel_size == 2 and config.parallel.stage_layers == (2, 2)
    assert config.pipeline.plan.name == "paci" and not config.pipeline.plan.flushes
    assert config.pipeline.plan.schedule.inflight_window(0, 2, 4) == 2  # PACI's N - s
    assert config.training.num_microbatches == 2 and config.moe is None
    assert str(config.model.dtype) == "torch.bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 128
    assert config.with_run_id("r1").checkpoint.run_id == "r1" and config.checkpoint.run_id is None
