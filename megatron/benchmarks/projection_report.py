"""The projection's report: each schedule's best configuration and PACI's speedups
(`summary`), and the Markdown tables of `docs/projection.md` (`markdown`)."""

from collections.abc import Sequence


def summary(rows: list[dict], schedules: Sequence[str], stages: int) -> dict:
    """Per global batch: each schedule's best micro-batch size, PACI's best over each other
    schedule's best, and PACI over flush at every shared configuration (the closed form's
    (m + N - 1) / m with N = `stages`)."""
    summary = {}
    for gb in sorted({r["global_batch"] for r in rows}):
        group = [r for r in rows if r["global_batch"] == gb]
        by = {name: [r for r in group if r["schedule"] == name] for name in schedules}
        best = {n: max(rs, key=lambda r: r["samples_per_s"]) for n, rs in by.items() if rs}
        entry = {
            f"best_{n}": {
                "micro_batch_size": r["micro_batch_size"],
                "microbatches": r["microbatches"],
                "samples_per_s": r["samples_per_s"],
            }
            for n, r in best.items()
        }
        if "paci" in best:
            entry["paci_best_over"] = {
                n: best["paci"]["samples_per_s"] / r["samples_per_s"]
                for n, r in best.items()
                if n != "paci"
            }
        if "paci" in best and "1f1b" in best:
            entry["paci_best_over_flush_best"] = entry["paci_best_over"]["1f1b"]
            flush = {(f["micro_batch_size"], f["microbatches"]): f for f in by["1f1b"]}
            same = [
                {
                    "micro_batch_size": r["micro_batch_size"],
                    "microbatches": r["microbatches"],
                    "ratio": r["samples_per_s"]
                    / flush[(r["micro_batch_size"], r["microbatches"])]["samples_per_s"],
                    "closed_form": (r["microbatches"] + stages - 1) / r["microbatches"],
                }
                for r in by["paci"]
                if (r["micro_batch_size"], r["microbatches"]) in flush
            ]
            entry["paci_over_flush_same_configuration"] = same
            entry["max_same_configuration_ratio"] = max(s["ratio"] for s in same)
        summary[str(gb)] = entry
    return summary


def markdown(report: dict) -> str:
    """The report as Markdown: inputs, per-sample curve, one row per configuration, summary
    (a link model's report: `cluster_markdown`)."""
    if "cluster" in report:
        return cluster_markdown(report)
    lines = _input_lines(report["inputs"])
    lines += _curve_lines(report)
    lines += _configuration_lines(report)
    lines += _summary_lines(report["summary"])
    return "\n".join(lines) + "\n"


def _input_lines(inputs: dict) -> list[str]:
    lines = []
    lines.append(f"Command: `{inputs['command']}`\n")
    balance = "; every stage at the mean cost" if inputs["uniform_stages"] else ""
    lines.append(
        f"Costs: {inputs['source']}; stages {inputs['stages']} (layers per stage "
        f"{inputs['stage_layers']}{balance})."
    )
    if "efficiency_curve" in inputs:
        lines.append(
            f"Peak {inputs['peak_tflops']:g} TFLOP/s; efficiency curve "
            f"({inputs['efficiency_curve_origin']}); p2p {inputs['p2p_model']}; flush per-step "
            f"sync {inputs['flush_sync_ms']:g} ms.\n"
        )
    else:
        lines.append(f"Flush per-step sync {inputs['flush_sync_ms']:g} ms.\n")
    return lines


def _curve_lines(report: dict) -> list[str]:
    inputs, lines = report["inputs"], []
    lines.append(
        "| micro-batch | efficiency | middle stage ms/sample | relative to largest "
        "| achieved TFLOP/s | p2p ms/hop |"
    )
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for p in report["per_sample_curve"]:
        eff = inputs.get("efficiency_curve", {}).get(str(p["micro_batch_size"]))
        lines.append(
            f"| {p['micro_batch_size']} | {'-' if eff is None else f'{eff:.3f}'} | "
            f"{p['middle_stage_ms_per_sample']:.3f} | {p['relative_to_largest']:.2f} | "
            f"{p['achieved_tflops']:.3g} | {p['p2p_ms']:.3f} |"
        )
    lines.append("")
    return lines


def _configuration_lines(report: dict) -> list[str]:
    inputs, lines = report["inputs"], []
    schedules = inputs["schedules"]
    head = "| global batch | micro-batch | m (a) | " + " | ".join(
        f"{s} samples/s" for s in schedules
    )
    extra = (
        " | PACI / flush | closed form (m+N-1)/m | PACI max drift | memory GB, peak/mean "
        "over stages (" + ", ".join(schedules) + ") |"
    )
    lines.append(head + extra)
    lines.append("|" + "---:|" * (3 + len(schedules) + 4))
    keys = sorted(
        {(r["global_batch"], r["micro_batch_size"], r["microbatches"]) for r in report["rows"]}
    )
    n = inputs["stages"]
    for gb, mbs, m in keys:
        cells = {
            r["schedule"]: r
            for r in report["rows"]
            if (r["global_batch"], r["micro_batch_size"], r["microbatches"]) == (gb, mbs, m)
        }
        rate = [f"{cells[s]['samples_per_s']:.1f}" if s in cells else "-" for s in schedules]
        ratio = (
            f"{cells['paci']['samples_per_s'] / cells['1f1b']['samples_per_s']:.3f}"
            if "paci" in cells and "1f1b" in cells
            else "-"
        )
        drift = str(cells["paci"]["max_drift"]) if "paci" in cells else "-"
        mem = ", ".join(
            (
                f"{cells[s]['peak_memory_gb']:.3g}/{cells[s]['mean_memory_gb']:.3g}"
                if s in cells
                else "-"
            )
            for s in schedules
        )
        lines.append(
            f"| {gb} | {mbs} | {m} | "
            + " | ".join(rate)
            + f" | {ratio} | {(m + n - 1) / m:.3f} | {drift} | {mem} |"
        )
    lines.append("")
    return lines


def _summary_lines(summary: dict) -> list[str]:
    lines = []
    for key, entry in summary.items():
        parts = [
            f"best {k[5:]}: micro-batch {v['micro_batch_size']} "
            f"({v['samples_per_s']:.1f} samples/s)"
            for k, v in entry.items()
            if k.startswith("best_")
        ]
        line = f"- global batch {key}: " + "; ".join(parts)
        if "paci_best_over_flush_best" in entry:
            line += (
                f"; **PACI best / flush best = {entry['paci_best_over_flush_best']:.2f}x**; "
                f"PACI / flush at the same configuration up to "
                f"{entry['max_same_configuration_ratio']:.2f}x"
            )
        others = {k: v for k, v in entry.get("paci_best_over", {}).items() if k != "1f1b"}
        if others:
            line += "; PACI best over best " + ", ".join(
                f"{k}: {v:.2f}x" for k, v in others.items()
            )
        lines.append(line)
    return lines


_MODE_HEADS = {
    "step": "at the step",
    "overlap-grad-reduce": "overlap-grad-reduce",
    "deferred-step": "deferred step",
}


def cluster_markdown(report: dict) -> str:
    """A link model's report: the cluster, what each message costs, and per m one row per
    schedule with samples/s and the fraction of the physical limit under each overlap mode
    (the fastest schedule of each mode in bold)."""
    lines = _cluster_input_lines(report["cluster"])
    rows = report["rows"]
    modes = [m for m in _MODE_HEADS if any(r["mode"] == m for r in rows)]
    lines.append("| b | m | schedule | " + " | ".join(_MODE_HEADS[m] for m in modes) + " |")
    lines.append("|---:|---:|---|" + "---:|" * len(modes))
    for mbs, m in sorted({(r["micro_batch_size"], r["microbatches"]) for r in rows}):
        group = [r for r in rows if (r["micro_batch_size"], r["microbatches"]) == (mbs, m)]
        best = {
            mode: max((r["samples_per_s"] for r in group if r["mode"] == mode), default=None)
            for mode in modes
        }
        for name in dict.fromkeys(r["schedule"] for r in group):
            cells = {r["mode"]: r for r in group if r["schedule"] == name}
            lines.append(f"| {mbs} | {m} | {name} | " + " | ".join(
                _cluster_cell(cells.get(mode), best[mode]) for mode in modes) + " |")  # fmt: skip
        limit = group[0]["limit_samples_per_s"]
        lines.append(f"| {mbs} | {m} | physical limit | " + " | ".join(
            f"{limit:.4g} (1)" for _ in modes) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _cluster_cell(row: dict | None, best: float | None) -> str:
    if row is None:
        return "-"
    text = f"{row['samples_per_s']:.4g} ({row['fraction_of_limit']:.3f})"
    return f"**{text}**" if best is not None and row["samples_per_s"] >= best * (1 - 1e-9) else text


def _split_text(cluster: dict, stages: int) -> str:
    if not cluster["vocab_split"]:
        return "off"
    arity = cluster.get("vocab_tree_arity", 2)
    tree = "the fan" if arity >= stages - 1 else f"a tree of arity {arity}"
    return f"on (the output layer's messages on {tree})"


def _cluster_input_lines(cluster: dict) -> list[str]:
    links, layout = cluster["links"], cluster["layout"]
    lines = [
        f"Command: `{cluster['command']}`\n",
        f"Cluster: {layout['nodes']} nodes of {links['ranks_per_node']} GPUs, TP {layout['tp']} "
        f"x PP {layout['pp']} x DP {layout['dp']} (Megatron's rank order); intra-node "
        f"{links['intra_bandwidth_gbs']:g} GB/s + {links['intra_latency_s'] * 1e6:g} us, "
        f"inter-node {links['inter_bandwidth_gbs']:g} GB/s + {links['inter_latency_s'] * 1e6:g} "
        f"us per GPU; vocabulary split {_split_text(cluster, layout['pp'])}; "
        f"{'distributed' if cluster['distributed_optimizer'] else 'plain'} optimizer.\n",
    ]
    for mbs, c in cluster["per_micro_batch_size"].items():
        messages = ", ".join(f"{k} {v:.3g}" for k, v in c["vocab_message_ms"].items())
        lines.append(
            f"- micro-batch {mbs} (ms): stage 0 F+B+W {c['pass_ms']:.3g}; hops "
            f"{' '.join(f'{h:.3g}' for h in c['hop_ms'])}; data-parallel reduction "
            f"{max(c['reduce_ms']):.3g} (largest stage), all-gather "
            f"{max(c['gather_ms'], default=0):.3g}; optimizer step {max(c['step_ms']):.3g}"
            + (f"; vocabulary messages (slowest link) {messages}" if messages else "")
        )
    lines.append("\nCells: samples/s of the whole cluster (fraction of the physical limit).\n")
    return lines
