#!/usr/bin/env bash
# One node, 8 GPUs: GPT-2 Medium-like model, 8 pipeline stages, PACI with a = 8.
# Usage: bash examples/paci/train_gpt_torchrun.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
#   e.g. SCHEDULE=1f1b for the synchronous baseline; TP/PP/NPROC to change the layout.
set -euo pipefail
DATA_PREFIX=${1:?data prefix (.bin/.idx from tools/preprocess_data.py)}
TOKENIZER_MODEL=${2:?sentencepiece model}
shift 2
NPROC=${NPROC:-8}
TP=${TP:-1}
PP=${PP:-8}
SCHEDULE=${SCHEDULE:-paci}
OUT=${OUT:-runs/gpt2-medium-$SCHEDULE}

torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --seq-length 1024 --max-position-embeddings 1024 \
  --micro-batch-size 16 --global-batch-size 128 --train-iters 20000 \
  --optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --untie-embeddings-and-output-weights \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --pipeline-schedule "$SCHEDULE" --distributed-backend nccl \
  --data-path "$DATA_PREFIX" --split 969,30,1 --data-cache-path "$OUT/cache" \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
  --log-interval 10 --eval-interval 1000 --eval-iters 20 \
  --save "$OUT/checkpoints" --save-interval 2000 \
  --tensorboard-dir "$OUT/tensorboard" --metrics-dir "$OUT" "$@"
