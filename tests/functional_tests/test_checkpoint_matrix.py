"""Every optimizer x precision x checkpoint format x schedule saves, resumes and continues
exactly as the uninterrupted run.

Each combination trains 4 iterations on 2 pipeline stages, saving after iteration 2 (the
uninterrupted run); a second run loads that checkpoint (`--ckpt-step 2`) and trains
iterations 3 and 4. Iteration 3's loss checks the weights, iteration 4's the optimizer state
(moments, Muon's momentum, the fp32 main weights, the fp16 loss scale, each stage's step
count under PACI). The losses must be bit-identical: both runs are deterministic.

All 168 runs share one 2-process launch (about a minute on two cores).
"""

import itertools
import json
import os
import subprocess
import sys

import pytest
from run_cases import HERE, REPO

from megatron.training.optimizer.flags import OPTIMIZER_NAMES

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 4 --train-iters 4 "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 "
    "--clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --seed 1234 --log-interval 1 "
    "--eval-iters 0 --pipeline-model-parallel-size 2 --deterministic-mode"
).split()
PRECISIONS = {
    "fp32": [],
    "bf16": ["--bf16"],
    "fp16": ["--fp16", "--initial-loss-scale", "4096"],  # no overflow skips at the start
}
FORMATS = ("torch", "torch_dist")
SCHEDULES = ("1f1b", "paci")
COMBINATIONS = list(itertools.product(OPTIMIZER_NAMES, PRECISIONS, FORMATS, SCHEDULES))


def _name(optimizer: str, precision: str, ckpt_format: str, schedule: str) -> str:
    return f"{optimizer}_{precision}_{ckpt_format}_{schedule}"


def _runs(output: str) -> list[dict]:
    """The uninterrupted runs first (they write the checkpoints), then the resumed ones."""
    whole, resumed = [], []
    for optimizer, precision, ckpt_format, schedule in COMBINATIONS:
        name = _name(optimizer, precision, ckpt_format, schedule)
        flags = MODEL + ["--optimizer", optimizer, *PRECISIONS[precision],
                         "--ckpt-format", ckpt_format, "--pipeline-schedule", schedule,
                         "--data-cache-path", os.path.join(output, "index_cache")]  # fmt: skip
        checkpoint = os.path.join(output, name, "checkpoint")
        whole.append({"name": f"{name}/whole", "metrics_dir": os.path.join(output, name, "whole"),
                      "args": flags + ["--save", checkpoint, "--save-interval", "2"]})  # fmt: skip
        resumed.append({"name": f"{name}/resumed", "args": flags + ["--load", checkpoint,
                        "--ckpt-step", "2"], "metrics_dir": os.path.join(output, name, "resumed")})  # fmt: skip
    return whole + resumed


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict[str, tuple[list[float], list[float]]]:
    """combination name -> (uninterrupted losses, resumed losses)."""
    output = str(tmp_path_factory.mktemp("checkpoint_matrix"))
    spec = os.path.join(output, "runs.json")
    json.dump(_runs(output), open(spec, "w"))
    # torchrun's agent in the launching process, the workers forked after the imports
    command = [sys.executable, os.path.join(HERE, "multi_run.py"), "--nproc-per-node=2", spec]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-6000:]
    result = {}
    for combination in COMBINATIONS:
        name = _name(*combination)
        read = [json.load(open(os.path.join(output, name, part, "summary.json")))["loss"]
                for part in ("whole", "resumed")]  # fmt: skip
        result[name] = tuple(read)
    return result


@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: _name(*c))
def test_a_resumed_run_continues_the_uninterrupted_one(losses, combination):
    whole, resumed = losses[_name(*combination)]
    assert len(whole) == 4 and whole[-1] < whole[0]  # it trains
    assert resumed == whole[2:]


def test_the_combinations_differ(losses):
    """Each axis changes the numbers (the matrix is not one run repeated): the optimizers,
    the precisions and the schedules give other losses after the first step."""
    fourth = {name: whole[3] for name, (whole, _) in losses.items()}
    for axis in range(4):
        if axis == 2:  # the checkpoint format changes nothing before the resume
            continue
        groups = {}
        for combination in COMBINATIONS:
            rest = combination[:axis] + combination[axis + 1 :]
            groups.setdefault(rest, set()).add(fourth[_name(*combination)])
        assert all(len(values) > 1 for values in groups.values()), axis
