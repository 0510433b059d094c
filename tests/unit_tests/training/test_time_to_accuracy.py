"""Time-to-accuracy arithmetic: target crossings, spreads and the projected ratios."""

import os

import pytest

from megatron.studies import time_to_accuracy as tta

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_crossing_is_interpolated_between_the_evaluations_around_it():
    curve = [(20, 7.0), (40, 6.0), (60, 5.0)]
    assert tta.iterations_to(curve, 5.5) == pytest.approx(50.0)
    assert tta.iterations_to(curve, 7.5) == 20.0  # already below at the first evaluation
    assert tta.iterations_to(curve, 6.0) == 40.0
    assert tta.iterations_to(curve, 4.9) is None


def test_a_seed_that_misses_the_target_has_no_median():
    runs = [tta.Run("a", 1, [(10, 6.0), (20, 5.0)]), tta.Run("a", 2, [(10, 6.0), (20, 5.8)])]
    table = tta.iteration_table(runs, [5.9, 5.5])
    crossing = table["a"]["5.9"]  # 10 + 10 * 0.1 / 1.0 and 10 + 10 * 0.1 / 0.2
    assert [crossing[k] for k in ("min", "median", "max")] == pytest.approx([11.0, 13.0, 15.0])
    assert table["a"]["5.5"] is None and table["a"]["5.5 reached"] == 1
    assert table["a"]["final"] == {"median": 5.4, "min": 5.0, "max": 5.8}


def test_the_final_evaluation_is_the_final_loss_only_where_every_run_has_one():
    """Two runs' last periodic evaluations read other validation batches when they evaluated a
    different number of times; the final evaluation reads the same, so it is the final loss when
    both have it, and neither's is mixed with the other's last periodic one."""
    flush = tta.Run("flush", 1, [(40, 3.0), (50, 2.5)], final_validation=3.2)
    paci = tta.Run("paci", 1, [(40, 2.8)], final_validation=3.3)
    older = tta.Run("older", 1, [(40, 2.9), (50, 2.7)])
    assert tta.final_losses([flush, paci]) == [3.2, 3.3]
    assert tta.paired_gaps([flush, paci], "paci", "flush")["median"] == pytest.approx(3.3 / 3.2 - 1)
    assert tta.final_losses([flush, older]) == [2.5, 2.7]
    assert tta.paired_gaps([flush, paci, older], "older", "flush")["median"] == pytest.approx(
        2.7 / 2.5 - 1
    )
    assert tta.iteration_table([flush, paci], [2.9])["paci"]["final"]["median"] == 3.3


def test_projected_ratio_multiplies_iteration_ratio_by_schedule_speed():
    table = {
        "flush-a": {"5.0": {"median": 100.0}},
        "flush-b": {"5.0": {"median": 80.0}},  # the best flush
        "paci": {"5.0": {"median": 100.0}},
        "paci-sync": {"5.0": {"median": 100.0}},
    }
    configs = {
        "flush-a": tta.Configuration("flush-a", "1f1b", 1e-3),
        "flush-b": tta.Configuration("flush-b", "1f1b", 1e-3),
        "paci": tta.Configuration("paci", "paci", 1e-3),
        "paci-sync": tta.parse_configuration(
            "paci-sync=paci:1e-3:--async-sync-warmup-iters=20,--async-sync-cooldown-iters=20"
        ),
    }
    speed = {"1f1b": {128: 1.0}, "paci": {128: 1.5}}
    ratios = tta.projected_ratios(table, configs, [5.0], speed, total=200)
    assert ratios["flush-b"]["5.0"][128] == 1.0
    assert ratios["flush-a"]["5.0"][128] == pytest.approx(0.8)
    assert ratios["paci"]["5.0"][128] == pytest.approx(0.8 * 1.5)
    # 20 warmup iterations at flush speed, 80 at PACI's; the cooldown (180-200) not reached
    assert ratios["paci-sync"]["5.0"][128] == pytest.approx(80.0 / (20 + 80 / 1.5))
    assert tta.synchronous_iterations(configs["paci-sync"], 190.0, 200) == 30.0


def test_configuration_text():
    config = tta.parse_configuration("ef=paci:1e-3:--async-error-feedback,--optimizer=muon")
    assert (config.schedule, config.lr) == ("paci", 1e-3)
    assert config.flags == ("--async-error-feedback", "--optimizer", "muon")
    args = config.args(iterations=40, eval_interval=20, seed=3)
    assert args[args.index("--seed") + 1] == "3" and args[-2:] == ["--optimizer", "muon"]
    with pytest.raises(ValueError, match="expected NAME=SCHEDULE:LR"):
        tta.parse_configuration("paci:1e-3")


def test_tokens_to_target_and_paired_gaps():
    runs = [
        tta.Run("flush", 1, [(10, 6.0), (20, 5.0)], tokens=[100, 200]),
        tta.Run("paci", 1, [(10, 6.0), (20, 5.5)], tokens=[150, 300]),
        tta.Run("flush", 2, [(10, 6.0), (20, 4.0)], tokens=[100, 200]),
        tta.Run("paci", 2, [(10, 6.0), (20, 4.4)], tokens=[150, 300]),
    ]
    table = tta.iteration_table(runs, [5.5])
    assert table["flush"]["5.5 tokens"]["max"] == pytest.approx(150.0)
    assert table["paci"]["5.5 tokens"]["max"] == pytest.approx(300.0)
    gaps = tta.paired_gaps(runs, "paci", "flush")
    assert [gaps[k] for k in ("min", "max")] == pytest.approx([0.1, 0.1])
    assert tta.paired_gaps(runs, "paci", "missing") is None


def test_a_value_with_commas_is_written_with_semicolons():
    config = tta.parse_configuration("a=paci:1e-3:--paci-accumulation-schedule=8:100;6:50")
    assert config.flags == ("--paci-accumulation-schedule", "8:100,6:50")
    args = config.args(iterations=400, eval_interval=50, seed=1, model="small", eval_iters=8,
                       warmup_iters=40)  # fmt: skip
    assert args[args.index("--lr-warmup-iters") + 1] == "40"
    assert "runs/data_v1k/stdlib_text_document" in args


def test_long_horizon_table_pairs_each_configuration_with_its_reference():
    runs = [
        tta.Run("flush", 1, [(10, 6.0), (20, 5.0)], tokens=[100, 200]),
        tta.Run("paci", 1, [(10, 6.0), (20, 5.5)], tokens=[150, 300]),
    ]
    text = tta.long_horizon_markdown(runs, [5.5], {"paci": "flush"})
    paci = next(line for line in text.splitlines() if line.startswith("| paci"))
    assert "+10.00% [+10.00, +10.00] vs flush" in paci
    assert paci.endswith("| 20 [20, 20] | 0.00 [0.00, 0.00] |")


CALIBRATION = os.path.join(REPO, "docs", "calibration", "cpu_demo.json")


def _small_flags(schedule: str, *extra: str) -> list[str]:
    return tta.Configuration("x", schedule, 1e-3, extra).args(
        20, 5, 1, model="small", eval_iters=2, warmup_iters=2)  # fmt: skip


def test_projected_time_simulates_each_segment_between_drain_points():
    """Flush: every step empties the pipeline, so 5 steps take 5 one-step times; PACI: each
    segment between evaluations is one simulated fill-run-drain, and a change of a is one
    more drain point."""
    seconds = tta._segment_seconds
    flush = tta.simulated_times(_small_flags("1f1b"), CALIBRATION)
    one = seconds("1f1b", 4, 4, 1, CALIBRATION, 4)
    assert list(flush) == [5, 10, 15, 20]
    assert flush[20] == pytest.approx(20 * one) and flush[5] == pytest.approx(5 * one)
    paci = tta.simulated_times(_small_flags("paci"), CALIBRATION)
    assert paci[20] == pytest.approx(4 * seconds("paci", 4, 4, 5, CALIBRATION, 4))
    assert paci[20] < flush[20]  # no bubble in a segment's steady state
    phased = tta.simulated_times(
        _small_flags("paci", "--paci-accumulation-schedule", "8:3"), CALIBRATION)  # fmt: skip
    assert list(phased) == [3, 5, 10, 15, 20]  # a = 8 until 3, then a = 4
    assert phased[5] == pytest.approx(seconds("paci", 4, 8, 3, CALIBRATION, 4)
                                      + seconds("paci", 4, 4, 2, CALIBRATION, 4))  # fmt: skip
    run = tta.Run("x", 1, [(5, 6.0), (10, 5.0), (15, 4.5), (20, 4.0)], args=_small_flags("paci"))
    assert tta.by_projected_time(run, CALIBRATION)[1] == (paci[10], 5.0)


def test_projected_time_table_pairs_the_speed_up_by_seed():
    flush = tta.Run("flush", 1, [(5, 6.0), (10, 5.0), (15, 4.5), (20, 4.0)],
                    args=_small_flags("1f1b"))  # fmt: skip
    paci = tta.Run("paci", 1, [(5, 6.0), (10, 5.0), (15, 4.5), (20, 4.2)],
                   args=_small_flags("paci"))  # fmt: skip
    text = tta.projected_time_markdown([flush, paci], [5.0, 4.0], {"paci": "flush"}, CALIBRATION)
    flush_s = tta.simulated_times(flush.args, CALIBRATION)[10]
    paci_s = tta.simulated_times(paci.args, CALIBRATION)[10]
    row = text.splitlines()[-1]
    assert row.startswith(f"| paci | 1 | {paci_s:.0f} [{paci_s:.0f}, {paci_s:.0f}] | not reached")
    assert f"{flush_s / paci_s:.2f}x" in row and row.endswith("| not reached |")


def test_the_moe_study_model_is_the_small_model_with_experts_of_equal_active_width():
    """Each token's top-k experts together are as wide as the dense model's FFN, and the flags
    pass the engine's validation (mock data standing in for the study's corpus)."""
    from megatron.studies.single_process_engine import parse_engine_args

    config = tta.parse_configuration("x=paci:1e-3:--optimizer=muon")
    flags = config.args(iterations=400, eval_interval=50, seed=1, model="small-moe",
                        eval_iters=8, warmup_iters=40)  # fmt: skip
    assert flags[: len(tta.SMALL_MODEL)] == tta.SMALL_MODEL
    skip = {"--data-path", "--data-cache-path", "--tokenizer-model", "--tokenizer-type"}
    args = parse_engine_args(
        [f for f, prev in zip(flags, [None] + flags) if f not in skip and prev not in skip]
        + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    )
    assert args.num_experts == 8 and args.moe_router_topk == 2
    assert args.moe_ffn_hidden_size * args.moe_router_topk == args.ffn_hidden_size
    assert args.pipeline_schedule == "paci" and args.optimizer == "muon"


def test_the_deep_model_is_the_small_model_four_times_deeper_and_eight_times_larger():
    """16 layers of width 112 against 4 of 64; its parameters by the GPT's closed form (per
    layer 12h^2 + 13h; the 1,024-token embedding, its 32 positions and the untied output
    layer; the final norm): 2,664,928, 8.0x the small model's 333,184 (the counts of the
    built models)."""

    def value(flags, name):
        return int(flags[flags.index(name) + 1])

    parameters = tta.parameter_count
    small, deep = tta.MODELS["small"], tta.MODELS["deep-8x"]
    assert value(deep, "--num-layers") == 4 * value(small, "--num-layers") == 16
    assert value(deep, "--hidden-size") == 112
    assert (parameters(small), parameters(deep)) == (333_184, 2_664_928)
    assert parameters(tta.MODELS["small-4x"]) == 1_302_624  # as built, too
    assert round(parameters(deep) / parameters(small), 1) == 8.0
    apart = {"--num-layers", "--hidden-size", "--ffn-hidden-size"}
    rest = [(f, v) for f, v in zip(small, small[1:] + [None]) if f.startswith("--")]
    assert [(f, v) for f, v in rest if f not in apart] == [
        (f, v) for f, v in zip(deep, deep[1:] + [None]) if f.startswith("--") and f not in apart
    ]


def test_the_small_models_data_missing_is_one_line(tmp_path):
    """A fresh clone: the study command of docs/convergence.md before `make data-small` ends in
    one line naming the target, not a traceback."""
    import subprocess
    import sys

    tool = os.path.join(REPO, "tools", "time_to_accuracy.py")
    completed = subprocess.run(
        [sys.executable, tool, "--engine", "single-process", "--model", "small",
         "--config", "paci=paci:1e-3", "--seeds", "1", "--output", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1] == (
        "error: --model small reads runs/data_v1k/stdlib_text_document, which is not built: "
        "run `make data-small` first"
    )
    assert "Traceback" not in completed.stderr


def test_a_checkpoint_of_other_flags_is_refused_by_name(tmp_path):
    """A study's run directory holding another run's checkpoint (its flags changed since) is
    not resumed: the error names the flags that differ."""
    import argparse

    import torch

    from megatron.common.errors import UserError
    from megatron.studies import single_process_engine as engine

    path = str(tmp_path / "checkpoint.pt")
    saved = argparse.Namespace(lr=3e-3, seed=1, train_iters=2000, data_path=["runs/x"])
    torch.save({"flags": engine._run_flags(saved)}, path)
    assert engine._read_checkpoint(path, saved)["flags"]["lr"] == 3e-3
    assert engine._read_checkpoint(str(tmp_path / "none.pt"), saved) is None
    changed = argparse.Namespace(**{**vars(saved), "lr": 1.5e-3, "seed": 2})
    with pytest.raises(UserError, match=r"flags that differ: lr, seed\)"):
        engine._read_checkpoint(path, changed)
    # --exit-interval stops and resumes a run without changing its numbers: not a difference
    stopped = argparse.Namespace(**{**vars(saved), "exit_interval": 4000})
    assert engine._read_checkpoint(path, stopped)["flags"]["lr"] == 3e-3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exit-interval", "0"], "--exit-interval needs a value >= 1 and no --report"),
        (["--exit-interval", "8", "--report"], "--exit-interval needs a value >= 1 and no --report"),
        (["--engine", "torchrun", "--exit-interval", "8"], "need --engine single-process"),
    ],
)  # fmt: skip
def test_the_tools_exit_interval_is_checked(extra, message, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tta_tool", os.path.join(REPO, "tools", "time_to_accuracy.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit):
        tool.parse_args(["--config", "paci=paci:1e-3", "--engine", "single-process", *extra])
    assert message in capsys.readouterr().err


def test_a_checkpoint_from_before_a_new_flag_is_resumed(tmp_path):
    """A flag added to the project after a study's checkpoint was written is at its default
    there: the run goes on (at another value it is a flag that differs)."""
    import argparse

    import torch

    from megatron.common.errors import UserError
    from megatron.studies import single_process_engine as engine

    path = str(tmp_path / "checkpoint.pt")
    torch.save({"flags": engine._run_flags(argparse.Namespace(lr=3e-3))}, path)
    now = argparse.Namespace(lr=3e-3, async_error_feedback_stretch=False)
    assert engine._read_checkpoint(path, now)["flags"] == {"lr": 3e-3}
    with pytest.raises(UserError, match=r"flags that differ: async_error_feedback_stretch\)"):
        engine._read_checkpoint(
            path, argparse.Namespace(lr=3e-3, async_error_feedback_stretch=True)
        )


def test_a_study_run_that_stashes_weights_trains_without_a_checkpoint(tmp_path, monkeypatch):
    """The engine cannot checkpoint the schedules that keep weight versions (PACI with
    --paci-weight-stashing): a study runs them without one (a stopped run starts over) and
    says so, and gives the other runs their checkpoint file."""
    from megatron.studies import single_process_engine as engine
    from megatron.studies import time_to_accuracy as study

    given = {}

    def recording_train(args, *, checkpoint=None, log=None):
        given[args.paci_weight_stashing] = checkpoint
        return engine.EngineRun(stopped_at=4)  # stopped: no summary to write

    monkeypatch.setattr(engine, "train", recording_train)
    lines = []
    configurations = [study.parse_configuration("plain=paci:1e-3"),
                      study.parse_configuration("stashed=paci:1e-3:--paci-weight-stashing")]  # fmt: skip
    study.run_all_single_process(configurations, [1], str(tmp_path), log=lines.append,
                                 iterations=40, eval_interval=20)  # fmt: skip
    assert given[False] == str(tmp_path / "plain-seed1" / "checkpoint.pt")
    assert given[True] is None
    assert "stashed seed 1: no checkpoint (the schedule stashes weights)" in lines
    assert not any(line.startswith("plain seed 1: no checkpoint") for line in lines)
