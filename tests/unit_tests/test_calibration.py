"""Calibration and projection: the calibration format, the measurement behind
tools/calibrate_stage.py, gpu_check.sh, and the projection behind project_paper_scale.py.

One real (tiny) calibration run on CPU in a subprocess; the rest is pure functions, the
simulator, and gpu_check.sh's argument and no-CUDA paths.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron.benchmarks import calibration_file as fmt
from megatron.benchmarks import projection as proj
from megatron.benchmarks.calibration_file import stage_costs_from_calibration
from megatron.studies import calibration as cal

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOLS = os.path.join(REPO, "tools")

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--vocab-size",
    "64",
]


# ------------------------------------------------------------------ calibrate_stage: pure parts


def _measured(
    layer=(2.0, 4.0, 0.5),
    overhead=(0.1, 0.2, 0.0),
    emb=(0.3, 0.1, 1.0),
    out=(1.5, 3.0, 1.0),
    depths=(1, 3),
):
    layer, overhead = fmt.PassCost(*layer), fmt.PassCost(*overhead)
    mid = {d: overhead + layer.scaled(d) for d in depths}
    return {
        "middle_d1": mid[depths[0]],
        "middle_d2": mid[depths[-1]],
        "first": mid[depths[0]] + fmt.PassCost(*emb),
        "last": mid[depths[0]] + fmt.PassCost(*out),
    }


def test_decompose_recovers_layer_embedding_output_and_overhead():
    parts, notes = fmt.decompose(_measured(), [1, 3])
    assert notes == []
    assert parts["layer"].values() == pytest.approx((2.0, 4.0, 0.5))
    assert parts["embedding"].values() == pytest.approx((0.3, 0.1, 1.0))
    assert parts["output"].values() == pytest.approx((1.5, 3.0, 1.0))
    assert parts["stage_overhead"].values() == pytest.approx((0.1, 0.2, 0.0))
    whole = fmt.predicted_whole_model(parts, 24)
    assert whole.forward_s == pytest.approx(0.3 + 24 * 2.0 + 1.5 + 0.1)


def test_decompose_clamps_noise_and_says_so():
    measured = _measured(emb=(-0.01, 0.1, 0.0))
    parts, notes = fmt.decompose(measured, [1, 3])
    assert parts["embedding"].forward_s == 0.0
    assert len(notes) == 1 and "embedding.forward_s" in notes[0]


def test_decompose_with_one_depth_divides():
    measured = _measured(overhead=(0, 0, 0), depths=(2,))
    parts, _ = fmt.decompose(measured, [2])
    assert parts["layer"].values() == pytest.approx((2.0, 4.0, 0.5))


def test_document_is_the_simulators_format():
    parts, _ = fmt.decompose(_measured(), [1, 3])
    profiles = [fmt.profile_entry(b, parts, 24, with_step=True, p2p_s=1e-4 * b) for b in (1, 2)]
    doc = fmt.calibration_document(
        model={"num_layers": 24}, device_type="cpu", profiles=profiles, metadata={"x": 1}
    )
    doc = json.loads(json.dumps(doc))
    assert doc["format"] == "pipeline-calibration" and doc["version"] == 1
    costs = stage_costs_from_calibration(doc, 8, 2)
    assert costs.forward[1] == pytest.approx(3 * 2.0)
    assert costs.forward[0] == pytest.approx(3 * 2.0 + 0.3)  # + embedding
    assert costs.backward[7] == pytest.approx(3 * 4.0 + 3.0)  # + output layer and loss
    assert costs.step[7] == pytest.approx(3 * 0.5 + 1.0)
    assert costs.p2p_latency == pytest.approx(2e-4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--micro-batch-sizes", "0"], "positive"),
        (["--bf16", "--dtype", "fp32"], "contradicts"),
        (["--depths", "1,5"], "--depths"),
        (["--p2p", "loopback", "--p2p-s", "0.1"], "not both"),
        (["--clock", "process", "--device", "cuda"], "--device cpu"),
    ],
)
def test_calibrate_rejects_bad_flags(argv, message):
    with pytest.raises(cal.UserError, match=message):
        cal.parse_args(TINY + argv)


# ------------------------------------------------------------------ calibrate_stage: a real run


def test_calibrate_stage_cli_on_cpu(tmp_path):
    out = tmp_path / "calib.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        os.path.join(TOOLS, "calibrate_stage.py"),
        *TINY,
        "--micro-batch-sizes",
        "1,2",
        "--device",
        "cpu",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--p2p",
        "loopback",
        "--threads",
        "1",
        "--depths",
        "1",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "micro-batch   1: layer F" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["model"]["num_layers"] == 2
    assert [p["micro_batch_size"] for p in doc["profiles"]] == [1, 2]
    meta = doc["metadata"]
    assert meta["layer_spec"] == "portable_sdpa" and meta["dtype"] == "fp32"
    assert meta["versions"]["torch"] and meta["device_name"] and meta["date"]
    assert set(meta["validation"]) == {"1", "2"}
    for profile in doc["profiles"]:  # one depth: layer = the 1-layer middle stage, never 0
        assert profile["layer"]["forward_s"] > 0 and profile["layer"]["backward_s"] > 0
        assert profile["p2p_s"] > 0
    for stages in (1, 2):  # the simulator reads it for any stage count the layers allow
        costs = stage_costs_from_calibration(doc, stages, 2)
        assert len(costs.forward) == stages and all(f > 0 for f in costs.forward)
    # ... and so does the projection tool
    report = proj.run(
        proj.parse_args(
            [
                "--calibration",
                str(out),
                "--stages",
                "2",
                "--global-batch-sizes",
                "4",
                "--micro-batch-sizes",
                "1,2",
            ]
        )
    )
    assert report["inputs"]["model"]["hidden"] == 32
    assert {r["micro_batch_size"] for r in report["rows"]} == {1, 2}


def test_calibrate_stage_bad_input_is_one_line():
    cmd = [sys.executable, os.path.join(TOOLS, "calibrate_stage.py"), *TINY, "--repeats", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "\n" not in proc.stderr.strip()


# ------------------------------------------------------------------ gpu_check.sh

GPU_CHECK = os.path.join(TOOLS, "gpu_check.sh")


def _gpu_check(*argv, **env):
    return subprocess.run(
        ["bash", GPU_CHECK, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_gpu_check_without_cuda_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "g.json"
    proc = _gpu_check("--output", str(out), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA device" in proc.stderr and "nothing was run" in proc.stderr
    assert not out.exists()


def test_gpu_check_dry_run_and_arguments():
    proc = _gpu_check("--dry-run", "--micro-batch-sizes", "1,2", "--", "--p2p-s", "0.001")
    assert proc.returncode == 0, proc.stderr
    for piece in (
        "calibrate_stage.py",
        "--device cuda --bf16",
        "--num-layers 24",
        "--hidden-size 1024",
        "--num-attention-heads 16",
        "--seq-length 1024",
        "--vocab-size 50304",
        "--p2p-s 0.001",
        "project_paper_scale.py",
    ):
        assert piece in proc.stdout.replace("  ", " ").replace("\\,", ","), piece
    assert _gpu_check("--help").returncode == 0
    for bad in (["--warmup", "x"], ["--stages", "5"], ["--bogus"], ["--output", "x.txt"]):
        proc = _gpu_check(*bad)
        assert proc.returncode == 2 and proc.stderr.startswith("gpu_check:"), bad


# ------------------------------------------------------------------ project_paper_scale


def test_flop_model_of_a_layer():
    shape = proj.Shape(num_layers=24, hidden=1024, ffn=4096, seq=1024, vocab=50304)
    f, b, w = proj.layer_flops(shape, 2)
    tokens = 2 * 1024
    assert w == pytest.approx(24 * tokens * 1024**2)
    assert f == pytest.approx(w + 2 * tokens * 1024 * 1024)
    assert b == pytest.approx(w + 4 * tokens * 1024 * 1024)
    assert shape.layer_params() == pytest.approx(12.6e6, rel=0.01)


def test_efficiency_curve_default_and_interpolation():
    assert proj.default_efficiency(1, 1024, 0.55, 2048) == pytest.approx(0.55 / 3)
    curve = {1: 0.2, 4: 0.4}
    assert proj.efficiency_at(curve, 2) == pytest.approx(0.3)  # halfway in log2
    with pytest.raises(ValueError):
        proj.efficiency_at(curve, 8)
    with pytest.raises(ValueError):
        proj.parse_efficiency("1:1.5")


def test_projection_balanced_pipeline_matches_the_closed_form():
    args = proj.parse_args(
        [
            "--num-layers",
            "8",
            "--stages",
            "4",
            "--global-batch-sizes",
            "32",
            "--micro-batch-sizes",
            "2,8",
            "--uniform-stages",
            "--p2p-s",
            "0",
            "--efficiency",
            "1:0.5,16:0.5",
            "--optimizer-bytes-per-param",
            "0",
        ]
    )
    report = proj.run(args)
    for same in report["summary"]["32"]["paci_over_flush_same_configuration"]:
        assert same["ratio"] == pytest.approx(same["closed_form"], rel=0.01)
    rows = {(r["schedule"], r["micro_batch_size"]): r for r in report["rows"]}
    assert rows[("paci", 8)]["max_drift"] == rows[("paci", 8)]["drift_bound"] == 1  # a = 4
    # flat efficiency: flush is best at the smallest micro-batch, PACI the same at all
    assert report["summary"]["32"]["best_1f1b"]["micro_batch_size"] == 2
    assert rows[("paci", 2)]["samples_per_s"] == pytest.approx(
        rows[("paci", 8)]["samples_per_s"], rel=0.01
    )
    # PACI keeps 1F1B's in-flight count, hence its memory
    assert rows[("paci", 8)]["peak_inflight"] == rows[("1f1b", 8)]["peak_inflight"]
    assert rows[("paci", 8)]["peak_memory_gb"] == pytest.approx(rows[("1f1b", 8)]["peak_memory_gb"])


def test_projection_zero_bubble_reference_and_memory():
    args = proj.parse_args(
        [
            "--preset",
            "zb-28b",
            "--num-layers",
            "14",
            "--stages",
            "8",
            "--stage-layers",
            "1,2,2,2,2,2,2,1",
            "--microbatches",
            "16",
            "--schedules",
            "1f1b,zb-h1,paci,pipedream",
        ]
    )
    rows = {r["schedule"]: r for r in proj.run(args)["rows"]}
    rate = {name: r["samples_per_s"] for name, r in rows.items()}
    assert rate["1f1b"] < rate["zb-h1"] < rate["paci"]
    # ZB-H1: deferred weight gradients keep activations on every stage, up to N microbatches
    assert rows["zb-h1"]["held_activations"][0] == rows["1f1b"]["held_activations"][0] == 8
    assert max(rows["zb-h1"]["held_activations"][1:]) > rows["1f1b"]["held_activations"][1]
    # PipeDream stashes N - 1 - s weight versions
    assert rows["pipedream"]["extra_weight_versions"][0] == 7
    assert rows["pipedream"]["peak_memory_gb"] > rows["paci"]["peak_memory_gb"]


def test_projection_bad_flags():
    with pytest.raises(ValueError, match="not both"):
        proj.parse_args(["--global-batch-sizes", "128", "--microbatches", "8"])
    with pytest.raises(ValueError, match="stage-layers"):
        proj.parse_args(["--num-layers", "10", "--stages", "4"])
    with pytest.raises(ValueError, match="unknown schedule"):
        proj.parse_args(["--schedules", "1f1b,nope"])


def test_projection_with_the_vocabulary_split_evens_the_stages_memory():
    """GPT-2 Medium on 8 stages, 3 layers each: the output layer and the input embedding (51M
    parameters each) and the logits leave the last and the first stage, every stage holding
    1/8 of them; on a fast link (400 GB/s) the even layers are faster despite the messages."""
    flags = ["--preset", "gpt2-medium", "--micro-batch-sizes", "4", "--global-batch-sizes",
             "128", "--schedules", "paci", "--p2p-bandwidth-gbs", "400"]  # fmt: skip
    whole, split = (proj.parse_args(flags + extra) for extra in ([], ["--enable-vocab-parallel"]))
    rows = {name: proj.run(args)["rows"][0] for name, args in (("whole", whole), ("split", split))}
    memory = {name: row["memory_gb_per_stage"] for name, row in rows.items()}
    assert memory["split"][-1] < memory["whole"][-1] and memory["split"][0] < memory["whole"][0]
    # the first stage holds the most activations in flight: still the largest
    assert max(memory["split"]) == memory["split"][0]
    # stage to stage only the activations in flight differ (one microbatch fewer each)
    steps = [a - b for a, b in zip(memory["split"], memory["split"][1:])]
    assert max(steps) - min(steps) < 1e-9
    assert rows["split"]["samples_per_s"] > rows["whole"]["samples_per_s"]  # even layers
    shape = proj.Shape(24, 1024, 4096, 1024, 50304)
    costs = proj.modelled_costs(split, shape, 4, 0.3)
    assert len(set(costs.forward[1:-1])) == len(set(costs.backward[1:-1])) == 1
    assert costs.forward[-1] > costs.forward[0] > costs.forward[1]  # the fan-ins (out > in)
    with pytest.raises(ValueError, match="--enable-vocab-parallel re-splits the output layer"):
        proj.run(proj.parse_args(["--calibration", "docs/calibration/cpu_small.json",
                                  "--enable-vocab-parallel"]))  # fmt: skip
