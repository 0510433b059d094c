#!/usr/bin/env bash
# GPT-2 Medium pretraining on 8 pipeline stages with PACI or 1F1B-flush: the PACI paper's
# experiment. One torchrun per node; run it once per node (Slurm: examples/paci/train_gpt.slurm).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: [VAR=value ...] bash examples/paci/pretrain_gpt2_medium.sh [more pretrain_gpt.py flags]

GPT-2 Medium (24 layers, hidden 1024, 16 heads, seq 1024), 8 pipeline stages, bf16,
AdamW (betas 0.9/0.95, weight decay 0.1, cosine decay to LR/10), untied embeddings.
Flags given after the script are appended to pretrain_gpt.py's (a later flag wins).

Schedule and batch
  SCHEDULE        paci | 1f1b                                  (default paci)
  A               microbatches per step: PACI's accumulation a, flush's m     (default 8)
  GLOBAL_BATCH    sequences per optimizer step, 128 or 256 in the paper      (default 256)
                  micro batch = GLOBAL_BATCH / (A x data-parallel size)
  LR              peak LR; default 3e-4 x sqrt(GLOBAL_BATCH / 256) (the paper's rule)
  MIN_LR          default LR / 10
  TRAIN_ITERS     (default 20000)     WARMUP_ITERS (default 500)     SEED (default 1234)
Data and tokenizer
  DATA_PATH       prefix of the .bin/.idx from tools/preprocess_data.py, or a blend
                  "WEIGHT PREFIX WEIGHT PREFIX ..." (required, or MOCK_DATA=1)
  TOKENIZER_TYPE  GPT2BPETokenizer (VOCAB_FILE, MERGE_FILE) | SentencePieceTokenizer
                  (TOKENIZER_MODEL) | NullTokenizer (VOCAB_SIZE)      (default GPT2BPETokenizer)
  MOCK_DATA=1     synthetic tokens instead of DATA_PATH
Model (GPT-2 Medium unless changed, e.g. for a CPU trial)
  NUM_LAYERS (24)  HIDDEN (1024)  HEADS (16)  SEQ (1024)
Layout and launch
  PP (8)  TP (1)  NPROC_PER_NODE (TP x PP)  NNODES (1)
  RDZV_ENDPOINT   host:port of the c10d rendezvous; unset with NNODES=1: --standalone
  RDZV_ID         rendezvous id, the same on every node             (default paci-gpt2-medium)
  PRECISION       bf16 | fp32 (default bf16)     BACKEND nccl | gloo (default nccl)
  OUT             run directory (default runs/gpt2-medium-SCHEDULE-aA)
  TORCHRUN        torchrun to use (default torchrun)
  DRY_RUN=1       print the exact command and exit
EOF
}

fail() {
  echo "error: $*" >&2
  exit 2
}

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  usage
  exit 0
fi

SCHEDULE=${SCHEDULE:-paci}
A=${A:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
WARMUP_ITERS=${WARMUP_ITERS:-500}
SEED=${SEED:-1234}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN=${HIDDEN:-1024}
HEADS=${HEADS:-16}
SEQ=${SEQ:-1024}
PP=${PP:-8}
TP=${TP:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$((TP * PP))}
NNODES=${NNODES:-1}
RDZV_ID=${RDZV_ID:-paci-gpt2-medium}
PRECISION=${PRECISION:-bf16}
BACKEND=${BACKEND:-nccl}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
OUT=${OUT:-runs/gpt2-medium-$SCHEDULE-a$A}
TORCHRUN=${TORCHRUN:-torchrun}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PRETRAIN=${PRETRAIN:-$REPO/pretrain_gpt.py}

# Micro batch from the global batch: GLOBAL_BATCH = micro x A x data parallel.
WORLD=$((NNODES * NPROC_PER_NODE))
[ $((WORLD % (TP * PP))) = 0 ] ||
  fail "NNODES x NPROC_PER_NODE = $WORLD is not divisible by TP x PP = $((TP * PP))"
DP=$((WORLD / (TP * PP)))
[ $((GLOBAL_BATCH % (A * DP))) = 0 ] ||
  fail "GLOBAL_BATCH $GLOBAL_BATCH is not divisible by A x data parallel = $A x $DP"
MICRO_BATCH=$((GLOBAL_BATCH / (A * DP)))

# The paper's learning-rate rule: 3e-4 at global batch 256, scaled by the square root.
LR=${LR:-$(awk -v b="$GLOBAL_BATCH" 'BEGIN { printf "%.4e", 3e-4 * sqrt(b / 256) }')}
MIN_LR=${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%.4e", lr / 10 }')}

# need NAME WHAT: variable NAME must be set, else one error line saying what it should hold.
need() {
  [ -n "${!1:-}" ] || fail "$1 is not set ($2); see --help"
}

DATA_ARGS=(--tokenizer-type "$TOKENIZER_TYPE")
case "$TOKENIZER_TYPE" in
  GPT2BPETokenizer)
    need VOCAB_FILE "GPT-2's vocab.json" && need MERGE_FILE "GPT-2's merges.txt"
    DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE") ;;
  SentencePieceTokenizer)
    need TOKENIZER_MODEL "a sentencepiece .model file"
    DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL") ;;
  NullTokenizer)
    need VOCAB_SIZE "the vocabulary size"
    DATA_ARGS+=(--vocab-size "$VOCAB_SIZE") ;;
  *) fail "unknown TOKENIZER_TYPE $TOKENIZER_TYPE (GPT2BPETokenizer, SentencePieceTokenizer," \
    "NullTokenizer)" ;;
esac
if [ "${MOCK_DATA:-0}" = 1 ]; then
  DATA_ARGS+=(--mock-data)
else
  need DATA_PATH "a .bin/.idx prefix, or MOCK_DATA=1"
  read -ra DATA_WORDS <<<"$DATA_PATH" # one prefix, or "weight prefix weight prefix ..."
  DATA_ARGS+=(--data-path "${DATA_WORDS[@]}" --split 969,30,1 --data-cache-path "$OUT/cache")
fi

case "$PRECISION" in
  bf16) PRECISION_ARGS=(--bf16) ;;
  fp32) PRECISION_ARGS=() ;;
  *) fail "unknown PRECISION $PRECISION (bf16, fp32)" ;;
esac

if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  LAUNCH=(--standalone --nproc-per-node "$NPROC_PER_NODE")
else
  need RDZV_ENDPOINT "host:port of the first node, needed with NNODES > 1"
  LAUNCH=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d
    --rdzv-endpoint "$RDZV_ENDPOINT"
    --rdzv-id "$RDZV_ID")
fi

# Untied input and output embeddings, the paper's setup and the only one PACI runs (tying them
# needs a first/last-stage all-reduce every step). Passed where the parser knows the flag.
EMBEDDING_ARGS=()
if grep -rqs -- "--untie-embeddings-and-output-weights" "$REPO/megatron/training/"; then
  EMBEDDING_ARGS=(--untie-embeddings-and-output-weights)
fi

ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --attention-dropout 0.0 --hidden-dropout 0.0 "${PRECISION_ARGS[@]}" "${EMBEDDING_ARGS[@]}"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --optimizer adam --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --clip-grad 1.0 --seed "$SEED"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --pipeline-schedule "$SCHEDULE" --distributed-backend "$BACKEND" --distributed-timeout-minutes 30
  "${DATA_ARGS[@]}"
  --log-interval 10 --eval-interval 1000 --eval-iters 20
  --save "$OUT/checkpoints" --save-interval 2000
  --metrics-dir "$OUT" --tensorboard-dir "$OUT/tensorboard"
)
COMMAND=("$TORCHRUN" "${LAUNCH[@]}" "$PRETRAIN" "${ARGS[@]}" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  # Shell-quoted only where needed, so the line can be pasted as is.
  for word in "${COMMAND[@]}"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:,=+@%-]+$ ]]; then
      printf '%s ' "$word"
    else
      printf '%q ' "$word"
    fi
  done
  printf '\n'
  exit 0
fi
echo "$SCHEDULE, a = $A, global batch $GLOBAL_BATCH (micro $MICRO_BATCH x $A x DP $DP), LR $LR" >&2
exec "${COMMAND[@]}"
