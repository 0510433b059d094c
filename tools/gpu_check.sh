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
# Usage: tools/gpu_check.sh [--output FILE.json] [--micro-batch-sizes 1,2,4,8,16]
#                           [--warmup N] [--repeats N] [--stages N] [--python PY]
#                           [--no-projection] [--dry-run] [-- extra calibrate_stage.py flags]
#   --output    calibration JSON (default docs/calibration/gpu_gpt2_medium.json in the
#               repository); the projection goes beside it as <name>_projection.md
#   --dry-run   print the commands and exit (works without a GPU)
#   after --     flags passed to calibrate_stage.py, e.g. -- --p2p-s 0.0004 --no-validate
# Exit status: 0 done, 2 bad arguments, 3 no CUDA device (nothing was run), else the failing
# step's status. Takes a few minutes on one GPU.
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
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --output|--micro-batch-sizes|--warmup|--repeats|--stages|--python)
      [[ $# -ge 2 ]] || die "$1 needs a value"
      case "$1" in
        --output) OUTPUT=$2; [[ $OUTPUT == /* ]] || OUTPUT="$CALLER/$OUTPUT" ;;
        --micro-batch-sizes) MBS=$2 ;;
        --warmup) WARMUP=$2 ;;
        --repeats) REPEATS=$2 ;;
        --stages) STAGES=$2 ;;
        --python) PYTHON=$2 ;;
      esac
      shift 2 ;;
    --no-projection) PROJECTION=0; shift ;;
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

if (( DRY_RUN )); then
  echo "gpu_check: dry run, would run:"
  printf '  %q' "${CALIBRATE[@]}"; echo
  echo "  (per-stage table of $OUTPUT for $STAGES stages)"
  if (( PROJECTION )); then printf '  %q' "${PROJECT[@]}"; echo; fi
  exit 0
fi

command -v "$PYTHON" >/dev/null 2>&1 || [[ -x $PYTHON ]] || die "no python at '$PYTHON' (make venv, or --python PY)"

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
EOF
status=$?
set -e
if (( status != 0 )); then exit "$status"; fi

echo "gpu_check: forward/backward in bf16, GPT-2 Medium shape, micro-batch sizes $MBS"
"${CALIBRATE[@]}"

echo "gpu_check: per-microbatch times of each of $STAGES pipeline stages (from $OUTPUT)"
"${STAGE_TABLE[@]}" <<'EOF'
import json
import sys

from megatron.pipeline.simulation.calibration import stage_costs_from_calibration

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
echo "gpu_check: done; calibration in $OUTPUT"
