"""Tables and the plot of the delay study (`delay_study.py`'s JSON-lines results).

Differences are paired by seed (delayed minus synchronous on the same seed, same data order
and initial weights) before taking the median and range over seeds.
"""

import statistics

from megatron.studies.delay_study import BASE_LR, MOMENTUM, VARIANTS, load_results


def _rows(results: dict, **match) -> list[dict]:
    return [
        r
        for r in results.values()
        if all(r[k] == v for k, v in match.items()) and r["validation_loss"] is not None
    ]


def _by_seed(results: dict, optimizer: str, variant: str, **match) -> dict[int, float]:
    rows = _rows(results, optimizer=optimizer, variant=variant, **match)
    return {r["seed"]: r["validation_loss"] for r in rows}


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f} (1 run)"
    return f"{median:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[s] - b[s] for s in sorted(a) if s in b]


def main_table(results: dict, optimizers) -> str:
    header = (
        "| optimizer | LR | sync | delayed | delayed+EF | sync+EF (control) | delay gap | "
        "EF gain, delayed | gap recovered by EF | EF gain, sync | gap, both with EF | n |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for name in optimizers:
        lr, momentum = BASE_LR[name], MOMENTUM[name][0]
        cells = {v: _by_seed(results, name, v, purpose="main", lr=lr) for v in VARIANTS}
        if not cells["sync"]:
            continue
        gap = _paired(cells["delayed"], cells["sync"])
        ef_delayed = _paired(cells["delayed"], cells["delayed+ef"])
        ef_sync = _paired(cells["sync"], cells["sync+ef"])
        recovered = [e / g for e, g in zip(ef_delayed, gap) if g > 0]
        gap_with_ef = _paired(cells["delayed+ef"], cells["sync+ef"])
        values = [_fmt(list(cells[v].values())) for v in VARIANTS]
        seeds = min(len(c) for c in cells.values())
        lines.append(
            f"| {name} (m {momentum:g}) | {lr:g} | " + " | ".join(values)
            + f" | {_fmt(gap)} | {_fmt(ef_delayed)} | {_fmt(recovered, 2)} | {_fmt(ef_sync)} "
            f"| {_fmt(gap_with_ef)} | {seeds} |"
        )  # fmt: skip
    return header + "\n".join(lines)


def _sweep_line(name: str, point: float, by_variant: dict) -> str:
    sync, delayed = by_variant["sync"], by_variant["delayed"]
    ef, control = by_variant.get("delayed+ef"), by_variant.get("sync+ef")
    recovered = "-"
    if ef is not None and delayed > sync:
        recovered = f"{(delayed - ef) / (delayed - sync):.2f}"
    cells = [f"{v:.3f}" if v is not None else "-" for v in (sync, delayed, ef, control)]
    return (
        f"| {name} | {point:.3g} | "
        + " | ".join(cells)
        + f" | {delayed - sync:+.3f} | {recovered} |"
    )


def sweep_table(results: dict, optimizers, seed: int, purpose: str) -> str:
    """Every variant at each swept value (the base point from the main runs' seed)."""
    label = "LR" if purpose == "lr" else "momentum"
    header = (
        f"| optimizer | {label} | sync | delayed | delayed+EF | sync+EF | delay gap | "
        "gap recovered by EF |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for name in optimizers:
        rows = [r for r in _rows(results, optimizer=name, seed=seed)
                if r["purpose"] in ("main", purpose)]  # fmt: skip
        if purpose == "lr":
            rows = [r for r in rows if r["momentum"] == MOMENTUM[name][0]]
        else:
            rows = [r for r in rows if r["lr"] == BASE_LR[name]]
        for point in sorted({r[purpose] for r in rows}):
            by_variant = {r["variant"]: r["validation_loss"] for r in rows if r[purpose] == point}
            if "sync" in by_variant and "delayed" in by_variant:
                lines.append(_sweep_line(name, point, by_variant))
    return header + "\n".join(lines)


def plot(results: dict, optimizers, seed: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, sweep) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.2
    for index, variant in enumerate(VARIANTS):
        medians, low, high, positions = [], [], [], []
        for position, name in enumerate(optimizers):
            values = list(_by_seed(results, name, variant, purpose="main",
                                   lr=BASE_LR[name]).values())  # fmt: skip
            if not values:
                continue
            median = statistics.median(values)
            medians.append(median)
            low.append(median - min(values))
            high.append(max(values) - median)
            positions.append(position + (index - 1.5) * width)
        bars.bar(positions, medians, width, yerr=[low, high], capsize=2, label=variant)
    bars.set_xticks(range(len(optimizers)), optimizers)
    bars.set_ylabel("validation loss (median, range over seeds)")
    bars.set_title("synchronous vs one-step delayed, with and without error feedback")
    everything = [r["validation_loss"] for r in _rows(results, purpose="main")]
    bars.set_ylim(min(everything) - 0.1, max(everything) + 0.05)
    bars.legend(fontsize=8)
    for name in optimizers:
        points = []
        for factor in (1 / 3, 1, 3, 9):
            lr = BASE_LR[name] * factor
            sync = _by_seed(results, name, "sync", lr=lr, momentum=MOMENTUM[name][0])
            delayed = _by_seed(results, name, "delayed", lr=lr, momentum=MOMENTUM[name][0])
            if seed in sync and seed in delayed:
                points.append((factor, delayed[seed] - sync[seed]))
        if points:
            sweep.plot(*zip(*points), marker="o", label=name)
    sweep.set_xscale("log")
    sweep.set_xlabel("LR / base LR")
    sweep.set_ylabel(f"delayed - sync validation loss (seed {seed})")
    sweep.set_title("delay gap across the LR sweep")
    sweep.axhline(0, color="grey", linewidth=0.5)
    sweep.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(path: str, optimizers, sweep_seed: int, plot_path: str | None) -> str:
    results = load_results(path)
    if plot_path:
        plot(results, optimizers, sweep_seed, plot_path)
    return "\n\n".join(
        [
            "Validation loss after the run, median [min, max] over seeds:\n\n"
            + main_table(results, optimizers),
            f"LR sweep (seed {sweep_seed}):\n\n"
            + sweep_table(results, optimizers, sweep_seed, "lr"),
            f"Momentum sweep (seed {sweep_seed}):\n\n"
            + sweep_table(results, optimizers, sweep_seed, "momentum"),
        ]
    )
