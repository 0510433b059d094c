"""Project pipeline throughput at the paper's scale: 1F1B-flush vs PACI (and the references).

The cost model, the simulation and the report are `megatron.benchmarks.projection`
(its docstring says where the costs come from and how steady state is measured); this script
parses the flags, prints the Markdown report and writes ``--json`` / ``--markdown``.
`docs/projection.md` is the report these outputs make.

Examples::

    python tools/project_paper_scale.py                                  # GPT-2 Medium, 8 stages
    python tools/project_paper_scale.py --preset zb-28b                  # 28.3B, 32 stages
    python tools/project_paper_scale.py --calibration docs/calibration/gpu_gpt2_medium.json
"""

import json
import os
import sys

from megatron.benchmarks import projection
from megatron.benchmarks.projection_report import markdown
from megatron.common.errors import run_tool


def _write(path: str, content: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(content + ("\n" if not content.endswith("\n") else ""))


def main(argv=None) -> int:
    try:
        options = projection.parse_args(argv)
        report = projection.run(options)
        text = markdown(report)
        print(text)
        outputs = ((options.json_path, json.dumps(report, indent=2)), (options.markdown_path, text))
        for path, content in outputs:
            if path:
                _write(path, content)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
