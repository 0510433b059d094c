#!/usr/bin/env bash
# One-GPU check of the model code and calibration of the paper-scale projection.
#
# On one CUDA device, builds megatron-core GPT stages of GPT-2 Medium shape (24 layers, hidden
# 1024, 16 heads, seq 1024, vocab 50304) with the layer spec a run uses -- Transformer Engine's
# when transformer_engine is installed, else the portable SDPA spec (said so below) -- and runs
# forward and backward in bf16 at micro-batch sizes 1,2,4,8,16 (tools/calibrate_stage.py
# --device cuda --bf16). It prints per-microbatch forward and backward times (per layer,
# embedding, output layer + loss, the whole 24-layer model, and each of 8 pipeline stages),
# writes the calibration JSON the simulator reads, and runs tools/project_paper_scale.py on it:
# the measured efficiency curve then replaces the assumed one of docs/projection.md.
#
# Then a training pass (megatron/studies/gpu_training_check.py): short pretrain_gpt.py runs
# of a small GPT under --pipeline-schedule 1f1b and paci with --bf16, --fp16,
# --use-distributed-optimizer, --recompute-activations and --recompute-granularity full
# --recompute-method uniform --recompute-num-layers 1, --cross-entropy-loss-fusion, each
# reported PASS, FAIL or SKIPPED (not supported yet), with its final loss, time per iteration
# and peak memory per stage.
# With one GPU every run is one process (NCCL refuses two ranks on one GPU); with more, two
# pipeline stages (and two data-parallel ranks for the distributed optimizer with 4).
#
# Usage: tools/gpu_check.sh [--output FILE.json] [--micro-batch-sizes 1,2,4,8,16]
#                           [--warmup N] [--repeats N] [--stages N] [--python PY]
#                           [--no-projection] [--skip-calibration] [--skip-training]
#                           [--train-iters N] [--training-output DIR] [--wheels DIR]
#                           [--gpus N] [--dry-run] [-- extra calibrate_stage.py flags]
#   --output    calibration JSON (default docs/calibration/gpu_gpt2_medium.json in the
#               repository); the projection goes beside it as <name>_projection.md
#   --training-output  logs and summary.json of the training pass (default runs/gpu_check)
#   --train-iters      iterations per training run (default 20)
#   --wheels DIR       install the wheels in DIR (e.g. a megatron-core wheel for the machine's
#                      Python) into a temporary directory first, without an index or their
#                      dependencies; the repository itself runs from its checkout
#   --gpus N    the GPU count the dry run plans for (default: the machine's, else 1)
#   --dry-run   print the commands and exit (works without a GPU)
#   after --     flags passed to calibrate_stage.py, e.g. -- --p2p-s 0.0004 --no-validate
# Exit status: 0 done (SKIPPED runs included), 1 a training run failed, 2 bad arguments, 3 no
# CUDA device (nothing was run), 4 megatron-core missing, else the failing step's status.
# Takes a few minutes on one GPU.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CALLER=$PWD
OUTPUT=docs/calibration/gpu_gpt2_medium.json
MBS=1,2,4,8,16
WARMUP=5
REPEATS=20
STAGES=8
PYTHON=${PYTHON:-}
PROJECTION=1
DRY_RUN=0
CALIBRATION=1
TRAINING=1
TRAIN_ITERS=20
TRAINING_OUTPUT=$ROOT/runs/gpu_check
WHEELS=
GPUS=
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --output|--micro-batch-sizes|--warmup|--repeats|--stages|--python|--train-iters|\
    --training-output|--wheels|--gpus)
      [[ $# -ge 2 ]] || die "$1 needs a value"
      case "$1" in
        --output) OUTPUT=$2; [[ $OUTPUT == /* ]] || OUTPUT="$CALLER/$OUTPUT" ;;
        --training-output) TRAINING_OUTPUT=$2
          [[ $TRAINING_OUTPUT == /* ]] || TRAINING_OUTPUT="$CALLER/$TRAINING_OUTPUT" ;;
        --wheels) WHEELS=$2; [[ $WHEELS == /* ]] || WHEELS="$CALLER/$WHEELS" ;;
        --train-iters) TRAIN_ITERS=$2 ;;
        --gpus) GPUS=$2 ;;
        --micro-batch-sizes) MBS=$2 ;;
        --warmup) WARMUP=$2 ;;
        --repeats) REPEATS=$2 ;;
        --stages) STAGES=$2 ;;
        --python) PYTHON=$2 ;;
      esac
      shift 2 ;;
    --no-projection) PROJECTION=0; shift ;;
    --skip-calibration) CALIBRATION=0; shift ;;
    --skip-training) TRAINING=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

cd "$ROOT"  # the default --output and the tools are relative to the repository root
[[ $MBS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--micro-batch-sizes: expected e.g. 1,2,4,8,16, got '$MBS'"
[[ $WARMUP =~ ^[0-9]+$ ]] || die "--warmup: expected a non-negative integer, got '$WARMUP'"
[[ $REPEATS =~ ^[1-9][0-9]*$ ]] || die "--repeats: expected a positive integer, got '$REPEATS'"
[[ $STAGES =~ ^[1-9][0-9]*$ ]] && (( 24 % STAGES == 0 )) \
  || die "--stages: expected a divisor of the 24 layers, got '$STAGES'"
[[ $OUTPUT == *.json ]] || die "--output: expected a .json path, got '$OUTPUT'"
[[ $TRAIN_ITERS =~ ^[1-9][0-9]*$ ]] || die "--train-iters: expected a positive integer, got '$TRAIN_ITERS'"
[[ -z $GPUS || $GPUS =~ ^[1-9][0-9]*$ ]] || die "--gpus: expected a positive integer, got '$GPUS'"
[[ -z $WHEELS || -d $WHEELS ]] || die "--wheels: no directory '$WHEELS'"
(( CALIBRATION || TRAINING )) || die "--skip-calibration and --skip-training leave nothing to do"
if [[ -z $PYTHON ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PROJECTION_MD="${OUTPUT%.json}_projection.md"

CALIBRATE=("$PYTHON" tools/calibrate_stage.py --device cuda --bf16
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
  --vocab-size 50304 --micro-batch-sizes "$MBS" --warmup "$WARMUP" --repeats "$REPEATS"
  --output "$OUTPUT" ${EXTRA[@]+"${EXTRA[@]}"})
STAGE_TABLE=("$PYTHON" - "$OUTPUT" "$STAGES")
PROJECT=("$PYTHON" tools/project_paper_scale.py --calibration "$OUTPUT" --stages "$STAGES"
  --micro-batch-sizes "$MBS" --markdown "$PROJECTION_MD")
# The repository runs from its checkout (no install needed); --wheels adds, e.g., megatron-core.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SITE="${TMPDIR:-/tmp}/gpu_check_site"
INSTALL=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE")
training_pass() {  # the training runs; extra arguments go to gpu_training_check.py
  "$PYTHON" -m megatron.studies.gpu_training_check --python "$PYTHON" --repo "$ROOT" \
    --output-dir "$TRAINING_OUTPUT" --train-iters "$TRAIN_ITERS" --gpus "${GPUS:-1}" "$@"
}

if (( DRY_RUN )); then
  echo "gpu_check: dry run, would run (PYTHONPATH=$PYTHONPATH):"
  if [[ -n $WHEELS ]]; then printf '  %q' "${INSTALL[@]}" "$WHEELS"/*.whl; echo; fi
  if (( CALIBRATION )); then
    printf '  %q' "${CALIBRATE[@]}"; echo
    echo "  (per-stage table of $OUTPUT for $STAGES stages)"
    if (( PROJECTION )); then printf '  %q' "${PROJECT[@]}"; echo; fi
  fi
  if (( TRAINING )); then
    echo "  training pass for ${GPUS:-1} GPU(s), logs in $TRAINING_OUTPUT:"
    training_pass --dry-run
  fi
  exit 0
fi

command -v "$PYTHON" >/dev/null 2>&1 || [[ -x $PYTHON ]] || die "no python at '$PYTHON' (make venv, or --python PY)"
if [[ -n $WHEELS ]]; then
  echo "gpu_check: installing the wheels of $WHEELS into $SITE"
  "${INSTALL[@]}" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi

set +e
"$PYTHON" - <<'EOF'
import importlib.util
import sys

import torch

if not torch.cuda.is_available():
    print(
        "gpu_check: no CUDA device: torch.cuda.is_available() is False (torch "
        f"{torch.__version__}, CUDA build {torch.version.cuda}). This check needs one NVIDIA "
        "GPU; nothing was run. Use --dry-run to see the commands.",
        file=sys.stderr,
    )
    sys.exit(3)
print(f"gpu_check: {torch.cuda.device_count()} CUDA device(s); using "
      f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if importlib.util.find_spec("transformer_engine") is not None:
    from importlib import metadata

    try:
        version = metadata.version("transformer-engine")
    except metadata.PackageNotFoundError:
        version = "unknown version"
    print(f"gpu_check: layer spec: Transformer Engine ({version})")
else:
    print("gpu_check: transformer_engine is not installed: measuring the portable SDPA layer "
          "spec instead (pip install -e '.[gpu]' for Transformer Engine)")
if importlib.util.find_spec("megatron.core") is None:
    print("gpu_check: megatron-core is not installed for this Python: install it, or pass "
          "--wheels DIR with its wheel (pip download --no-deps megatron-core==0.16.1)",
          file=sys.stderr)
    sys.exit(4)
EOF
status=$?
set -e
if (( status != 0 )); then exit "$status"; fi
[[ -n $GPUS ]] || GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')

if (( CALIBRATION )); then
echo "gpu_check: forward/backward in bf16, GPT-2 Medium shape, micro-batch sizes $MBS"
"${CALIBRATE[@]}"

echo "gpu_check: per-microbatch times of each of $STAGES pipeline stages (from $OUTPUT)"
"${STAGE_TABLE[@]}" <<'EOF'
import json
import sys

from megatron.benchmarks.calibration_file import stage_costs_from_calibration

path, stages = sys.argv[1], int(sys.argv[2])
with open(path, encoding="utf-8") as f:
    data = json.load(f)
for profile in data["profiles"]:
    mbs = profile["micro_batch_size"]
    costs = stage_costs_from_calibration(data, stages, mbs)
    cells = " ".join(
        f"s{s}: F {f * 1e3:7.2f} B {b * 1e3:7.2f}"
        for s, (f, b) in enumerate(zip(costs.forward, costs.backward))
    )
    print(f"  micro-batch {mbs:>2} (ms) {cells}")
EOF

if (( PROJECTION )); then
  echo "gpu_check: paper-scale projection from these measurements ($PROJECTION_MD)"
  "${PROJECT[@]}"
fi
echo "gpu_check: calibration in $OUTPUT"
fi

if (( TRAINING )); then
  set +e
  training_pass
  status=$?
  set -e
  if (( status != 0 )); then echo "gpu_check: a training run failed (see above)"; exit 1; fi
fi
echo "gpu_check: done"
