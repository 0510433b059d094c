"""The launch scripts users start from: syntax, usage, the exact command they print, that
pretrain_gpt.py accepts every flag in it, and a real two-node launch on loopback."""

import glob
import json
import math
import os
import re
import subprocess
import sys
import unittest.mock

import pytest
import run_cases
from launch_helpers import (
    CPU_CASE_EXTRA_FLAGS,
    CPU_CASE_VARIABLES,
    MEDIUM_SCRIPT,
    NOT_NUMERIC,
    REFERENCE_CASE,
    REPO,
    dry_run,
    launcher_flags,
    reference_case_flags,
    reference_environment,
    script_environment,
    split_command,
)
from slurm_cluster import free_port

from megatron.training.arguments import build_parser, validate_args

LAUNCH_SCRIPTS = sorted(
    glob.glob(os.path.join(REPO, "examples", "paci", "*.sh"))
    + glob.glob(os.path.join(REPO, "examples", "paci", "*.slurm"))
    + [os.path.join(REPO, "tools", "install_slurm.sh")]
)
GPT2_FILES = {"VOCAB_FILE": "gpt2-vocab.json", "MERGE_FILE": "gpt2-merges.txt"}


@pytest.mark.parametrize("script", LAUNCH_SCRIPTS, ids=os.path.basename)
def test_launch_script_syntax(script):
    completed = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_gpt2_medium_usage():
    completed = subprocess.run(["bash", MEDIUM_SCRIPT, "--help"], capture_output=True, text=True)
    assert completed.returncode == 0
    assert completed.stdout.startswith("usage:")
    for variable in (
        "SCHEDULE",
        "A",
        "GLOBAL_BATCH",
        "LR",
        "DATA_PATH",
        "TOKENIZER_TYPE",
        "DRY_RUN",
    ):
        assert re.search(rf"^ +{variable}[ =]", completed.stdout, re.MULTILINE), variable


@pytest.fixture(scope="module")
def dataset_prefix(tmp_path_factory):
    """A tiny real .bin/.idx pair, so the printed command also passes data validation."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("data") / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for document in range(10):
        builder.add_item(torch.arange(40 + document, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def parsed_dry_run(variables: dict[str, str], world_size: int):
    completed = dry_run(variables)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 1, completed.stdout
    torchrun_args, pretrain_args = split_command(lines[0])
    args = build_parser().parse_args(pretrain_args)  # parse only: no process group, no GPU
    # The script targets GPU nodes (--bf16, NCCL): validate as on one, whatever this machine is.
    with unittest.mock.patch("torch.cuda.is_available", return_value=True):
        validate_args(args, world_size=world_size)
    return launcher_flags(torchrun_args), args


def test_gpt2_medium_defaults_are_the_paper_setup(dataset_prefix):
    launch, args = parsed_dry_run({"DATA_PATH": dataset_prefix, **GPT2_FILES}, world_size=8)
    assert launch == {"--standalone": "", "--nproc-per-node": "8"}
    shape = (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length)
    assert shape == (24, 1024, 16, 1024)
    assert args.pipeline_model_parallel_size == 8 and args.tensor_model_parallel_size == 1
    assert args.bf16 and args.distributed_backend == "nccl"
    assert args.optimizer == "adam" and (args.adam_beta1, args.adam_beta2) == (0.9, 0.95)
    assert args.weight_decay == 0.1 and args.lr_decay_style == "cosine"
    assert args.pipeline_schedule == "paci"
    assert args.global_batch_size == 256 and args.num_microbatches == 8
    assert args.micro_batch_size == 32
    assert args.lr == pytest.approx(3e-4) and args.min_lr == pytest.approx(3e-5)
    assert args.tokenizer_type == "GPT2BPETokenizer" and args.vocab_file == "gpt2-vocab.json"
    assert args.data_path == [dataset_prefix]


@pytest.mark.parametrize("global_batch", [128, 256, 512])
def test_gpt2_medium_lr_follows_sqrt_rule(dataset_prefix, global_batch):
    variables = {"DATA_PATH": dataset_prefix, "GLOBAL_BATCH": str(global_batch), **GPT2_FILES}
    _, args = parsed_dry_run(variables, world_size=8)
    assert args.lr == pytest.approx(3e-4 * math.sqrt(global_batch / 256), rel=1e-4)
    assert args.global_batch_size == global_batch


def test_gpt2_medium_schedule_a_tokenizer_and_layout_are_selectable(dataset_prefix):
    variables = {
        "DATA_PATH": dataset_prefix, "SCHEDULE": "1f1b", "A": "4", "GLOBAL_BATCH": "128",
        "LR": "1e-4", "TOKENIZER_TYPE": "SentencePieceTokenizer", "TOKENIZER_MODEL": "sp.model",
        "NNODES": "2", "NPROC_PER_NODE": "8", "RDZV_ENDPOINT": "node1:29500", "RDZV_ID": "job7",
    }  # fmt: skip
    launch, args = parsed_dry_run(variables, world_size=16)
    assert launch["--nnodes"] == "2" and launch["--rdzv-backend"] == "c10d"
    assert launch["--rdzv-endpoint"] == "node1:29500" and launch["--rdzv-id"] == "job7"
    assert "--standalone" not in launch
    assert args.pipeline_schedule == "1f1b" and args.lr == 1e-4
    assert args.data_parallel_size == 2 and args.num_microbatches == 4
    assert args.micro_batch_size == 16  # 128 = 16 x 4 microbatches x 2 data-parallel
    assert args.tokenizer_model == "sp.model"


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"GLOBAL_BATCH": "100"}, "GLOBAL_BATCH 100 is not divisible"),
        ({"VOCAB_FILE": "v", "MERGE_FILE": "m"}, "DATA_PATH is not set"),
        ({"MOCK_DATA": "1", "VOCAB_FILE": "v"}, "MERGE_FILE is not set"),
        ({"MOCK_DATA": "1", "TOKENIZER_TYPE": "Bert"}, "unknown TOKENIZER_TYPE"),
        ({"MOCK_DATA": "1", "NNODES": "2", **GPT2_FILES}, "RDZV_ENDPOINT is not set"),
    ],
)
def test_gpt2_medium_bad_variables_fail_with_one_line(variables, message):
    completed = dry_run(variables)
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert completed.stderr.startswith("error: ") and message in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1


def test_cpu_variables_reproduce_the_reference_case():
    """The launched runs below are checked against the reference case's golden losses, which
    is only valid if the script's command trains exactly that case."""
    completed = dry_run({**CPU_CASE_VARIABLES, "NNODES": "2", "NPROC_PER_NODE": "2",
                         "RDZV_ENDPOINT": "127.0.0.1:1"}, CPU_CASE_EXTRA_FLAGS)  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    _, pretrain_args = split_command(completed.stdout)
    launched = vars(build_parser().parse_args(pretrain_args))
    reference = vars(build_parser().parse_args(reference_case_flags("unused")))
    differences = {
        key: (launched[key], reference[key])
        for key in reference
        if key not in NOT_NUMERIC and launched[key] != reference[key]
    }
    assert differences == {}


def test_two_nodes_on_loopback_train_like_one(tmp_path):
    """Two torchrun agents (2 nodes x 2 processes, c10d rendezvous on 127.0.0.1) run a 4-stage
    PACI job through the GPT-2 Medium script; it must finish and reproduce the single-node
    reference case's losses."""
    output = str(tmp_path / "run")
    variables = {
        **CPU_CASE_VARIABLES, **reference_environment(), "NNODES": "2", "NPROC_PER_NODE": "2",
        "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "loopback", "OUT": output,
    }  # fmt: skip
    agents = [
        subprocess.Popen(
            ["bash", MEDIUM_SCRIPT, *CPU_CASE_EXTRA_FLAGS],
            cwd=REPO, env=script_environment(**variables), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(2)
    ]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=400)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, log in zip(agents, logs):
        assert agent.returncode == 0, log[-5000:]
    summary = json.load(open(os.path.join(output, "summary.json")))
    assert summary["pipeline_stages"] == 4 and summary["data_parallel"] == 1
    assert summary["iterations"] == 8 and len(summary["loss"]) == 8
    golden = run_cases.golden_losses(REFERENCE_CASE)
    assert run_cases.relative_difference(summary["loss"], golden) <= 1e-5
    assert [stage["max_drift"] for stage in summary["stages"]] == [1, 1, 1, 0]


def test_replicate_cases_use_one_global_batch_and_accepted_flags(tmp_path):
    """examples/paci/replicate_cpu.sh's runs: every case parses, all at the same global batch,
    flush plus PACI with a in {1, 2, 4, 8}, each with its own output directory."""
    command = [sys.executable, os.path.join(REPO, "tools", "replicate.py"), "cases", "--seed", "3",
               "--iterations", "20", "--runs", str(tmp_path)]  # fmt: skip
    cases = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    parsed = [build_parser().parse_args(case["args"]) for case in cases]
    runs = sorted(
        (args.pipeline_schedule, args.global_batch_size // args.micro_batch_size) for args in parsed
    )
    assert runs == [("1f1b", 8), ("paci", 1), ("paci", 2), ("paci", 4), ("paci", 8)]
    assert {args.global_batch_size for args in parsed} == {16}
    assert {args.seed for args in parsed} == {3}
    assert len({case["metrics_dir"] for case in cases}) == len(cases)
