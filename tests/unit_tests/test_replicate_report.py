"""tools/replicate.py report on synthetic runs: every figure is written, and the tables carry
the numbers the runs hold (final loss, same-seed gap to flush, drift)."""

import json
import os
import subprocess
import sys

import tool_scripts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_replicate():
    """tools/replicate.py as a module (a script beside the packages, not one of them)."""
    return tool_scripts.load("replicate")


replicate = load_replicate()

SEEDS = [1, 2]


def fake_timeline(path: str, microbatches: int) -> None:
    """Five iterations of a 4-stage run: per stage F and B per microbatch, then a step."""
    events, clock = [], 0.0
    for _ in range(5):
        for stage in range(replicate.STAGES):
            for kind in "FB":
                for microbatch in range(microbatches):
                    events.append({"ph": "X", "tid": stage, "ts": clock, "dur": 50.0,
                                   "args": {"kind": kind, "microbatch": microbatch}})  # fmt: skip
                    clock += 60.0
            events.append(
                {"ph": "X", "tid": stage, "ts": clock, "dur": 20.0, "args": {"kind": "S"}}
            )
            clock += 30.0
    json.dump({"traceEvents": events}, open(path, "w"))


def fake_summary(loss_offset: float, max_drift: list[int]) -> dict:
    stage = lambda s: {  # noqa: E731
        "max_drift": max_drift[s], "mean_drift": max_drift[s] / 2,
        "drift_histogram": {"0": 5, str(max_drift[s]): 5}, "peak_inflight_microbatches": 4 - s,
        "peak_activation_bytes": 2**20, "param_bytes": 2**20, "grad_bytes": 2**20,
        "optimizer_state_bytes": 2**21,
    }  # fmt: skip
    return {
        "loss": [3.0] * 10 + [2.0 + loss_offset] * 10,
        "validation": [{"iteration": 20, "lm loss": 2.5 + loss_offset}],
        "elapsed_s": 10.0,
        "stages": [stage(s) for s in range(replicate.STAGES)],
    }


def write_runs(runs: str) -> None:
    for seed in SEEDS:
        for name, schedule, microbatches in replicate.CONFIGS:
            directory = replicate.run_directory(runs, seed, name)
            os.makedirs(directory)
            # PACI 1% above flush on seed 1, 3% on seed 2; flush itself 2.0 + 0.1 * seed
            base = 2.0 + 0.1 * seed
            offset = base - 2.0 if schedule == "1f1b" else base * (1 + 0.02 * seed - 0.01) - 2.0
            drift = [0, 0, 0, 0] if schedule == "1f1b" else [3, 2, 1, 0]
            json.dump(
                fake_summary(offset, drift), open(os.path.join(directory, "summary.json"), "w")
            )
            fake_timeline(os.path.join(directory, "timeline.json"), microbatches)


def calibration(path: str) -> None:
    profile = lambda size: {  # noqa: E731
        "micro_batch_size": size, "num_layers": 4,
        "layer": {"forward_s": 0.001 * size, "backward_s": 0.002 * size},
        "output": {"forward_s": 0.004 * size, "backward_s": 0.008 * size},
    }  # fmt: skip
    json.dump({"profiles": [profile(size) for size in (2, 4, 8, 16)]}, open(path, "w"))


def test_report_figures_and_tables(tmp_path):
    runs, output = str(tmp_path / "runs"), str(tmp_path / "results")
    write_runs(runs)
    calibration(str(tmp_path / "calibration.json"))
    command = [
        sys.executable, os.path.join(REPO, "tools", "replicate.py"), "report", "--runs", runs,
        "--seeds", *map(str, SEEDS), "--calibration", str(tmp_path / "calibration.json"),
        "--output", output, "--command", "bash examples/paci/replicate_cpu.sh",
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    names = [name for name, _, _ in replicate.CONFIGS]
    expected = ["loss_vs_tokens.png", "loss_vs_projected_time.png", "drift_histograms.png",
                "loss_vs_projected_time_balanced.png",
                "memory_per_stage.png", *[f"timeline_{name}.png" for name in names]]  # fmt: skip
    for figure in expected:
        assert os.path.getsize(os.path.join(output, figure)) > 10_000, figure
    readme = open(os.path.join(output, "README.md")).read()
    for figure in expected:
        assert f"({figure})" in readme
    assert "bash examples/paci/replicate_cpu.sh" in readme
    # flush: 2.1 and 2.2 -> median 2.15; PACI: +1% on seed 1, +3% on seed 2 -> median +2%
    assert "| flush | 1f1b, 8 x 2 | 2.150 [2.100, 2.200] | +0.00% [+0.00, +0.00]" in readme
    assert "| paci_a4 | paci, 4 x 4 | 2.194 [2.121, 2.266] | +2.00% [+1.00, +3.00]" in readme
    assert "| 3 2 1 0 | 1.50 1.00 0.50 0.00 |" in readme
    results = json.load(open(os.path.join(output, "results.json")))
    flush, paci = (results["projections"][name]["seconds"] for name in ("flush", "paci_a8"))
    assert paci < flush  # same microbatches; PACI has no flush bubble
