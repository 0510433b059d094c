#!/usr/bin/env bash
# The MoE study model (--model small-moe) best against best (docs/moe_study.md): each
# schedule's options that are not delay corrections tried both ways (the decoupled embedding
# LR; with Muon, flush also with Nesterov momentum), PACI with its delay corrections; seed 1 by
# default (SEEDS=1,2,3 for the rows the seed-1 brackets pick). 2,000 iterations, 5 to 16
# CPU-minutes a run; niced, one core each.
#
#   tools/studies/moe_best.sh                          # every configuration, one after the other
#   SEEDS=2,3 tools/studies/moe_best.sh flush-adam-lr3e-3   # only the named ones
#
# Finished runs (a summary.json under --output) are reused; a stopped run goes on from its
# checkpoint.pt. Needs `make venv data-small`.
set -euo pipefail
cd "$(dirname "$0")/../.."
M=--optimizer=muon N=--muon-nesterov D=--decoupled-lr=1e-2,--decoupled-min-lr=1e-3
LA=--async-nesterov-lookahead EF=--async-error-feedback
# a = 8 for the first 200 iterations doubles their batch: 1,800 iterations for the same tokens.
A8=--paci-accumulation-schedule=8:200,--train-iters=1800
declare -A CONFIGS=(
  [flush-adam-lr3e-3]=1f1b:3e-3
  [flush-adam-dec-lr3e-3]=1f1b:3e-3:$D
  [flush-adam-dec-lr1.5e-3]=1f1b:1.5e-3:$D
  [paci-adam-ef-a8x200-lr3e-3]=paci:3e-3:$EF,$A8
  [paci-adam-ef-a8x200-dec-lr3e-3]=paci:3e-3:$EF,$A8,$D
  [paci-adam-ef-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$EF,$A8,$D
  [flush-muon-lr3e-3]=1f1b:3e-3:$M
  [flush-muon-nest-dec-lr3e-3]=1f1b:3e-3:$M,$N,$D
  [flush-muon-nest-dec-lr1.5e-3]=1f1b:1.5e-3:$M,$N,$D
  [paci-muon-la-ef-lr1.5e-3]=paci:1.5e-3:$M,$LA,$EF
  [paci-muon-la-ef-dec-lr1.5e-3]=paci:1.5e-3:$M,$LA,$EF,$D
  [paci-muon-la-ef-dec-lr3e-3]=paci:3e-3:$M,$LA,$EF,$D
)
ORDER=(flush-adam-dec-lr3e-3 paci-adam-ef-a8x200-dec-lr3e-3 flush-muon-nest-dec-lr3e-3
       paci-muon-la-ef-lr1.5e-3 paci-adam-ef-a8x200-lr3e-3 paci-muon-la-ef-dec-lr3e-3
       flush-adam-dec-lr1.5e-3 paci-adam-ef-a8x200-dec-lr1.5e-3 flush-muon-nest-dec-lr1.5e-3
       flush-adam-lr3e-3 flush-muon-lr3e-3 paci-muon-la-ef-dec-lr1.5e-3)
for name in "${@:-${ORDER[@]}}"; do
  [[ -v CONFIGS[$name] ]] || { echo "error: unknown configuration $name" >&2; exit 2; }
  OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python tools/time_to_accuracy.py --engine single-process \
    --model small-moe --output runs/tta_best/small-moe --iterations 2000 --eval-interval 50 \
    --eval-iters 8 --warmup-iters 100 --targets 4.2,4.0,3.8,3.7 --seeds "${SEEDS:-1}" \
    --config "$name=${CONFIGS[$name]}"
done
