"""Real-compute schedule benchmark: the real GPT model on 2 pipeline stages, flush vs PACI.

`tools/real_compute_benchmark.py` is its command line. One torchrun launch (gloo, one process
per stage, ``OMP_NUM_THREADS=1``: one thread each, local rank r pinned to core r)
runs every case one after another in the same process group (the ~8 s import is paid once):
for each m and each pair, 1F1B-flush and PACI back to back, the pair's order alternating, so
both schedules see the same machine. Each case writes its Chrome trace; its throughput is the
steady-state throughput of that trace (`results.steady_state_throughput`: start-up and final
drain left out). Reported per m: PACI/flush min / median / max over the pairs against the
closed form (m + N - 1) / m, which assumes equal stages.

Balancing: the last stage also carries the output layer and the loss. A calibration case (PACI,
the even split) measures each stage's mean forward + backward per microbatch; with the first
stage's cost per layer c = t0 / L0 (the embedding lookup is negligible) the output layer costs
h = t1 - L1 * c, and `balanced_last_layers` proposes the `--decoder-last-pipeline-num-layers`
that minimizes the larger stage: max((L - k) c, k c + h). The benchmark then repeats with it.
"""

import json
import math
import os
import statistics

from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.simulation.results import by_stage, steady_state_throughput
from megatron.pipeline.trace import read_chrome_trace

from .emulated_benchmark import PRETRAIN_SCRIPT, launch, torchrun_command
from .runtime_comparison import VOCAB_SUFFIX

NUM_STAGES = 2


def model_args(options) -> list[str]:
    """The GPT shape and data of every case (real data: the repository's built corpus)."""
    return [
        "--num-layers",
        str(options.num_layers),
        "--hidden-size",
        str(options.hidden_size),
        "--num-attention-heads",
        str(options.num_attention_heads),
        "--seq-length",
        str(options.seq_length),
        "--micro-batch-size",
        str(options.micro_batch_size),
        "--pipeline-model-parallel-size",
        str(NUM_STAGES),
        "--data-path",
        options.data_path,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        options.tokenizer_model,
        "--distributed-backend",
        "gloo",
        "--lr",
        "3e-4",
        "--eval-iters",
        "0",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--untie-embeddings-and-output-weights",  # PACI with two stages refuses tying
        # a speed benchmark: glibc's own malloc (the fixed mmap threshold that makes the
        # resident set follow live memory costs a page fault per page, host_memory.py)
        "--cpu-mmap-threshold-kib",
        "0",
    ]


VOCAB_SPLIT = VOCAB_SUFFIX  # a case's schedule with the output layer split over the ranks


def case(name: str, schedule: str, m: int, options, output: str, last_layers=None) -> dict:
    """One run: `steps` iterations of m microbatches, its trace and summary under `output`;
    `schedule` "paci+vocab" runs PACI with --enable-vocab-parallel."""
    steps = max(options.microbatches_per_run // m, 4)
    run_dir = os.path.join(output, name)
    split = schedule.endswith(VOCAB_SPLIT)
    args = (
        model_args(options)
        + (["--enable-vocab-parallel"] if split else [])
        + [
            "--pipeline-schedule",
            schedule.removesuffix(VOCAB_SPLIT),
            "--global-batch-size",
            str(m * options.micro_batch_size),
            "--train-iters",
            str(steps),
            "--log-interval",
            str(steps),
            "--timeline-file",
            os.path.join(run_dir, "timeline.json"),
        ]
    )
    if last_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(last_layers)]
    return {
        "name": name,
        "args": args,
        "metrics_dir": run_dir,
        "m": m,
        "steps": steps,
        "schedule": schedule,
    }


def benchmark_cases(options, output: str, last_layers=None, pair=("1f1b", "paci")) -> list[dict]:
    """The `pair` of schedules (flush and PACI; or PACI whole and split) per pair and m, the
    order alternating between pairs."""
    cases = []
    tag = "even" if last_layers is None else f"last{last_layers}"
    for m in options.microbatches:
        for index in range(options.pairs):
            order = pair if index % 2 == 0 else pair[::-1]
            for schedule in order:
                name = f"{tag}-m{m}-pair{index}-{schedule}"
                cases.append(case(name, schedule, m, options, output, last_layers))
    return cases


def run_cases(cases: list[dict], output: str, label: str, timeout_s: float, pin=True) -> None:
    """All `cases` in one torchrun launch of the case runner, after an unmeasured copy of the
    first (the first run of a process pays one-time costs: allocator, data loader, caches)."""
    spec = os.path.join(output, f"{label}-cases.json")
    warmup = {**cases[0], "name": "warmup", "metrics_dir": os.path.join(output, f"{label}-warmup")}
    with open(spec, "w") as f:
        json.dump([warmup, *cases], f)
    runner = os.path.join(os.path.dirname(PRETRAIN_SCRIPT), "tools", "run_pretrain_cases.py")
    command = torchrun_command(NUM_STAGES, runner, [spec] + (["--pin-cores"] if pin else []))
    launch(command, os.path.join(output, f"{label}-log.txt"), timeout_s)


def throughput(case_: dict) -> float:
    events = read_chrome_trace(os.path.join(case_["metrics_dir"], "timeline.json"))
    return steady_state_throughput(events, NUM_STAGES, case_["m"], case_["steps"])


def stage_costs(case_: dict) -> list[float]:
    """Per stage, mean forward + mean backward seconds per microbatch in the case's trace."""
    events = read_chrome_trace(os.path.join(case_["metrics_dir"], "timeline.json"))
    costs = []
    for stage, stage_events in sorted(by_stage(events).items()):
        means = [
            statistics.fmean(e.duration_s for e in stage_events if e.action.kind is kind)
            for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
        ]
        costs.append(sum(means))
    return costs


def balanced_last_layers(costs: list[float], first_layers: int, last_layers: int) -> dict:
    """The last stage's layer count that best balances the two stages (see the docstring)."""
    per_layer = costs[0] / first_layers
    head = max(0.0, costs[1] - last_layers * per_layer)
    total = first_layers + last_layers

    def larger(k: int) -> float:
        return max((total - k) * per_layer, k * per_layer + head)

    best = min(range(1, total), key=larger)
    return {
        "stage_costs_ms": [round(1000.0 * c, 3) for c in costs],
        "per_layer_ms": round(1000.0 * per_layer, 3),
        "output_layer_ms": round(1000.0 * head, 3),
        "proposed_last_layers": best,
        "predicted_stage_ms": [
            round(1000.0 * (total - best) * per_layer, 3),
            round(1000.0 * (best * per_layer + head), 3),
        ],
    }


def ratios(cases: list[dict], microbatches, pair=("1f1b", "paci")) -> dict:
    """Per m: every pair's throughput ratio (second over first schedule of `pair`), its
    min/median/max; for flush and PACI also the closed form."""
    by_key = {(c["m"], c["name"].rsplit("-", 1)[0], c["schedule"]): throughput(c) for c in cases}
    first, second = pair
    report = {}
    for m in microbatches:
        pairs = sorted({key for (mm, key, _) in by_key if mm == m})
        values = [by_key[(m, p, second)] / by_key[(m, p, first)] for p in pairs]
        report[m] = {
            "ratios": values,
            "min": min(values),
            "median": statistics.median(values),
            "max": max(values),
            f"{first}_throughput_median": statistics.median(by_key[(m, p, first)] for p in pairs),
            f"{second}_throughput_median": statistics.median(by_key[(m, p, second)] for p in pairs),
        }
        if pair == ("1f1b", "paci"):
            closed = (m + NUM_STAGES - 1) / m
            report[m]["closed_form"] = closed
            report[m]["median_over_closed_form"] = statistics.median(values) / closed
    return report


def even_split(num_layers: int) -> tuple[int, int]:
    return math.ceil(num_layers / 2), num_layers // 2


def per_rank_memory(case_: dict) -> list[dict]:
    """Per rank of a case: parameter bytes and the peak resident set during training
    (summary.json's stage reports)."""
    with open(os.path.join(case_["metrics_dir"], "summary.json")) as f:
        stages = json.load(f)["stages"]
    return [
        {
            "stage": stage["stage"],
            "param_bytes": stage["param_bytes"],
            "peak_rss_bytes": stage.get("peak_rss_bytes"),
            "peak_activation_bytes": stage["peak_activation_bytes"],
        }
        for stage in stages
    ]
