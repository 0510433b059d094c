"""Every pipeline schedule side by side on one model: the figures a user chooses from.

For a model (layers, hidden, FFN, sequence, vocabulary), N ranks and a microbatch count m, each
schedule runs in the event engine on per-virtual-stage costs from the projection's FLOP model
(`projection.layer_flops`, `output_flops`: per layer forward, input-gradient and weight-gradient
FLOPs; the output layer and loss on the last virtual stage), and reports:

* **pace**: the physical limit over the steady-state step time. The physical limit is the total
  compute of a step divided by N (no bubble, a perfect split); the step time is measured as
  (makespan of 2K steps - makespan of K steps) / K, so fill and drain cancel for every schedule
  alike. The simulator puts no barrier between steps, so a flushing schedule whose step ends
  in a staircase (ZB-V) starts the next step inside it: its pace is that of overlapped steps,
  above what one flushed step with a barrier after it gives. Communication and the optimizer
  step are left out (zero cost): the comparison is of the schedules' idle time, which is what
  differs between them;
* **peak activations** per rank, in units of one whole-stage microbatch (a chunk of a v-chunk
  model holds 1/v of it; 1F1B's first stage holds N);
* **weight copies** per rank (1 + the schedule's extra versions: stashing, double buffering);
* **drift**: the most optimizer steps a stage takes between a microbatch's forward and its
  backward (PACI; 0 for the flush schedules), and the **staleness** of the gradient applied
  (steps between the weights a gradient was computed on and those it updates: 2BW, PipeDream).

Costs are relative (FLOPs over a constant rate): the figures are ratios and do not depend on
the hardware. They are projections of the schedules on the model, not measurements.
"""

import math
from dataclasses import dataclass

from megatron.pipeline.schedules import SIMULATED_SCHEDULES
from megatron.pipeline.schedules.vocab_passes import cannot_take, splits_input, with_vocab_passes
from megatron.pipeline.simulation.engine import simulate

from .projection import Shape, layer_flops, output_flops


@dataclass(frozen=True)
class Model:
    name: str
    shape: Shape
    ranks: int
    micro_batch_size: int
    interleaved_chunks: int  # v of interleaved 1F1B (Megatron's VP)
    note: str = ""
    # --enable-vocab-parallel: the output layer and loss split evenly over the ranks. Schedules
    # that place the vocabulary passes (`schedules.vocab_passes`) run them as actions; the
    # others (virtual stages, weight stashing) get each rank's share added to its chunks, as
    # if placed without a bubble (an assumption, marked in the table)
    vocab_parallel: bool = False


MODELS = {
    # The PACI paper's setting: GPT-2 Medium on 8 stages; VP 3 puts one layer in each chunk.
    "gpt2-medium": Model("GPT-2 Medium, PP 8", Shape(24, 1024, 4096, 1024, 50304), 8, 4, 3),
    # Megatron-LM's 70B setting: TP 4 x PP 8 x VP 5, two layers per chunk. Grouped-query
    # attention is counted as full attention (a few % of the layer's FLOPs, the same on every
    # stage); TP divides every stage's work alike, so it leaves the ratios unchanged.
    "llama-70b": Model(
        "Llama-style 70B, TP 4 x PP 8 x VP 5",
        Shape(80, 8192, 28672, 4096, 128256),
        8,
        1,
        5,
        "grouped-query attention counted as full attention",
    ),
}

# (schedule, chunks per rank or None for the model's interleaved v); PACI steps every m.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", None),
    ("zb-h1", 1),
    ("zb-v", 2),
    ("dualpipe-v", 2),
    ("zb-interleaved", 2),  # its default v: what --pipeline-schedule zb-interleaved runs
    ("2bw", 1),
    ("pipedream", 1),
    ("paci", 1),
    ("paci-interleaved", None),
]


@dataclass
class Row:
    schedule: str
    chunks_per_rank: int
    microbatches: int
    pace: float | None  # physical limit / step time
    peak_activations: float | None  # whole-stage microbatches, worst rank
    weight_copies: int | None
    drift: int | None
    staleness: int | None
    note: str = ""


def rank_layer_totals(num_layers: int, ranks: int, output_layers: float, output_rank: int):
    """Layers per rank so that the ranks' loads (the output layer and loss counted as
    `output_layers` layers on `output_rank`) are as even as whole layers allow: what a user
    sets with Megatron's layout flags. The output rank takes what is left of the mean load
    after the output layer, the others share the rest evenly."""
    mean = (num_layers + output_layers) / ranks
    on_output_rank = max(0, min(num_layers, round(mean - output_layers)))
    base, extra = divmod(num_layers - on_output_rank, ranks - 1) if ranks > 1 else (0, 0)
    others = [base + (k < extra) for k in range(ranks - 1)]
    totals = others[:output_rank] + [on_output_rank] + others[output_rank:]
    return totals if ranks > 1 else [num_layers]


def layers_per_virtual_stage(model: "Model", chunks: int, shape: str) -> list[int]:
    """Layers of each virtual stage: the balanced per-rank totals (`rank_layer_totals`), each
    rank's spread evenly over its chunks (the remainder on the earlier ones, so the chunk with
    the output layer, last on its rank, gets the fewest)."""
    from megatron.pipeline.schedules.placement import Placement

    placement = Placement("v" if shape == "v" else "interleaved", model.ranks, chunks)
    output_rank, _ = placement.locate(placement.num_virtual_stages - 1)
    lf = layer_flops(model.shape, model.micro_batch_size)
    of = output_flops(model.shape, model.micro_batch_size)
    output_layers = 0.0 if model.vocab_parallel else sum(of) / sum(lf)
    totals = rank_layer_totals(model.shape.num_layers, model.ranks, output_layers, output_rank)
    layers = [0] * placement.num_virtual_stages
    for rank, total in enumerate(totals):
        base, extra = divmod(total, chunks)
        for chunk in range(chunks):
            layers[placement.virtual_stage(rank, chunk)] = base + (chunk < extra)
    return layers


def virtual_stage_costs(
    model: Model, chunks: int, shape: str, *, vocab_passes: bool = False
) -> tuple[list, list, list]:
    """(forward, input-gradient, weight-gradient) cost per virtual stage, relative units. With
    `vocab_passes` the output layer is in no stage's costs (`vocab_pass_costs` has them)."""
    layers = layers_per_virtual_stage(model, chunks, shape)
    lf, lb, lw = layer_flops(model.shape, model.micro_batch_size)
    of, ob, ow = output_flops(model.shape, model.micro_batch_size)
    unit = lf  # one layer's forward = 1
    forward = [n * lf / unit for n in layers]
    backward = [n * lb / unit for n in layers]
    wgrad = [n * lw / unit for n in layers]
    if vocab_passes:
        return forward, backward, wgrad
    for costs, extra in ((forward, of), (backward, ob), (wgrad, ow)):
        if model.vocab_parallel:  # every virtual stage its share
            for index in range(len(costs)):
                costs[index] += extra / unit / len(costs)
        else:
            costs[-1] += extra / unit  # the last virtual stage: output layer and loss
    return forward, backward, wgrad


def vocab_pass_costs(model: Model) -> tuple[float, float]:
    """(VF, VB) of one rank's output shard, relative units: VF scores the shard (the logits'
    forward and the shard's part of the hidden state's gradient), VB its weight gradient."""
    lf, _, _ = layer_flops(model.shape, model.micro_batch_size)
    of, ob, ow = output_flops(model.shape, model.micro_batch_size)
    return (of + ob) / lf / model.ranks, ow / lf / model.ranks


def _steps_for(ranks: int, m: int) -> int:
    return max(3, math.ceil(4 * ranks / m))


def compare(model: Model, schedule: str, chunks: int | None, m: int) -> Row:
    definition = SIMULATED_SCHEDULES[schedule]
    chunks = model.interleaved_chunks if chunks is None else chunks
    placed = definition.placement is not None
    shape = definition.placement(model.ranks, chunks).shape if placed else "interleaved"
    passes = model.vocab_parallel and cannot_take(definition) is None
    forward, backward, wgrad = virtual_stage_costs(model, chunks, shape, vocab_passes=passes)
    if not definition.splits_backward:  # one backward pass: input and weight gradients
        backward, wgrad = [b + w for b, w in zip(backward, wgrad)], [0.0] * len(wgrad)
    vocab = vocab_pass_costs(model) if passes else (0.0, 0.0)
    if passes:  # the input embedding's passes too, where the runtime splits it (no cost here)
        definition = with_vocab_passes(definition, splits_input(definition))
    k = _steps_for(model.ranks, m)
    runs = []
    try:
        for steps in (k, 2 * k):
            runs.append(
                simulate(
                    definition,
                    num_stages=model.ranks,
                    microbatches_per_step=m,
                    steps=steps,
                    forward_cost=forward,
                    backward_cost=backward,
                    weight_grad_cost=wgrad,
                    record_timeline=False,
                    chunks_per_rank=chunks if definition.placement is not None else None,
                    vocab_forward_cost=vocab[0],
                    vocab_backward_cost=vocab[1],
                )
            )
    except ValueError as error:  # the schedule's own rule on m (interleaving, DualPipeV)
        return Row(schedule, chunks, m, None, None, None, None, None, str(error).split(";")[0])
    step_time = (runs[1].makespan - runs[0].makespan) / k
    work = sum(forward) + sum(backward) + sum(wgrad) + model.ranks * sum(vocab)
    limit = m * work / model.ranks
    result = runs[1]
    peak = max(result.peak_inflight_per_stage) / chunks
    copies = 1 + max(definition.extra_weight_versions(s, model.ranks) for s in range(model.ranks))
    return Row(
        schedule,
        chunks,
        m,
        limit / step_time,
        peak,
        copies,
        max(result.max_drift_per_stage),
        max(result.max_gradient_delay_per_stage),
        "" if passes or not model.vocab_parallel else "vocabulary share added to the chunks",
    )


def table(model: Model, microbatch_counts: list[int]) -> list[Row]:
    return [
        compare(model, name, chunks, m) for m in microbatch_counts for name, chunks in SCHEDULES
    ]


def markdown(model: Model, rows: list[Row]) -> str:
    vocabulary = "; vocabulary split over the ranks" if model.vocab_parallel else ""
    lines = [
        f"**{model.name}** ({model.shape.num_layers} layers, hidden {model.shape.hidden}, "
        f"micro batch {model.micro_batch_size} x {model.shape.seq} tokens"
        + (f"; {model.note}" if model.note else "")
        + vocabulary
        + ")",
        "",
        "| m | schedule | chunks/rank | pace (of the physical limit) | peak activations "
        "(stage-microbatches) | weight copies | drift | staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.pace is None:
            lines.append(
                f"| {row.microbatches} | {row.schedule} | {row.chunks_per_rank} | "
                f"not defined: {row.note} | | | | |"
            )
            continue
        lines.append(
            f"| {row.microbatches} | {row.schedule}{' (' + row.note + ')' if row.note else ''} | "
            f"{row.chunks_per_rank} | {row.pace:.3f} | "
            f"{row.peak_activations:g} | {row.weight_copies} | {row.drift} | {row.staleness} |"
        )
    return "\n".join(lines)
