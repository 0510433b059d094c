"""Print pretraining runs side by side from their summary.json files.

python tools/compare_runs.py runs/demo/1f1b/summary.json runs/demo/paci/summary.json
"""

import argparse
import json
import sys

from megatron.common.errors import run_tool


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def rows(summary: dict) -> dict[str, str]:
    losses = summary["loss"]
    stages = summary["stages"]
    state = max(s["param_bytes"] + s["grad_bytes"] + s["optimizer_state_bytes"] for s in stages)
    result = {
        "schedule": summary["schedule"],
        "stages x tensor x data": (
            f"{summary['pipeline_stages']} x {summary['tensor_parallel']} x "
            f"{summary['data_parallel']}"
        ),
        "microbatches per step": str(summary["num_microbatches"]),
        "iterations": str(summary["iterations"]),
        "lm loss, first iteration": f"{losses[0]:.4f}",
        "lm loss, mean of last 10": f"{sum(losses[-10:]) / len(losses[-10:]):.4f}",
        "final lm loss": f"{summary['final_loss']:.4f}",
    }
    if summary.get("validation"):
        result["validation lm loss"] = f"{summary['validation'][-1]['lm loss']:.4f}"
    result.update(
        {
            "max drift by stage": " ".join(str(s["max_drift"]) for s in stages),
            "mean drift by stage": " ".join(f"{s['mean_drift']:.2f}" for s in stages),
            "peak in-flight by stage": " ".join(
                str(s["peak_inflight_microbatches"]) for s in stages
            ),
            "peak activations (max stage)": _mib(max(s["peak_activation_bytes"] for s in stages)),
            "params+grads+optimizer (max stage)": _mib(state),
            "real peak by stage (MiB)": " ".join(
                f"{s['real_peak_bytes'] / 2**20:.0f}" if s.get("real_peak_bytes") else "-"
                for s in stages
            ),
            "extra weight versions": str(max(s["extra_weight_versions"] for s in stages)),
            "training time": f"{summary['elapsed_s']:.1f} s",
            "tokens per second": f"{summary['tokens_per_second']:.0f}",
            "busy fraction by stage": " ".join(
                f"{s['busy_s'] / s['wall_s']:.2f}" if s["wall_s"] else "-" for s in stages
            ),
        }
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+")
    options = parser.parse_args(argv)
    try:
        tables = [rows(json.load(open(path))) for path in options.summaries]
    except (OSError, KeyError, ValueError) as error:
        print(f"error: cannot read summaries: {error}", file=sys.stderr)
        return 2
    width = max(len(key) for key in tables[0])
    columns = [max(len(t.get(key, "")) for key in tables[0]) for t in tables]
    for key in tables[0]:
        cells = [t.get(key, "").ljust(c) for t, c in zip(tables, columns)]
        print(f"{key.ljust(width)} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
