"""Write a TikToken vocabulary file in Megatron's format (``--tokenizer-type TikTokenizer
--tokenizer-model FILE.json``) from a GPT-2 style BPE ``vocab.json``, such as the one
``tools/train_gpt2_bpe.py`` trains on the corpus; nothing is downloaded.

    python tools/build_tiktoken_vocab.py --vocab-file data/gpt2/vocab.json \\
        --output data/gpt2/tiktoken.json

A command line over ``megatron.training.tokenizer.tiktoken_vocab``
(``tiktoken_tokenizer`` documents the format).
"""

import sys

from megatron.common.errors import run_tool
from megatron.training.tokenizer.tiktoken_vocab import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
