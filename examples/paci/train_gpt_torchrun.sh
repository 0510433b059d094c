#!/usr/bin/env bash
# One node, 8 GPUs: GPT-2 Medium, 8 pipeline stages, PACI with a = 8 (sentencepiece tokenizer).
# Usage: bash examples/paci/train_gpt_torchrun.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
# A shorthand for examples/paci/pretrain_gpt2_medium.sh, whose variables (SCHEDULE, A, PP, ...)
# apply here too; see `bash examples/paci/pretrain_gpt2_medium.sh --help`.
set -euo pipefail
export DATA_PATH=${1:?data prefix (.bin/.idx from tools/preprocess_data.py)}
export TOKENIZER_MODEL=${2:?sentencepiece model}
shift 2
export TOKENIZER_TYPE=SentencePieceTokenizer
exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_gpt2_medium.sh" "$@"
