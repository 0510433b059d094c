"""Figures for the schedule comparison (tools/replicate.py report): loss curves with their seed
spread, drift histograms, timelines and memory per stage. matplotlib, no display needed."""

import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {"F": "#4c72b0", "B": "#55a868", "S": "#c44e52", "W": "#c9a227"}
KIND_NAMES = {"F": "forward", "B": "backward", "S": "optimizer step", "W": "weight grad"}


def plot_loss_curves(curves: dict[str, tuple[list[float], list[list[float]]]], xlabel: str,
                     title: str, path: str) -> None:  # fmt: skip
    """curves: name -> (x values, one loss list per seed); median line, min-max band."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (xs, per_seed) in curves.items():
        columns = list(zip(*per_seed))
        median = [statistics.median(column) for column in columns]
        (line,) = ax.plot(xs, median, label=name, linewidth=1.4)
        ax.fill_between(xs, [min(c) for c in columns], [max(c) for c in columns],
                        color=line.get_color(), alpha=0.2, linewidth=0)  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training lm loss (trailing mean of 10 iterations)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    _zoom_on_tail(ax, curves)
    _save(fig, path)


def _zoom_on_tail(ax, curves) -> None:
    """Inset of the last 40% of the run, where the schedules' differences show (the curves fall
    from top left to bottom right, so the top right is free)."""
    inset = ax.inset_axes([0.52, 0.52, 0.45, 0.33])
    for name, (xs, per_seed) in curves.items():
        start = int(len(xs) * 0.6)
        columns = list(zip(*per_seed))[start:]
        inset.plot(xs[start:], [statistics.median(c) for c in columns], linewidth=1.2)
    inset.grid(alpha=0.3)
    inset.tick_params(labelsize=7)
    inset.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
    inset.set_title("last 40%, medians", fontsize=7)


def plot_drift_histograms(histograms: dict[str, list[dict[int, int]]], path: str) -> None:
    """histograms: name -> one {drift: count} per stage (all seeds together)."""
    names = list(histograms)
    stages = len(next(iter(histograms.values())))
    fig, axes = plt.subplots(len(names), stages, figsize=(2.6 * stages, 1.9 * len(names)),
                             sharex=True, squeeze=False)  # fmt: skip
    largest = max(max(h) for per_stage in histograms.values() for h in per_stage if h)
    for row, name in enumerate(names):
        for stage, histogram in enumerate(histograms[name]):
            ax = axes[row][stage]
            total = sum(histogram.values()) or 1
            drifts = list(range(largest + 1))
            ax.bar(drifts, [histogram.get(d, 0) / total for d in drifts], color="#4c72b0")
            ax.set_ylim(0, 1)
            ax.set_xticks(drifts)
            if row == 0:
                ax.set_title(f"stage {stage + 1}", fontsize=10)
            if stage == 0:
                ax.set_ylabel(f"{name}\nfraction", fontsize=9)
            if row == len(names) - 1:
                ax.set_xlabel("drift (optimizer steps)", fontsize=9)
    fig.suptitle("Weight drift per microbatch: steps between its forward and its backward")
    _save(fig, path)


def trace_events(path: str) -> list[tuple]:
    """(stage, kind, start s, duration s, microbatch) of a Chrome trace written by the runtime
    or by tools/simulate_pipeline.py."""
    events = json.load(open(path))["traceEvents"]
    return [
        (e["tid"], e["args"]["kind"], e["ts"] / 1e6, e["dur"] / 1e6, e["args"].get("microbatch"))
        for e in events
        if e.get("ph") == "X"
    ]


def step_window(events: list[tuple], first_step: int, steps: int) -> tuple[float, float]:
    """Time from the end of the last stage's step `first_step` to the end of step
    `first_step + steps` (1-based): whole iterations, as that stage sees them."""
    last = max(e[0] for e in events)
    ends = sorted(start + duration for stage, kind, start, duration, _ in events
                  if stage == last and kind == "S")  # fmt: skip
    first_step = max(1, min(first_step, len(ends) - steps))  # stay inside a short run
    return ends[first_step - 1], ends[first_step + steps - 1]


def plot_timelines(panels: list[tuple[str, list[tuple], tuple[float, float]]], path: str) -> None:
    """One Gantt panel per (title, events, (start, end)), time relative to the window start."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.1 * len(panels) + 0.6), squeeze=False)
    for ax, (title, events, (start, end)) in zip(axes[:, 0], panels):
        _draw_gantt(ax, events, start, end)
        ax.set_title(title, fontsize=9, loc="left")
    axes[0][0].legend(handles=[Patch(color=COLORS[k], label=KIND_NAMES[k]) for k in "FBS"],
                      loc="lower right", bbox_to_anchor=(1.0, 1.12), ncol=3, frameon=False,
                      fontsize=8)  # fmt: skip
    _save(fig, path)


def _draw_gantt(ax, events: list[tuple], start: float, end: float) -> None:
    stages = max(e[0] for e in events) + 1
    for stage, kind, begin, duration, microbatch in events:
        if begin + duration < start or begin > end:
            continue
        box = [(1000 * (begin - start), 1000 * duration)]
        color = COLORS.get(kind, "grey")
        ax.broken_barh(box, (stage - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(stages), [f"stage {s + 1}" for s in range(stages)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1000 * (end - start))
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(labelsize=8)


def plot_memory(memory: dict[str, dict], path: str) -> None:
    """memory: name -> {"state_mib": [...], "peak_activation_mib": [...]} per stage."""
    names = list(memory)
    stages = len(next(iter(memory.values()))["state_mib"])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for index, name in enumerate(names):
        xs = [stage + (index - (len(names) - 1) / 2) * width for stage in range(stages)]
        state, activations = memory[name]["state_mib"], memory[name]["peak_activation_mib"]
        bars = ax.bar(xs, activations, width, bottom=state, label=f"{name}: peak activations")
        ax.bar(xs, state, width, color=bars[0].get_facecolor(), alpha=0.35, hatch="//",
               edgecolor="white")  # fmt: skip
    ax.set_xticks(range(stages), [f"stage {s + 1}" for s in range(stages)])
    ax.set_ylabel("MiB")
    ax.set_title("Memory per stage: parameters + gradients + Adam state (hatched, equal for all)"
                 "\nand peak activations saved for backward (measured)", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
