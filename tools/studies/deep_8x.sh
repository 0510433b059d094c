#!/usr/bin/env bash
# The deep model of docs/convergence_deep.md (--model deep-8x: 16 layers of hidden
# 112, 8.0x the study model) on 4 and on 8 stages, seed 1, each schedule at its best
# configuration and LR of the 4x model; 16,000 iterations (the study model's tokens per
# parameter). One run is 80 to 120 CPU-minutes; niced, one core each.
#
#   tools/studies/deep_8x.sh                      # every configuration, one after the other
#   tools/studies/deep_8x.sh flush-adam-lr3e-3    # only the named ones (a lane per core)
#
#   EXIT_INTERVAL=4000 tools/studies/deep_8x.sh NAME   # a screen: stop at iteration 4,000
#
# Finished runs (a summary.json under --output) are reused; a stopped run goes on from its
# checkpoint.pt (a screened one too, when run again without EXIT_INTERVAL). Needs `make venv
# data-small` (and `make data-small-tests` for the *-onepass runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
M=--optimizer=muon D=--decoupled-lr=1e-2,--decoupled-min-lr=1e-3
LA=--async-nesterov-lookahead EF=--async-error-feedback
# a = 8 for the first 200 iterations doubles their batch: 15,800 iterations for the same tokens.
A8=--paci-accumulation-schedule=8:200,--train-iters=15800
P8=--pipeline-model-parallel-size=8
# The standard library with its tests (`make data-small-tests`): the 8.2M tokens in one pass
ONEPASS=--data-path=runs/data_v1k_tests/stdlib_text_document,--data-cache-path=runs/data_v1k_tests/cache
# a = 8 on 8 stages: micro batch 2 (global batch 16 as before), a = 16 for the first 200
A16MB2=--micro-batch-size=2,--paci-accumulation-schedule=16:200,--train-iters=15800
# a = 16 on 4 stages: micro batch 1, a = 32 for the first 200
A32MB1=--micro-batch-size=1,--paci-accumulation-schedule=32:200,--train-iters=15800
declare -A CONFIGS=(
  [flush-adam-lr3e-3]=1f1b:3e-3
  [flush-muon-lr1.5e-3]=1f1b:1.5e-3:$M
  [flush-adam-lr1.5e-3]=1f1b:1.5e-3
  [flush-adam-dec-lr3e-3]=1f1b:3e-3:$D
  [paci4-adam-ef-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$EF,$A8,$D
  [paci8-adam-ef-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$EF,$A8,$D,$P8
  [paci4-muon-la-ef-lr1.5e-3]=paci:1.5e-3:$M,$LA,$EF
  [paci8-muon-la-ef-lr1.5e-3]=paci:1.5e-3:$M,$LA,$EF,$P8
  [paci8-mb2-muon-la-ef-lr1.5e-3]=paci:1.5e-3:$M,$LA,$EF,$P8,--micro-batch-size=2
  # PACI on 8 stages behind flush: its LR bracketed above, and the stage LR scale, which lowers
  # stage s's LR by its mean gradient staleness (N - 1 - s) / a (7/4 steps on stage 0 of 8; it
  # takes one a, so without the accumulation schedule)
  [paci8-adam-ef-a8x200-dec-lr3e-3]=paci:3e-3:$EF,$A8,$D,$P8
  [paci8-adam-ef-dec-slr1-lr3e-3]=paci:3e-3:$EF,$D,$P8,--paci-stage-lr-scale=1
  [paci8-adam-ef-dec-slr1-lr1.5e-3]=paci:1.5e-3:$EF,$D,$P8,--paci-stage-lr-scale=1
  # ... its LR bracketed below, and without error feedback
  [paci8-adam-ef-a8x200-dec-lr7.5e-4]=paci:7.5e-4:$EF,$A8,$D,$P8
  [paci8-adam-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$A8,$D,$P8
  # a = 8 on 8 stages (micro batch 2, the same global batch 16 and tokens): drift bound 1 on
  # every stage, as a = 4 gives on 4; a = 16 for the first 200 iterations doubles their batch
  [paci8-mb2-adam-ef-a16x200-dec-lr1.5e-3]=paci:1.5e-3:$EF,$A16MB2,$D,$P8
  [paci8-mb2-adam-ef-a16x200-dec-lr3e-3]=paci:3e-3:$EF,$A16MB2,$D,$P8
  # PACI on 4 stages behind flush with drift bound 1 everywhere: without the decoupled embedding
  # LR (flush's best has none), and without error feedback
  [paci4-adam-ef-a8x200-lr1.5e-3]=paci:1.5e-3:$EF,$A8
  [paci4-adam-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$A8,$D
  # ... without the decoupled LR, its LR bracketed
  [paci4-adam-ef-a8x200-lr3e-3]=paci:3e-3:$EF,$A8
  [paci4-adam-ef-a8x200-lr7.5e-4]=paci:7.5e-4:$EF,$A8
  # PACI ahead for the first third, behind from the second pass over the data on: 8 stages at
  # flush's LR; PACI's LR bracketed above (the higher LR helps flush more in the second pass);
  # a synchronous last eighth (1F1B-flush for the last 2,000 iterations; it excludes the
  # accumulation schedule)
  [paci8-mb2-adam-ef-a16x200-lr3e-3]=paci:3e-3:$EF,$A16MB2,$P8
  [paci4-adam-ef-a8x200-lr6e-3]=paci:6e-3:$EF,$A8
  [paci4-adam-ef-cd2000-lr3e-3]=paci:3e-3:$EF,--async-sync-cooldown-iters=2000
  # ... is it the second pass over the data? Flush and PACI on a corpus the run reads once; and
  # is it error feedback late in the run (without it: behind early in the screens)? And flush's
  # LR bracketed above
  [flush-adam-lr3e-3-onepass]=1f1b:3e-3:$ONEPASS
  [paci4-adam-ef-a8x200-lr3e-3-onepass]=paci:3e-3:$EF,$A8,$ONEPASS
  # ... and at 1.5e-3, where both schedules' training loss is lower than at 3e-3 on the first
  # pass of the repeated corpus (3e-3 wins the second)
  [flush-adam-lr1.5e-3-onepass]=1f1b:1.5e-3:$ONEPASS
  [paci4-adam-ef-a8x200-lr1.5e-3-onepass]=paci:1.5e-3:$EF,$A8,$ONEPASS
  [paci4-adam-a8x200-lr3e-3]=paci:3e-3:$A8
  [flush-adam-lr6e-3]=1f1b:6e-3
  # ... a stale stage's stable step: with error feedback, a first moment of 0.95 on the stale
  # stages (0.9 on the last) raises it (the linear model in docs/convergence_deep.md)
  [paci4-adam-ef-a8x200-dm95-lr3e-3]=paci:3e-3:$EF,$A8,--async-delay-momentum=0.95
  # ... is it the first moment of 0.95 itself? flush with it on every stage
  [flush-adam-b95-lr3e-3]=1f1b:3e-3:--adam-beta1=0.95
  # ... a larger a lowers each stage's mean staleness (N - 1 - s) / a: a = 8 on 4 stages (micro
  # batch 2, the same global batch and tokens) raises stage 0's stable step from 4.3 to 11.1
  [paci4-mb2-adam-ef-a16x200-lr3e-3]=paci:3e-3:$EF,$A16MB2
  # ... and both: a = 8 with the first moment of 0.95 on the stale stages
  [paci4-mb2-adam-ef-a16x200-dm95-lr3e-3]=paci:3e-3:$EF,$A16MB2,--async-delay-momentum=0.95
  # ... and a = 16 on 4 stages (micro batch 1): a = 8 halved the second pass's gap
  [paci4-mb1-adam-ef-a32x200-lr3e-3]=paci:3e-3:$EF,$A32MB1
  # ... and error feedback on the stale stages only: the last stage's gradients are fresh, and
  # extrapolating them lowers its stable step from 38 to 12.7 (measured: it hurts)
  [paci4-adam-efd-a8x200-lr3e-3]=paci:3e-3:$EF,--async-error-feedback-delayed-stages,$A8
  # ... and with weight stashing (each backward on its forward's weights): is it the forward
  # and backward weights differing inside a stage of 4 layers? (no checkpoint: runs through)
  [paci4-adam-ef-a8x200-dec-stash-lr1.5e-3]=paci:1.5e-3:$EF,$A8,$D,--paci-weight-stashing
  # ... and on 8 stages at a = 8 without the decoupled LR
  [paci8-mb2-adam-ef-a16x200-lr1.5e-3]=paci:1.5e-3:$EF,$A16MB2,$P8
  # error feedback stretched over each stage's delay bound (2 on stages 0 to 2 of 8 at a = 4)
  [paci8-adam-efs-a8x200-dec-lr1.5e-3]=paci:1.5e-3:$EF,--async-error-feedback-stretch,$A8,$D,$P8
)
# the trend's points: each schedule at its best; PACI on 8 stages at a = 8 (a >= N - 1)
ORDER=(flush-adam-lr3e-3 paci4-adam-ef-a8x200-lr3e-3 paci8-mb2-adam-ef-a16x200-lr3e-3
       flush-muon-lr1.5e-3 paci4-muon-la-ef-lr1.5e-3 paci8-mb2-muon-la-ef-lr1.5e-3)
for name in "${@:-${ORDER[@]}}"; do
  [[ -v CONFIGS[$name] ]] || { echo "error: unknown configuration $name" >&2; exit 2; }
  OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python tools/time_to_accuracy.py --engine single-process \
    --model deep-8x --output runs/tta_best/deep-8x --iterations 16000 --eval-interval 200 \
    --eval-iters 8 --warmup-iters 800 --targets 4.2,4.0,3.8,3.7,3.5 --seeds 1 \
    ${EXIT_INTERVAL:+--exit-interval "$EXIT_INTERVAL"} --config "$name=${CONFIGS[$name]}"
done
