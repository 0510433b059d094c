"""A Gantt chart of a simulated or traced timeline (matplotlib, imported on use)."""

_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#c9a227", "S": "#c44e52"}
_LABEL_LIMIT = 80  # label boxes with their microbatch when a stage runs at most this many


def plot_gantt(result, path: str) -> None:
    """A Gantt chart of the timeline: one row per stage, one box per action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = result.num_stages
    fig, ax = plt.subplots(figsize=(14, 0.5 * n + 1.5))
    per_stage = max((sum(1 for e in result.timeline if e.stage == s) for s in range(n)), default=0)
    for kind, color in _COLORS.items():
        for s in range(n):
            boxes = [
                (e.start_s, e.duration_s)
                for e in result.timeline
                if e.stage == s and e.action.kind.value == kind
            ]
            if boxes:
                ax.broken_barh(boxes, (s - 0.4, 0.8), facecolors=color, edgecolors="white")
    if per_stage <= _LABEL_LIMIT:
        for e in result.timeline:
            if e.action.microbatch is not None:
                x = e.start_s + e.duration_s / 2
                ax.text(x, e.stage, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n), [f"stage {s}" for s in range(n)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan or 1)
    ax.set_xlabel("time (s)")
    ax.set_title(
        f"{result.schedule}: N={n}, m={result.microbatches_per_step}, steps={result.steps}, "
        f"bubble {result.bubble_fraction:.3f}, throughput vs ideal {result.throughput_vs_ideal:.3f}",
        loc="right",
        fontsize=10,
    )
    kinds = {e.action.kind.value for e in result.timeline if e.duration_s > 0}
    names = {"F": "forward", "B": "backward", "W": "weight grad", "S": "optimizer step"}
    ax.legend(
        handles=[Patch(color=c, label=names[k]) for k, c in _COLORS.items() if k in kinds],
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=4,
        frameon=False,
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
