"""Train a GPT-2 style byte-level BPE (``vocab.json`` + ``merges.txt``) from a jsonl corpus.

A command line over ``megatron.training.tokenizer.gpt2_bpe_training``, which documents the details.

    python tools/train_gpt2_bpe.py --input data/stdlib.jsonl --output-dir data/gpt2 \\
        --vocab-size 8192
"""

import sys

from megatron.common.errors import run_tool
from megatron.training.tokenizer.gpt2_bpe_training import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
