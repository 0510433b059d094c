"""Measure per-microbatch forward/backward times of a real megatron-core GPT stage and write the
calibration JSON that the pipeline simulator and the projection read.

What is measured and how the costs are separated: `megatron.studies.calibration`; the file
format: `megatron.benchmarks.calibration_file`. ``--help`` lists every flag.

Examples::

    python tools/calibrate_stage.py --num-layers 8 --hidden-size 256 --num-attention-heads 4 \\
        --seq-length 256 --vocab-size 8192 --micro-batch-sizes 1,2,4,8 --device cpu \\
        --threads 1 --output calib_cpu.json
    python tools/calibrate_stage.py --num-layers 24 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 1024 --vocab-size 50304 \\
        --micro-batch-sizes 1,2,4,8,16 --device cuda --bf16 --output calib_gpu.json
    python tools/simulate_pipeline.py --schedule paci --stages 8 --microbatches 8 \\
        --calibration calib_gpu.json --micro-batch-size 16
"""

import json
import os
import sys

from megatron.common.errors import UserError, run_tool
from megatron.studies import calibration


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"> wrote {path}", flush=True)


def main(argv=None) -> int:
    try:
        options = calibration.parse_args(argv)
        text = json.dumps(calibration.measure(options), indent=2)
        if options.output:
            write(options.output, text)
        else:
            print(text)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        calibration.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
