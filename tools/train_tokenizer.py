"""Train a SentencePiece BPE tokenizer model from a jsonl corpus.

A command line over ``megatron.training.tokenizer.sentencepiece_training``, which documents the details.

Example::

    python tools/train_tokenizer.py --input data/stdlib.jsonl --json-key text \\
        --output-prefix data/tokenizer/stdlib --vocab-size 8192

writes ``data/tokenizer/stdlib.model`` (for ``--tokenizer-model``) and a readable
``data/tokenizer/stdlib.vocab``.
"""

import sys

from megatron.common.errors import run_tool
from megatron.training.tokenizer.sentencepiece_training import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
