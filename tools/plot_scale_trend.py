"""PACI's gap to flush as the model grows and as the pipeline deepens
(docs/convergence_scale.md): the final validation loss of a PACI run over flush's on the same seed, minus one,
median and range over the seeds both have; a markdown table and a PNG.

    .venv/bin/python tools/plot_scale_trend.py --png docs/convergence_scale.png \
        --point "AdamW|deep-8x|8|runs/tta_best/deep-8x|flush-adam-lr3e-3|paci8-adam-..."

The measured points live in a JSON file beside the figure (--data, docs/convergence_scale.json:
each point's two runs and their final validation loss by seed), so the figure is redrawn from
the repository alone. Each --point is OPTIMIZER|MODEL|STAGES|OUTPUT|FLUSH RUN|PACI RUN (run
names under OUTPUT, without -seedN; MODEL one of time_to_accuracy's study models, whose
parameters give the x axis): the finished runs it finds there are recorded in the file at the
point of that optimizer, model and stages (a run of the same name keeps the seeds recorded
before, so one schedule can be run in one study and the other later; another name replaces
it). Left: the gap against parameters on 4 stages; right: against stages. A point without a
seed both runs finished is left out and named.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from megatron.common.errors import UserError, run_tool  # noqa: E402
from megatron.studies import time_to_accuracy as tta  # noqa: E402


def parse_point(text: str) -> dict:
    parts = text.split("|")
    if len(parts) != 6 or parts[1] not in tta.MODELS or not parts[2].isdigit():
        raise UserError(f"--point {text!r}: expected OPTIMIZER|MODEL|STAGES|OUTPUT|FLUSH|PACI "
                        f"with MODEL one of {', '.join(sorted(tta.MODELS))}")  # fmt: skip
    optimizer, model, stages, output, flush, paci = parts
    return dict(optimizer=optimizer, model=model, stages=int(stages), output=output,
                flush=flush, paci=paci)  # fmt: skip


def measured_point(point: dict, seeds: list[int]) -> dict:
    """The point as the data file keeps it: each run's final validation loss by seed, for the
    seeds whose run finished (a summary.json under the point's output), and which evaluation
    gave it ("final": the final evaluation's batches, the same for every run of a seed; "last
    of N": the last of N periodic evaluations, the same batches only for a run of N too)."""
    runs = {}
    for schedule in ("flush", "paci"):
        finals, evaluations = {}, {}
        for seed in seeds:
            directory = tta.run_directory(point["output"], point[schedule], seed)
            if os.path.exists(os.path.join(directory, "summary.json")):
                run = tta._read_run(point["output"], point[schedule], seed)
                finals[str(seed)] = round(tta.final_losses([run])[0], 6)
                final = run.final_validation is not None
                evaluations[str(seed)] = "final" if final else f"last of {len(run.validation)}"
        runs[schedule] = {"run": point[schedule], "final": finals, "evaluation": evaluations}
    return {key: point[key] for key in ("optimizer", "model", "stages")} | runs


def gap(point: dict) -> dict | None:
    """The paired gap in percent over the seeds both runs finished on the same validation
    batches (the same evaluation; points recorded before the file named it pair as they are),
    with their count."""
    flush, paci = point["flush"]["final"], point["paci"]["final"]
    read = lambda side, seed: point[side].get("evaluation", {}).get(seed)  # noqa: E731
    seeds = sorted((s for s in set(flush) & set(paci) if read("flush", s) == read("paci", s)),
                   key=int)  # fmt: skip
    if not seeds:
        return None
    result = tta.spread([paci[s] / flush[s] - 1 for s in seeds])
    return {key: 100 * value for key, value in result.items()} | {"seeds": len(seeds)}


def read_points(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    try:
        with open(path) as file:
            return json.load(file)["points"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise UserError(f"--data {path}: not a scale-trend data file ({error})") from None


def record(points: list[dict], new: dict) -> list[dict]:
    """`points` with `new` recorded at its optimizer, model and stages: a schedule's run of the
    same name keeps its seeds that `new` lacks (one side can be measured in one study and the
    other later, after the first's run directories are gone); another run replaces it."""
    key = lambda p: (p["optimizer"], p["model"], p["stages"])  # noqa: E731
    old = next((p for p in points if key(p) == key(new)), None)
    merged = dict(new)
    for schedule in ("flush", "paci"):
        if old is not None and old[schedule]["run"] == new[schedule]["run"]:
            merged[schedule] = {"run": new[schedule]["run"]} | {
                key: old[schedule].get(key, {}) | new[schedule][key]
                for key in ("final", "evaluation")
            }
    return [p for p in points if key(p) != key(new)] + [merged]


def parameters(point: dict) -> int:
    return tta.parameter_count(tta.MODELS[point["model"]])


def in_order(points: list[dict]) -> list[dict]:
    """By optimizer, then stages, then size: the table's and the file's order."""
    return sorted(points, key=lambda p: (p["optimizer"], p["stages"], parameters(p)))


def write_points(path: str, points: list[dict]) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        json.dump({"points": in_order(points)}, file, indent=1)
        file.write("\n")
    os.replace(temporary, path)


def plot(rows: list[tuple[dict, int, dict]], png: str) -> None:
    figure, (by_size, by_stages) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for optimizer, marker in zip(dict.fromkeys(p["optimizer"] for p, _, _ in rows), "os^v"):
        for axis, key in ((by_size, "params"), (by_stages, "stages")):
            chosen = sorted(
                (params if key == "params" else point["stages"], measured)
                for point, params, measured in rows
                if point["optimizer"] == optimizer
                and (point["stages"] == 4 if key == "params" else point["model"] == "deep-8x")
            )  # fmt: skip
            if not chosen:
                continue
            xs = [x for x, _ in chosen]
            medians = [m["median"] for _, m in chosen]
            below = [m["median"] - m["min"] for _, m in chosen]
            above = [m["max"] - m["median"] for _, m in chosen]
            axis.errorbar(xs, medians, yerr=[below, above], marker=marker, capsize=4,
                          label=optimizer)  # fmt: skip
    for axis in (by_size, by_stages):
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.grid(alpha=0.3)
        if not axis.lines[1:]:  # the zero line only
            axis.text(0.5, 0.5, "not measured yet", transform=axis.transAxes, ha="center")
    by_size.set_xscale("log")
    by_size.set_xlabel("parameters (4 stages)")
    by_size.set_ylabel("PACI's final validation loss vs flush's (%)")
    by_size.set_title("against size (below 0: PACI ahead)")
    by_stages.set_xlabel("pipeline stages (deep-8x model)")
    by_stages.set_xticks([4, 8])
    by_stages.set_title("against stages")
    by_size.legend()
    figure.suptitle("PACI against flush, each at its best configuration (median, range: seeds)")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", action="append", default=[], type=parse_point,
                        help="OPTIMIZER|MODEL|STAGES|OUTPUT|FLUSH RUN|PACI RUN")  # fmt: skip
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--data", default="docs/convergence_scale.json")
    parser.add_argument("--png", default="docs/convergence_scale.png")
    options = parser.parse_args(argv)
    seeds = [int(s) for s in options.seeds.split(",")]
    points = read_points(options.data)
    for point in options.point:
        measured = measured_point(point, seeds)
        if measured["flush"]["final"] or measured["paci"]["final"]:
            points = record(points, measured)
    if options.point:
        write_points(options.data, points)
    rows = []
    print("| optimizer | model | parameters | stages | gap vs flush, median [min, max] | seeds |")
    print("|---|---|---|---|---|---|")
    for point in in_order(points):
        measured, params = gap(point), parameters(point)
        if measured is None:
            print(f"(not measured yet: {point['paci']['run']} against {point['flush']['run']}, "
                  f"{point['optimizer']}, {point['model']} on {point['stages']} stages)",
                  file=sys.stderr)  # fmt: skip
            continue
        rows.append((point, params, measured))
        print(f"| {point['optimizer']} | {point['model']} | {params / 1e6:.2f}M | "
              f"{point['stages']} | {measured['median']:+.2f}% [{measured['min']:+.2f}, "
              f"{measured['max']:+.2f}] | {measured['seeds']} |")  # fmt: skip
    plot(rows, options.png)
    print(f"wrote {options.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
