#!/bin/bash
# A DeepSeek-V3-style proxy scaled to CPU, after Megatron-LM's deepseekv3_proxy configs: MLA with
# YaRN (compressed queries, latent norms), a dense first layer, 8 routed experts (top-2, sigmoid
# scores, the aux-loss-free expert bias, a sequence aux loss), a shared expert, one MTP layer;
# RMSNorm, SwiGLU, untied embeddings. 4 processes: EP 2 x PP 2 (gloo), on the default corpus
# tokenized with a 1,024-token SentencePiece model (`make data-small` builds runs/data_v1k).
#
#   examples/deepseek_proxy/train_cpu.sh SCHEDULE OUTPUT [more flags]   # SCHEDULE: 1f1b, paci, 2bw
set -euo pipefail
SCHEDULE=${1:?schedule: 1f1b, paci or 2bw}
OUTPUT=${2:?output directory}
shift 2
DATA=runs/data_v1k
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 pretrain_gpt.py \
  --pipeline-schedule "$SCHEDULE" --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
  --max-position-embeddings 32 --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights --position-embedding-type rope \
  --multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 16 \
  --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm --rotary-scaling-factor 4 \
  --mscale-all-dim 1 \
  --num-experts 8 --moe-layer-freq "[0]+[1]*3" --moe-router-topk 2 --moe-ffn-hidden-size 64 \
  --moe-shared-expert-intermediate-size 64 --moe-router-score-function sigmoid \
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2 \
  --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall \
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
  --micro-batch-size 4 --global-batch-size 32 --train-iters 300 --lr 3e-3 --min-lr 3e-4 \
  --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 --adam-beta2 0.95 \
  --clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0 --seed 1234 \
  --data-path $DATA/stdlib_text_document --data-cache-path $DATA/cache --split 969,30,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model $DATA/tokenizer/stdlib1k.model \
  --log-interval 50 --eval-interval 100 --eval-iters 8 --distributed-backend gloo \
  --metrics-dir "$OUTPUT" --tensorboard-dir "$OUTPUT/tensorboard" "$@"
