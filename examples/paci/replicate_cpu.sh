#!/usr/bin/env bash
# The schedule comparison in miniature on the default corpus: 1F1B-flush and PACI with
# a in {1, 2, 4, 8} at the same global batch, several seeds, 4 stages on 4 CPU processes; then
# figures and docs/results/README.md (tables, the exact commands). About 10-15 minutes on
# 2 cores with the defaults. Run from the repository root after `make data`.
#   [ITERS=100] [SEEDS="1 2 3"] [RUNS=runs/replicate] [RESULTS=docs/results] \
#     bash examples/paci/replicate_cpu.sh
# REPORT_ONLY=1 redraws the figures and the report from the runs already in RUNS (it measures
# the per-microbatch costs for the projected-time axis again).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ITERS=${ITERS:-100}
SEEDS=${SEEDS:-1 2 3}
RUNS=${RUNS:-runs/replicate}
RESULTS=${RESULTS:-docs/results}
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
if [ ! -f data/stdlib_text_document.idx ]; then
  echo "error: data/stdlib_text_document.idx is missing; run make data first" >&2
  exit 2
fi
mkdir -p "$RUNS" "$RESULTS"
read -ra SEED_LIST <<<"$SEEDS"
COMMANDS=("ITERS=$ITERS SEEDS=\"$SEEDS\" bash examples/paci/replicate_cpu.sh  # runs:")

if [ "${REPORT_ONLY:-0}" != 1 ]; then
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg) at start" \
    >"$RUNS/started.txt"
fi

for seed in "${SEED_LIST[@]}"; do
  CASES="$RUNS/cases_seed$seed.json"
  LAUNCH=("$TORCHRUN" --standalone --nproc-per-node 4 tests/functional_tests/multi_run.py "$CASES")
  COMMANDS+=("$PYTHON tools/replicate.py cases --seed $seed --iterations $ITERS --runs $RUNS > $CASES"
    "OMP_NUM_THREADS=1 ${LAUNCH[*]}")
  [ "${REPORT_ONLY:-0}" = 1 ] && continue
  echo "=== seed $seed: flush, paci a=1,2,4,8, $ITERS iterations each ($(date -u +%H:%M:%S))" >&2
  "$PYTHON" tools/replicate.py cases --seed "$seed" --iterations "$ITERS" --runs "$RUNS" >"$CASES"
  if ! OMP_NUM_THREADS=1 "${LAUNCH[@]}" >"$RUNS/seed$seed.log" 2>&1; then
    tail -n 40 "$RUNS/seed$seed.log" >&2
    echo "error: seed $seed failed; full log in $RUNS/seed$seed.log" >&2
    exit 1
  fi
done

# Per-microbatch costs of this model on one core, for the projected-time axis (the report scales
# the micro batch 16 costs to the smaller microbatches).
CALIBRATE=("$PYTHON" tools/calibrate_stage.py --num-layers 4 --hidden-size 64
  --num-attention-heads 4 --seq-length 64 --vocab-size 8192 --micro-batch-sizes 16
  --attention-dropout 0 --hidden-dropout 0 --device cpu --threads 1 --clock process
  --repeats 9 --no-validate --output "$RUNS/calibration.json")
COMMANDS+=("${CALIBRATE[*]}")
echo "=== measuring per-microbatch costs" >&2
"${CALIBRATE[@]}" >"$RUNS/calibration.log" 2>&1

REPORT=("$PYTHON" tools/replicate.py report --runs "$RUNS" --seeds "${SEED_LIST[@]}"
  --calibration "$RUNS/calibration.json" --output "$RESULTS")
COMMANDS+=("${REPORT[*]}")
for command in "${COMMANDS[@]}"; do REPORT+=(--command "$command"); done
"${REPORT[@]}" --date "$(cat "$RUNS/started.txt")" --machine "$(nproc) CPU cores"
echo "=== figures and README.md in $RESULTS" >&2
