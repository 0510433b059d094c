"""Two study runs' training losses compared on the same batches at the same tokens, window by
window, and their validation losses by groups of evaluations (the single-process engine's
summary.json files, `tools/time_to_accuracy.py --engine single-process`; a run not finished
yet is read from its checkpoint.pt: a screen against a finished run).

    .venv/bin/python tools/loss_windows.py runs/tta_best/deep-8x/flush-adam-lr3e-3-seed1 \
        runs/tta_best/deep-8x/paci4-adam-ef-a8x200-lr3e-3-seed1 --windows 1000,2000,4000,16000

Why tokens: a run with `--paci-accumulation-schedule 8:200` reads two batches in each of its
first 200 iterations, so its iteration i reads the batch the reference's iteration i + 200
reads, and its k-th evaluation comes after 200 iterations' batches more than the reference's.
The training windows are the reference's iterations; the other run's iterations that end in
the same range of tokens are averaged against them. The validation gaps pair the k-th
evaluations (the same validation batches, not the same tokens).
"""

import argparse
import json
import os
import sys

from megatron.common.errors import UserError, run_tool


def read_run(directory: str) -> dict:
    """A run's losses, tokens and evaluations: its summary.json, or for a run still going or
    stopped (a screen) what its checkpoint.pt holds so far."""
    path = os.path.join(directory, "summary.json")
    checkpoint = os.path.join(directory, "checkpoint.pt")
    if not os.path.exists(path) and os.path.exists(checkpoint):
        import torch

        result = torch.load(checkpoint, map_location="cpu", weights_only=False)["result"]
        summary = {"loss": result["losses"], "tokens": result["tokens"],
                   "validation": result["validation"],
                   "final_validation": result["final_validation"]}  # fmt: skip
    else:
        try:
            with open(path) as file:
                summary = json.load(file)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read the run's summary {path}: {error}") from None
    if "tokens" not in summary or len(summary["tokens"]) != len(summary["loss"]):
        raise UserError(f"{path} has no tokens per iteration: not a single-process study run")
    return summary


def window_means(summary: dict, token_ranges: list[tuple[int, int]]) -> list[float | None]:
    """The mean training loss of the iterations whose tokens read so far end in each
    (first, last] range; None where the run has not read to its end."""
    means = []
    for first, last in token_ranges:
        if not summary["tokens"] or summary["tokens"][-1] < last:
            means.append(None)
            continue
        losses = [loss for loss, tokens in zip(summary["loss"], summary["tokens"])
                  if first < tokens <= last and loss is not None]  # fmt: skip
        means.append(sum(losses) / len(losses) if losses else None)
    return means


def training_gaps(reference: dict, other: dict, bounds: list[int]) -> list[tuple]:
    """(first iteration, last iteration, gap in %) for each window of the reference's
    iterations between consecutive `bounds`; the gap is None where a run has no iteration."""
    tokens = reference["tokens"]
    if bounds[0] < 0 or bounds[-1] > len(tokens) or bounds != sorted(set(bounds)):
        raise UserError(f"--windows must rise within the reference's {len(tokens)} iterations")
    ranges = [(tokens[lo - 1] if lo else 0, tokens[hi - 1]) for lo, hi in zip(bounds, bounds[1:])]
    gaps = []
    for (lo, hi), ref, oth in zip(zip(bounds, bounds[1:]), window_means(reference, ranges),
                                  window_means(other, ranges)):  # fmt: skip
        gaps.append((lo, hi, None if ref is None or oth is None else 100 * (oth / ref - 1)))
    return gaps


def validation_gaps(reference: dict, other: dict, group: int) -> list[tuple]:
    """(first evaluation, last evaluation, mean gap in %) over each `group` of evaluations
    both runs made, paired by their index."""
    pairs = list(zip(reference["validation"], other["validation"]))
    gaps = [100 * (b["lm loss"] / a["lm loss"] - 1) for a, b in pairs]
    return [(k + 1, min(k + group, len(gaps)), sum(gaps[k : k + group]) / len(gaps[k : k + group]))
            for k in range(0, len(gaps), group)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="the run directory gaps are measured against")
    parser.add_argument("other", help="the run directory compared with it")
    parser.add_argument("--windows", default="1000,2000,4000,6000,8000,12000,16000",
                        help="the reference's iterations bounding the training windows")  # fmt: skip
    parser.add_argument("--group", type=int, default=10, help="evaluations per validation gap")
    options = parser.parse_args(argv)
    try:
        bounds = [int(text) for text in options.windows.split(",")]
    except ValueError:
        raise UserError(f"--windows takes iterations separated by commas, not {options.windows!r}")
    reference, other = read_run(options.reference), read_run(options.other)
    names = f"{os.path.basename(options.other.rstrip('/'))} against " \
            f"{os.path.basename(options.reference.rstrip('/'))}"  # fmt: skip
    print(f"training loss, the same batches at the same tokens ({names}), gap in %:")
    for lo, hi, gap in training_gaps(reference, other, bounds):
        print(f"  iterations {lo}-{hi}: " + ("-" if gap is None else f"{gap:+.2f}"))
    print(f"validation loss, the same batches by evaluation ({names}), gap in %:")
    for first, last, gap in validation_gaps(reference, other, options.group):
        print(f"  evaluations {first}-{last}: {gap:+.2f}")
    final_a, final_b = reference.get("final_validation"), other.get("final_validation")
    if final_a and final_b:
        print(f"final evaluation: {final_b:.4f} against {final_a:.4f}, "
              f"{100 * (final_b / final_a - 1):+.2f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
