"""tools/benchmark_communication.py's pure parts: the matrix of rows, each run's flags (valid
for pretrain_gpt.py at 4 processes), the launch command, the log's cutting and parsing, and the
table from fake summaries. No root, no launch."""

import os

import pytest
import tool_scripts

from megatron.training.arguments import build_parser, validate_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool():
    """The tool as a module (a script beside the packages, not one of them)."""
    return tool_scripts.load("benchmark_communication")


tool = load_tool()
Row = tool.Row


def test_the_matrix_runs_one_schedule_without_a_pipeline():
    rows = tool.all_rows(variants=())
    names = {row.name for row in rows}
    # emulated and real: pp2xdp2 x {1f1b, paci} x {plain, distopt} x {at-step, overlap}, dp4
    # x 1f1b x {plain, distopt} x {at-step, overlap}
    assert len(rows) == 2 * (2 * 2 * 2 + 2 * 2) == 24
    assert "real/dp4/1f1b/distopt/overlap" in names
    assert not [name for name in names if name.startswith(("real/dp4/paci", "emulated/dp4/paci"))]


def test_a_variant_is_one_more_row_per_paci_row_it_applies_to():
    rows = tool.all_rows()
    variant = tool.VARIANTS[0]
    extra = [row for row in rows if row.reduction == variant.name]
    assert {row.schedule for row in extra} == set(variant.schedules)
    assert {row.optimizer for row in extra} == set(variant.optimizers)
    assert {row.topology for row in extra} == {"pp2xdp2"}  # data parallelism alone: no PACI
    assert len(rows) == 24 + len(extra)


def test_a_variant_whose_flag_the_parser_lacks_is_left_out_and_said_so():
    kept, notes = tool.available_variants({"--overlap-grad-reduce"})
    assert kept == [] and notes == [
        "variant deferred-step left out: the parser has no --paci-deferred-step"
    ]
    kept, notes = tool.available_variants({"--paci-deferred-step"})
    assert [v.name for v in kept] == ["deferred-step"] and notes == []


def test_rows_and_quick_select_by_pattern():
    rows = tool.all_rows(variants=())
    picked = tool.select(rows, ["emulated/pp2xdp2/*/plain/*"])
    assert [r.name for r in picked] == [
        "emulated/pp2xdp2/1f1b/plain/at-step", "emulated/pp2xdp2/1f1b/plain/overlap",
        "emulated/pp2xdp2/paci/plain/at-step", "emulated/pp2xdp2/paci/plain/overlap",
    ]  # fmt: skip
    assert tool.select(rows, []) == rows
    quick = tool.select(rows, tool.QUICK)
    assert {r.topology for r in quick} == {"pp2xdp2"} and {r.optimizer for r in quick} == {"plain"}


def _flags(args, flag):
    return args[args.index(flag) + 1]


def test_each_run_has_the_row_flags():
    emulated = tool.case_args(Row("emulated", "pp2xdp2", "paci", "plain", "overlap"), 10)
    assert _flags(emulated, "--pipeline-schedule") == "paci"
    assert _flags(emulated, "--global-batch-size") == "16"  # 4 microbatches of 2, 2 replicas
    assert _flags(emulated, "--emulated-backward-ms") == "60.0"
    assert _flags(emulated, "--emulated-param-count") == "2000000"
    assert _flags(emulated, "--ddp-bucket-size") == "500000" and "--overlap-grad-reduce" in emulated
    assert "--use-distributed-optimizer" not in emulated
    real = tool.case_args(Row("real", "dp4", "1f1b", "distopt", "at-step"), 12)
    assert _flags(real, "--global-batch-size") == "32" and _flags(real, "--train-iters") == "12"
    assert "--use-distributed-optimizer" in real and "--overlap-grad-reduce" not in real
    assert "--emulated-forward-ms" not in real and _flags(real, "--hidden-size") == "256"
    deferred = tool.case_args(Row("real", "pp2xdp2", "paci", "plain", "deferred-step"), 10)
    assert deferred[-3:] == ["--ddp-bucket-size", "750000", "--paci-deferred-step"]


def test_every_run_is_a_valid_pretrain_gpt_command_at_4_processes():
    variants, _ = tool.available_variants(tool.parser_flags())
    for row in tool.all_rows(variants):
        args = build_parser().parse_args(tool.case_args(row, 10))
        validate_args(args, world_size=4, check_files=False)  # raises on a refused combination


def test_a_rate_is_one_launch_of_all_its_runs_on_the_shaped_link():
    command = tool.launch_command("1gbit", "/tmp/cases.json", python="/v/bin/python")
    split = command.index("--")
    assert command[:split] == ["/v/bin/python", os.path.join(REPO, "tools", "shaped_link.py"),
                               "--rate", "1gbit"]  # fmt: skip
    assert command[split + 1 :] == [
        "/v/bin/torchrun", "--standalone", "--nproc-per-node=4",
        os.path.join(REPO, "tools", "run_pretrain_cases.py"), "/tmp/cases.json",
    ]  # fmt: skip
    rows = [Row("emulated", "pp2xdp2", "1f1b", "plain", "at-step"),
            Row("emulated", "pp2xdp2", "paci", "plain", "at-step")]  # fmt: skip
    cases = tool.cases("none", rows, 2, 10, "/out")
    assert [c["name"] for c in cases] == [  # repeats interleaved
        "none emulated/pp2xdp2/1f1b/plain/at-step #0", "none emulated/pp2xdp2/paci/plain/at-step #0",
        "none emulated/pp2xdp2/1f1b/plain/at-step #1", "none emulated/pp2xdp2/paci/plain/at-step #1",
    ]  # fmt: skip
    assert cases[1]["metrics_dir"] == "/out/none/emulated_pp2xdp2_paci_plain_at-step/r0"
    shown = tool.shown_command("1gbit", rows[0], 10)
    assert shown.startswith(
        ".venv/bin/python tools/shaped_link.py --rate 1gbit -- .venv/bin/torchrun --standalone "
    )


def _line(iteration, ms, reduce_ms=None, exposed_ms=None):
    reduction = ""
    if reduce_ms is not None:
        reduction = f"dp reduce/exposed per iteration (ms): {reduce_ms}/{exposed_ms} | "
    return (f" [2026-01-01 00:00:00] iteration {iteration:8d}/      10 | consumed samples: "
            f"{16 * iteration:12d} | elapsed time per iteration (ms): {ms} | learning rate: "
            f"1.0E-03 | {reduction}weight drift max/mean by stage: 0/0.00 |")  # fmt: skip


LOG = "\n".join(
    ["> setting up", "=== case 1gbit a #0"]
    + [_line(i, 100.0 * i, 50.0, 10.0) for i in range(1, 6)]
    + ["> wrote summary.json", "=== case 1gbit b #0", _line(1, 7.0), "Traceback ..."]
)


def test_the_log_is_cut_by_run_and_parsed():
    parts = tool.split_log(LOG)
    assert list(parts) == ["1gbit a #0", "1gbit b #0"]
    entries = tool.iterations_of(parts["1gbit a #0"])
    assert [e["iteration"] for e in entries] == [1, 2, 3, 4, 5]
    assert entries[2] == {"iteration": 3, "ms": 300.0, "reduce_ms": 50.0, "exposed_ms": 10.0}
    assert tool.iterations_of(parts["1gbit b #0"]) == [{"iteration": 1, "ms": 7.0}]


SUMMARY = {
    "global_batch_size": 16, "seq_length": 128, "iterations": 5,
    "stages": [
        {"dp_reduce_s": 1.0, "dp_exposed_s": 0.25, "dp_reduced_bytes": 40_000_000,
         "dp_buckets_in_backward": 20, "dp_buckets_at_step": 5},
        {"dp_reduce_s": 0.5, "dp_exposed_s": 0.5, "dp_reduced_bytes": 20_000_000,
         "dp_buckets_in_backward": 0, "dp_buckets_at_step": 5},
    ],
}  # fmt: skip


def test_a_run_figures_from_its_summary_and_log():
    figures = tool.run_figures(SUMMARY, tool.split_log(LOG)["1gbit a #0"], warmup=2)
    assert figures["iteration_ms"] == 400.0  # median of iterations 3, 4, 5
    assert figures["iteration_ms_range"] == [300.0, 500.0] and figures["iterations_measured"] == 3
    assert figures["tokens_per_s"] == pytest.approx(16 * 128 / 0.4)
    assert figures["reduce_ms_per_stage"] == [200.0, 100.0]
    assert figures["exposed_ms_per_stage"] == [50.0, 100.0]
    assert figures["hidden_share"] == pytest.approx(1 - 150 / 300)
    assert figures["buckets_per_step_per_stage"] == [5.0, 1.0]
    assert figures["reduced_mb_per_step_per_stage"] == [8.0, 4.0]
    assert figures["logging_stage_median_reduce_ms"] == 50.0
    with pytest.raises(ValueError):
        tool.run_figures(SUMMARY, tool.split_log(LOG)["1gbit a #0"], warmup=5)


def test_a_row_is_its_median_run_and_the_table_shows_it():
    lines = tool.split_log(LOG)["1gbit a #0"]
    runs = [tool.run_figures(SUMMARY, lines, warmup=w) for w in (0, 2, 3)]  # 300, 400, 450
    runs[0]["hidden_share"] = 0.2  # the fastest run hid less: the row shows the median run's
    row = tool.row_figures(runs)
    assert row["iteration_ms"] == 400.0 and row["repeats"] == 3
    assert row["repeat_iteration_ms"] == [300.0, 400.0, 450.0]
    single = tool.row_figures(runs[1:2])
    table = tool.table_lines("1gbit", {"x/a": row, "x/b": single, "x/c": {"error": "exit 1"}})
    assert table[0] == "rate 1gbit:"
    assert table[2] == ("| row | iteration ms (range) | tokens/s | reduce ms/it by stage | "
                        "exposed ms/it by stage | hidden | buckets/step |")  # fmt: skip
    assert row["repeat_hidden_share"] == [0.2, 0.5, 0.5]
    assert table[4] == (
        "| x/a | 400 (300-450 over 3 runs) | 5120 | 200/100 | 50/100 | 50% (20-50%) | 5/1 |"
    )
    assert table[5] == "| x/b | 400 (300-500) | 5120 | 200/100 | 50/100 | 50% | 5/1 |"
    assert table[6].startswith("| x/c | failed: exit 1 |")
    assert table[6].count("|") == len(tool.COLUMNS) + 1
