#!/usr/bin/env bash
# The CPU demo: the same 4-stage GPT pretraining with 1F1B-flush and with PACI (a = 4), on the
# Python standard library corpus, 4 processes over gloo; then the two runs side by side.
# Run from the repository root after `make data` (or just `make demo`).
#   bash examples/paci/demo_cpu.sh [--only SCHEDULE] [more pretrain_gpt.py flags]
set -euo pipefail
SCHEDULES=(1f1b paci)
if [ "${1:-}" = "--only" ]; then
  SCHEDULES=("$2")
  shift 2
fi
ITERS=${ITERS:-150}
OUT=${OUT:-runs/demo}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
PYTHON=${PYTHON:-.venv/bin/python}

ARGS=(
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --attention-dropout 0.0 --hidden-dropout 0.0
  --data-path data/stdlib_text_document --split 969,30,1 --data-cache-path data/cache
  --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer/stdlib.model
  --pipeline-model-parallel-size 4 --distributed-backend gloo
  --log-interval 10 --eval-interval "$ITERS" --eval-iters 5 --seed 1234
)

for schedule in "${SCHEDULES[@]}"; do
  echo "=== 4-stage pretraining, --pipeline-schedule $schedule, $ITERS iterations"
  OMP_NUM_THREADS=1 "$TORCHRUN" --standalone --nproc-per-node 4 pretrain_gpt.py "${ARGS[@]}" \
    --pipeline-schedule "$schedule" --metrics-dir "$OUT/$schedule" \
    --tensorboard-dir "$OUT/$schedule/tensorboard" --timeline-file "$OUT/$schedule/timeline.json" "$@" \
    2>&1 | grep --line-buffered -v -E "Warning|warnings.warn|Unable to save|^\s*$"
done

if [ ${#SCHEDULES[@]} -gt 1 ]; then
  "$PYTHON" tools/compare_runs.py "$OUT/1f1b/summary.json" "$OUT/paci/summary.json"
fi
echo "TensorBoard: .venv/bin/tensorboard --logdir $OUT   Timelines (Perfetto): $OUT/*/timeline.json"
