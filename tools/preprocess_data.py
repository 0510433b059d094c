"""Tokenize a jsonl corpus into Megatron indexed datasets (``.bin``/``.idx``).

A command line over ``megatron.training.data.preprocessing``, which documents the details.

Example::

    python tools/preprocess_data.py --input data/stdlib.jsonl \\
        --output-prefix data/stdlib --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tokenizer/stdlib.model --append-eod --workers 2

writes ``data/stdlib_text_document.bin`` and ``data/stdlib_text_document.idx``.
"""

import sys

from megatron.common.errors import run_tool
from megatron.training.data.preprocessing import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
