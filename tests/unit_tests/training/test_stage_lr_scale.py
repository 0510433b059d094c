"""--paci-stage-lr-scale C: each pipeline stage's LR (max and min of every param group) times
1 / (1 + C (N - 1 - s) / a), in the stages the single-process engine builds (the runtime's
`build_local_stage`; the 4-process runtime is checked against the engine in
tests/functional_tests/test_single_process_engine.py), and the flag's one-line mistakes."""

import pytest
import torch
from small_run_flags import BASE, validated

from megatron.common.errors import UserError
from megatron.training.config import RunConfig
from megatron.training.optimizer.build import stage_lr_scale

PACI4 = ["--pipeline-schedule", "paci", "--pipeline-model-parallel-size", "4", "--eval-iters",
         "0", "--untie-embeddings-and-output-weights"]  # fmt: skip


def formula(c: float, stage: int, stages: int, a: int) -> float:
    return 1.0 / (1.0 + c * (stages - 1 - stage) / a)


def test_the_factor_is_one_over_one_plus_c_times_the_mean_staleness():
    config = RunConfig.from_args(validated(PACI4 + ["--paci-stage-lr-scale", "2"], world_size=4))
    assert config.training.num_microbatches == 4  # a = 8 / 2
    scales = [stage_lr_scale(config.pipeline, config.training, s) for s in range(4)]
    assert scales == [1 / 2.5, 1 / 2, 1 / 1.5, 1.0]
    plain = RunConfig.from_args(validated(PACI4, world_size=4))
    assert [stage_lr_scale(plain.pipeline, plain.training, s) for s in range(4)] == [1.0] * 4


def _stage_lrs(flags: list[str], steps: int) -> list[list[tuple[float, float, float]]]:
    """(lr, max_lr or None, min_lr or None) of every param group of every stage the engine
    builds, after `steps` scheduler steps."""
    from megatron.model.build import stage_layout
    from megatron.studies.delayed_reference import build_local_stage, ensure_single_process_groups
    from megatron.studies.single_process_engine import parse_engine_args

    config = RunConfig.from_args(parse_engine_args(BASE + PACI4 + flags), vocab_size=128)
    ensure_single_process_groups()
    result = []
    for stage in range(4):
        layout = stage_layout(config)
        layout.pipeline_rank = stage
        _, step = build_local_stage(config, layout, torch.device("cpu"))
        for _ in range(steps):
            step.scheduler.step(increment=1)
        groups = step.optimizer.param_groups
        result.append([(g["lr"], g.get("max_lr"), g.get("min_lr")) for g in groups])
    return result


@pytest.mark.parametrize("optimizer", ["adam", "muon"])  # muon: per-group max_lr / min_lr
@pytest.mark.parametrize("steps", [1, 3, 4])  # warm-up, cosine decay, the floor (min LR)
def test_each_stages_lr_is_the_formula(optimizer, steps):
    schedule = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                "--optimizer", optimizer]  # fmt: skip
    plain = _stage_lrs(schedule, steps)
    scaled = _stage_lrs(schedule + ["--paci-stage-lr-scale", "1.5"], steps)
    for stage in range(4):
        factor = formula(1.5, stage, 4, 4)
        assert len(plain[stage]) == len(scaled[stage]) > 0
        for (lr, max_lr, min_lr), (lr_s, max_s, min_s) in zip(plain[stage], scaled[stage]):
            assert lr_s == pytest.approx(lr * factor, rel=1e-12)
            assert (max_s is None) == (max_lr is None)
            if max_lr is not None:
                assert max_s == pytest.approx(max_lr * factor, rel=1e-12)
                assert min_s == pytest.approx(min_lr * factor, rel=1e-12)
    if steps == 4:  # past the decay: every group sits at its own min LR
        assert scaled[0][0][0] == pytest.approx(1e-4 * formula(1.5, 0, 4, 4), rel=1e-9)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--paci-stage-lr-scale", "1"],
         "^--paci-stage-lr-scale is not supported yet with --pipeline-schedule 1f1b$"),
        (["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "4",
          "--untie-embeddings-and-output-weights", "--paci-stage-lr-scale", "1"],
         "^--paci-stage-lr-scale is not supported yet with --pipeline-schedule 2bw$"),
        (PACI4 + ["--paci-stage-lr-scale", "-1"], "must be finite and >= 0"),
        (PACI4 + ["--paci-stage-lr-scale", "1", "--paci-accumulation-schedule", "8:2"],
         "--paci-stage-lr-scale with --paci-accumulation-schedule is not supported yet"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line(extra, message):
    world = 4 if "--pipeline-model-parallel-size" in extra else 1
    with pytest.raises(UserError, match=message) as raised:
        validated(extra, world_size=world)
    assert "\n" not in str(raised.value)
