"""Per-stage memory of pretraining runs (flush vs PACI, recomputation off/selective/full).

    python tools/memory_report.py --preset demo --iters 6 --output runs/memory

Logic in megatron/studies/memory_report.py.
"""

import sys

from megatron.common.errors import run_tool
from megatron.studies.memory_report import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
