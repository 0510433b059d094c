"""Peak resident set per runtime action (investigation; logic in megatron/studies/memory_probe.py).

torchrun --nproc-per-node 4 tools/memory_probe.py --probe-dir DIR [--default-malloc] -- FLAGS
python tools/memory_probe.py --analyze DIR [DIR ...]
"""

import sys

from megatron.common.errors import run_tool
from megatron.studies.memory_probe import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
