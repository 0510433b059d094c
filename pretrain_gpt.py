"""Pretrain a GPT model with megatron-core, on any pipeline schedule.

    torchrun --standalone --nproc-per-node 4 pretrain_gpt.py \
        --pipeline-model-parallel-size 4 --pipeline-schedule paci ...

Megatron's shape: `forward_step` reads a microbatch and runs the model; `loss_func` reduces
the per-token losses (both in megatron/training/gpt_step.py, which the studies' single-process
engine runs too). The schedule (1F1B-flush, PACI, ...) decides when each runs.
"""

import sys

from megatron.training.entry import run_pretraining
from megatron.training.gpt_step import forward_step, get_batch, loss_func  # noqa: F401


def main(argv=None) -> int:
    return run_pretraining(argv, forward_step)


if __name__ == "__main__":
    sys.exit(main())
