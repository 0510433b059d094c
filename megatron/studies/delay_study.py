"""The one-step-delay study: synchronous vs delayed training per optimizer, with and without
error feedback, plus momentum and LR sweeps, on `delayed_reference.run_delayed`.

A plan is a list of runs (`StudyRun`: optimizer, variant, seed, LR, momentum); each finished
run is appended to a JSON-lines file, so an interrupted study resumes where it stopped.
`delay_study_report.py` turns the file into tables (medians and ranges over seeds) and a plot. `tools/delay_study.py` is the command line.

Variants: `sync` (delay 0), `delayed` (delay 1, PipeDream-2BW's semantics), `delayed+ef`
(delay 1 with `--async-error-feedback`) and `sync+ef`, the control: the correction applied
without any delay, so that a gain of `delayed+ef` over `delayed` is not credited to delay
compensation when the correction also helps synchronous training.
"""

import json
import os
from dataclasses import asdict, dataclass

VARIANTS = {  # name: (delay, error feedback)
    "sync": (0, False),
    "delayed": (1, False),
    "delayed+ef": (1, True),
    "sync+ef": (0, True),
}
# Peak LR per optimizer (the LR sweep multiplies it by 1/3 and 3) and the first momentum
# coefficient with the two other values of the momentum sweep.
BASE_LR = {
    "adam": 1e-3,
    "sgd": 0.3,
    "muon": 1e-3,
    "lion": 3e-4,
    "adan": 1e-3,
    "soap": 1e-3,
    "mars": 1e-3,
}
MOMENTUM = {  # base, sweep values (one higher value: the sweep was sized down for 2 cores)
    "adam": (0.9, (0.95,)),
    "sgd": (0.9, (0.95,)),
    "muon": (0.9, (0.95,)),
    "lion": (0.9, (0.95,)),
    "adan": (0.98, (0.99,)),
    "soap": (0.95, (0.98,)),
    "mars": (0.95, (0.98,)),
}
LR_SWEEP = (3, 9, 1 / 3)  # multiples of the base LR
MODEL_FLAGS = (
    "--num-layers 2 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 8 "
    "--min-lr-ratio-placeholder --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 "
    "--clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --split 969,30,1 "
    "--tokenizer-type SentencePieceTokenizer --eval-interval 1000000 "
    # the settings the documented results ran with (before Megatron's defaults were followed)
    "--muon-coefficient-type simple --lion-beta2 0.99"
)


@dataclass(frozen=True)
class StudyRun:
    optimizer: str
    variant: str
    seed: int
    lr: float
    momentum: float
    purpose: str  # main | momentum | lr

    @property
    def key(self) -> str:
        return f"{self.purpose}/{self.optimizer}/{self.variant}/s{self.seed}/lr{self.lr:g}/m{self.momentum:g}"


def plan(optimizers, seeds, *, sweep_seed: int) -> list[StudyRun]:
    """Main comparison over `seeds`; momentum and LR sweeps (sync and delayed) on one seed,
    and error feedback at 3x the base LR."""
    runs = []
    for name in optimizers:
        lr, (momentum, others) = BASE_LR[name], MOMENTUM[name]
        for variant in VARIANTS:
            runs += [StudyRun(name, variant, seed, lr, momentum, "main") for seed in seeds]
        for variant in ("sync", "delayed"):
            runs += [StudyRun(name, variant, sweep_seed, lr, m, "momentum") for m in others]
            runs += [StudyRun(name, variant, sweep_seed, f * lr, momentum, "lr") for f in LR_SWEEP]
        for variant in ("delayed+ef", "sync+ef"):  # error feedback at a better LR too
            runs.append(StudyRun(name, variant, sweep_seed, 3 * lr, momentum, "lr"))
    return runs


def reference_flags(run: StudyRun, *, iterations: int, data_prefix: str, tokenizer: str,
                    data_cache: str, eval_iters: int) -> list[str]:  # fmt: skip
    model = MODEL_FLAGS.replace("--min-lr-ratio-placeholder", f"--min-lr {run.lr / 10:g}")
    flags = model.split() + [
        "--optimizer", run.optimizer, "--lr", f"{run.lr:g}", "--seed", str(run.seed),
        "--train-iters", str(iterations), "--lr-warmup-iters", str(max(1, iterations // 10)),
        "--data-path", data_prefix, "--tokenizer-model", tokenizer,
        "--data-cache-path", data_cache, "--eval-iters", str(eval_iters),
    ]  # fmt: skip
    if VARIANTS[run.variant][1]:
        flags.append("--async-error-feedback")
    return flags


def first_momentum_setting(optimizer: str) -> str:
    """The training setting the momentum sweep varies for `optimizer` (its first beta or
    momentum); optimizers without a flag of their own read `optimizer_beta1`."""
    setting = {"adam": "adam_beta1", "sgd": "sgd_momentum", "muon": "muon_momentum",
               "lion": "lion_beta1"}  # fmt: skip
    return setting.get(optimizer, "optimizer_beta1")


def execute(run: StudyRun, flags: list[str]) -> dict:
    from megatron.studies.delayed_reference import parse_reference_args, run_delayed

    megatron_args = parse_reference_args(flags)
    # set on the parsed namespace: not every optimizer's first momentum is a flag
    setattr(megatron_args, first_momentum_setting(megatron_args.optimizer), run.momentum)
    result = run_delayed(megatron_args, delay=VARIANTS[run.variant][0])
    tail = result.losses[-max(1, len(result.losses) // 10) :]
    return {
        **asdict(run),
        "key": run.key,
        "iterations": len(result.losses),
        "final_train_loss": sum(tail) / len(tail),
        "validation_loss": result.validation_loss,
        "losses": result.losses,
        "wall_s": result.wall_s,
    }


def load_results(path: str) -> dict[str, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return {row["key"]: row for row in map(json.loads, handle) if row}


def run_plan(runs: list[StudyRun], path: str, flags_for, log=print) -> dict[str, dict]:
    """Run what `path` does not hold yet, appending each result as it finishes."""
    done = load_results(path)
    for index, run in enumerate(runs):
        if run.key in done:
            continue
        row = execute(run, flags_for(run))
        with open(path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        done[run.key] = row
        log(f"[{index + 1}/{len(runs)}] {run.key}: validation {row['validation_loss']:.4f} "
            f"({row['wall_s']:.0f} s)")  # fmt: skip
    return done
