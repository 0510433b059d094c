"""The memory report's rows and table (the runs themselves are real launches: docs/memory_report.md)."""

from megatron.studies.memory_report import (
    configurations,
    markdown_table,
    parse_options,
    stage_rows,
)


def test_rows_are_schedules_by_recomputation_then_variants():
    options = parse_options(["--variant", "bf16=--bf16 --seed 3",
                             "--paci-variant", "capped=--paci-inflight-limit flush"])  # fmt: skip
    labels = [label for label, _ in configurations(options)]
    assert labels == ["1f1b", "paci", "1f1b selective", "paci selective", "1f1b full",
                      "paci full", "1f1b bf16", "paci bf16", "paci capped"]  # fmt: skip
    flags = dict(configurations(options))
    assert flags["paci full"][:2] == ["--pipeline-schedule", "paci"]
    assert "--recompute-granularity" in flags["paci full"]
    assert flags["paci bf16"][-3:] == ["--bf16", "--seed", "3"]
    assert flags["paci capped"] == [
        "--pipeline-schedule", "paci", "--paci-inflight-limit", "flush"
    ]  # fmt: skip


def _summary(real_peaks, activations):
    stages = [
        {"stage": s, "param_bytes": 2**20, "grad_bytes": 2**20, "optimizer_state_bytes": 2**21,
         "peak_activation_bytes": a, "peak_inflight_microbatches": 2 - s,
         "real_peak_bytes": r, "baseline_rss_bytes": 2**28}
        for s, (r, a) in enumerate(zip(real_peaks, activations))
    ]  # fmt: skip
    return {"stages": stages, "final_loss": 7.0}


def test_table_compares_each_stage_with_the_first_run():
    rows = stage_rows("1f1b", _summary([100 * 2**20, 50 * 2**20], [2**20, 2**19]))
    rows += stage_rows("paci", _summary([101 * 2**20, 50 * 2**20], [2**20, 2**19]))
    table = markdown_table(rows).splitlines()
    assert len(table) == 2 + 4
    assert table[2].startswith("| 1f1b | 0 | 1.00 | 1.00 | 2.00 | 1.00 | 2 | 100.0 | +0.0% |")
    assert table[3].startswith("| paci | 0 |") and "| 101.0 | +1.0% |" in table[3]
    assert "| 50.0 | +0.0% |" in table[5]


def test_probe_analysis_takes_each_stage_at_its_peak(tmp_path):
    import json

    from megatron.studies.memory_probe import analyze

    MiB = 2**20
    for run, peaks in (("flush", [100, 120]), ("paci", [101, 130])):
        (tmp_path / run).mkdir()
        records = [{"action": "FORWARD", "in_flight": 1, "before": 90 * MiB, "peak": p * MiB,
                    "in_use": 50 * MiB, "heap": 60 * MiB, "free": 10 * MiB} for p in peaks]  # fmt: skip
        (tmp_path / run / "rank0.json").write_text(json.dumps(records))
    table = analyze([str(tmp_path / "flush"), str(tmp_path / "paci")]).splitlines()
    assert table[2] == "| flush | 0 | 120.0 | +0.00% | 50.0 | 60.0 |"
    assert table[3] == "| paci | 0 | 130.0 | +8.33% | 50.0 | 60.0 |"
