"""The vocabulary split's messages over emulated per-rank links: the output layer's tree
against the fan, measured with emulated compute and replayed by the simulator.

`tools/benchmark_vocab_links.py` is its command line. Each (schedule, arity) runs
`pretrain_gpt.py` through torchrun (gloo, one process per rank) with stages that sleep
(`--emulated-*`), `--enable-vocab-parallel`, `--vocab-parallel-tree-arity` and every rank's
sends paced by `--emulated-link-gbs` / `--emulated-link-latency-us` (`p2p.PacedLink`). The
simulator then replays each run: the pass durations its trace measured, and the same link
model (`links.per_rank_link_communication`: one outbound link per rank, each message latency
+ bytes / bandwidth behind the rank's earlier ones, the same tree). Both timelines are read by
the same `steady_pace`. Prints one JSON object, also written to OUTPUT/report.json.
"""

import json
import os
import tempfile

from megatron.pipeline.simulation import simulate
from megatron.pipeline.simulation.links import per_rank_link_communication
from megatron.pipeline.trace import read_chrome_trace
from megatron.pipeline.transport import vocab_message_sizes

from .emulated_benchmark import PRETRAIN_SCRIPT, emulated_run_args, launch, torchrun_command
from .runtime_comparison import _nominal_seconds, definition_of, measured_pass_costs, steady_pace

FP32_BYTES = 4


def message_bytes(options) -> dict[str, int]:
    """Bytes of each message kind of the run (fp32): the pipeline's activation, the output
    layer's and the input embedding's messages (unless they bypass the links)."""
    tokens = options.seq_length * options.micro_batch_size
    elements = vocab_message_sizes(tokens, options.hidden_size)
    elements["activation"] = tokens * options.hidden_size
    if not options.unpaced_embedding:
        elements.update(
            embed=tokens * options.hidden_size, embed_grad=tokens * options.hidden_size + 1
        )
    return {kind: FP32_BYTES * count for kind, count in elements.items()}


def arity_of(arity: str, stages: int) -> int:
    return stages - 1 if arity == "fan" else int(arity)


def run_args(schedule: str, arity: str, options, run_dir: str) -> list[str]:
    extra = [
        "--enable-vocab-parallel", "--vocab-parallel-tree-arity", arity,
        "--emulated-vocab-forward-ms", str(options.vocab_fwd_ms),
        "--emulated-vocab-backward-ms", str(options.vocab_bwd_ms),
        "--emulated-link-gbs", str(options.link_gbs),
        "--emulated-link-latency-us", str(options.link_latency_us),
        "--hidden-size", str(options.hidden_size), "--seq-length", str(options.seq_length),
        "--micro-batch-size", str(options.micro_batch_size),
        "--global-batch-size", str(options.microbatches * options.micro_batch_size),
    ]  # fmt: skip
    if options.unpaced_embedding:
        extra.append("--emulated-link-unpaced-embedding")
    return emulated_run_args(
        schedule=schedule, stages=options.stages, microbatches=options.microbatches,
        fwd_ms=options.fwd_ms, bwd_ms=options.bwd_ms, steps=options.steps, metrics_dir=run_dir,
        timeline_file=os.path.join(run_dir, "timeline.json"), extra=extra,
    )  # fmt: skip


def replayed_pace(schedule: str, arity: str, options, events) -> float:
    """The simulator on the run's measured passes and the same links: microbatches/s."""
    n, m = options.stages, options.microbatches
    definition = definition_of(f"{schedule}+vocab")
    costs_ms = {"forward": [options.fwd_ms] * n, "backward": [options.bwd_ms] * n,
                "vocab_forward": options.vocab_fwd_ms, "vocab_backward": options.vocab_bwd_ms}  # fmt: skip
    nominal = _nominal_seconds(costs_ms, False, n, definition.embedding_passes)
    costs = measured_pass_costs(events, None, n, nominal)
    costs.pop("weight_grad_cost", None)
    communication = per_rank_link_communication(
        n, options.link_gbs, options.link_latency_us / 1e6, message_bytes(options),
        vocab_tree_arity=arity_of(arity, n), base_latency_s=options.base_latency_ms / 1e3,
    )  # fmt: skip
    result = simulate(definition, num_stages=n, microbatches_per_step=m, steps=options.steps,
                      communication=communication, record_timeline=True, **costs)  # fmt: skip
    return steady_pace(result.timeline, m, options.steps)


def run_one(schedule: str, arity: str, options, workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"{schedule}-{arity}")
    os.makedirs(run_dir, exist_ok=True)
    launch(torchrun_command(options.stages, PRETRAIN_SCRIPT, run_args(schedule, arity, options, run_dir)),
           os.path.join(run_dir, "log.txt"), options.timeout)  # fmt: skip
    events = read_chrome_trace(os.path.join(run_dir, "timeline.json"))
    measured = steady_pace(events, options.microbatches, options.steps)
    predicted = replayed_pace(schedule, arity, options, events)
    return {
        "schedule": schedule, "arity": arity,
        "measured_s_per_iteration": options.microbatches / measured,
        "predicted_s_per_iteration": options.microbatches / predicted,
        "error": measured / predicted - 1.0,  # = predicted s/iteration over measured - 1
        "run_dir": run_dir,
    }  # fmt: skip


def benchmark(options) -> dict:
    """Every schedule with every arity; one report."""
    workdir = options.output or tempfile.mkdtemp(prefix="vocab_links_")
    rows = [run_one(schedule, arity, options, workdir)
            for schedule in options.schedules for arity in options.arities]  # fmt: skip
    report = {"options": vars(options), "message_bytes": message_bytes(options), "rows": rows}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report
