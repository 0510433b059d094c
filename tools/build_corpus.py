"""Write a jsonl text corpus from the Python standard library sources of this interpreter.

A command line over ``megatron.training.data.corpus``, which documents the details.

Example::

    python tools/build_corpus.py --output data/stdlib.jsonl
"""

import sys

from megatron.common.errors import run_tool
from megatron.training.data.corpus import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
