"""The layer split that balances a pipeline: the fewest seconds on its slowest stage.

A bubble-free schedule (PACI, 2BW, PipeDream) runs at its slowest stage's pace per microbatch,
max_s (F_s + B_s + W_s + step_s / a); a flushed one takes sum_s t_s + (m - 1) max_s t_s per
step, and the sum does not depend on the split. So one split is best for both: the one whose
slowest stage is fastest. The first stage also holds the embedding, the last the output layer
and the loss; layers are contiguous. `balanced_split` finds the best split exactly, by dynamic
programming over (stage, layers placed so far).

With the vocabulary partitioned over the pipeline ranks (`--enable-vocab-parallel`,
`partition_vocabulary`), the output layer and the loss are no stage's own: each rank runs 1/N
of them and of the input embedding plus its messages (`LayerCosts.every_stage`), the last rank
also the output layer's exchange with every other rank, the first the input embedding's.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.pipeline.simulation.costs import StageCosts

if TYPE_CHECKING:
    from .projection import ProjectionOptions, Shape, VocabMessages


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per microbatch of each part, its optimizer step's share included (step / a):
    each transformer layer, the embedding (on the first stage), the output layer and loss (on
    the last), and the cost model's split of each into forward, backward and weight gradient."""

    layers: list[tuple[float, float, float, float]]  # (forward, backward, wgrad, step) each
    embedding: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    output: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    every_stage: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # vocabulary shards

    def stage_costs(self, split: list[int], p2p_latency: float | None = None) -> StageCosts:
        """The per-stage costs of `split` (layers per stage, contiguous, summing to all)."""
        if sum(split) != len(self.layers) or min(split) < 0:
            raise ValueError(f"split {split} does not place the {len(self.layers)} layers")
        per_stage, start = [], 0
        for s, count in enumerate(split):
            parts = self.layers[start : start + count]
            parts += [self.embedding] if s == 0 else []
            parts += [self.output] if s == len(split) - 1 else []
            parts += [self.every_stage]
            per_stage.append([sum(values) for values in zip((0.0,) * 4, *parts)])
            start += count
        return StageCosts(*[list(c) for c in zip(*per_stage)], p2p_latency=p2p_latency)


def pace(costs: StageCosts, microbatches_per_step: int) -> list[float]:
    """Each stage's seconds per microbatch in steady state: F + B + W + its step / a."""
    return [
        f + b + w + step / microbatches_per_step
        for f, b, w, step in zip(costs.forward, costs.backward, costs.weight_grad, costs.step)
    ]


def balanced_split(
    costs: LayerCosts, num_stages: int, microbatches_per_step: int, *, min_layers: int = 0
) -> list[int]:
    """Layers per stage minimizing the slowest stage's pace (ties: the first such split in
    the order the search meets them, which keeps earlier stages no heavier than needed)."""
    n_layers = len(costs.layers)
    if num_stages < 1 or n_layers < num_stages * min_layers:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} stages")
    a = microbatches_per_step

    def part(entry) -> float:  # one part's seconds per microbatch, its step's share included
        f, b, w, step = entry
        return f + b + w + step / a

    prefix = [0.0]
    for layer in costs.layers:
        prefix.append(prefix[-1] + part(layer))

    ends = {0: part(costs.embedding)}  # the first stage may also be the last
    ends[num_stages - 1] = ends.get(num_stages - 1, 0.0) + part(costs.output)
    shared = part(costs.every_stage)

    def block(stage: int, start: int, stop: int) -> float:
        return prefix[stop] - prefix[start] + ends.get(stage, 0.0) + shared

    # best[s][j]: the slowest of stages 0..s when they hold layers [0, j); choice: where s starts
    best = [[math.inf] * (n_layers + 1) for _ in range(num_stages)]
    start_of = [[0] * (n_layers + 1) for _ in range(num_stages)]
    for j in range(min_layers, n_layers + 1):
        best[0][j] = block(0, 0, j)
    for s in range(1, num_stages):
        for j in range(n_layers + 1):
            for i in range(j - min_layers, -1, -1):
                value = max(best[s - 1][i], block(s, i, j))
                if value < best[s][j]:
                    best[s][j], start_of[s][j] = value, i
    split, stop = [], n_layers
    for s in range(num_stages - 1, 0, -1):
        start = start_of[s][stop]
        split.append(stop - start)
        stop = start
    split.append(stop)
    return split[::-1]


def partition_vocabulary(
    costs: LayerCosts, num_stages: int, messages: "VocabMessages | None" = None
) -> LayerCosts:
    """`costs` with the output layer, the loss and the input embedding split evenly over the
    `num_stages` ranks by vocabulary, as the runtime's --enable-vocab-parallel: each stage runs
    1/N of their forward, backward, weight gradient and step, plus its messages
    (`projection.vocab_messages_s`); the last rank also the output layer's exchange with every
    other one, the first the input embedding's."""
    from .projection import VocabMessages

    messages = messages or VocabMessages()
    parts = zip(costs.output, costs.embedding)
    share = [(o + e) / num_stages for o, e in parts]
    share[0] += messages.every[0]
    share[1] += messages.every[1]
    first_extra = (messages.first[0], messages.first[1], 0.0, 0.0)
    last_extra = (messages.last[0], messages.last[1], 0.0, 0.0)
    return LayerCosts(costs.layers, first_extra, last_extra, tuple(share))


def arrangements(split: list[int]) -> list[list[int]]:
    """`split` and its reorderings with the same slowest stage: the middle stages hold no
    extras, so their counts may go in any order, but the order still matters to a pipeline
    (stage s holds up to N - s microbatches in flight): the caller simulates them."""
    if len(split) <= 2:
        return [split]
    first, middle, last = split[:1], split[1:-1], split[-1:]
    found = []
    for candidate in (middle, sorted(middle), sorted(middle, reverse=True)):
        if first + candidate + last not in found:
            found.append(first + candidate + last)
    return found


def layout_string(split: list[int]) -> str:
    """Megatron's --pipeline-model-parallel-layout for `split`: "Et*3|t*3|t*2L"."""

    def layers(count: int) -> str:
        return "" if count == 0 else ("t" if count == 1 else f"t*{count}")

    stages = [layers(count) for count in split]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def megatron_flags(split: list[int]) -> list[str]:
    """The shortest Megatron flags giving `split`: none (even), first/last counts (even in
    between), else the layout string."""
    n, total = len(split), sum(split)
    if n == 1 or (total % n == 0 and split == [total // n] * n):
        return []
    middle = split[1:-1]
    if n > 2 and len(set(middle)) == 1 and middle[0] > 0 and split[0] > 0 and split[-1] > 0:
        flags = []
        if split[0] != middle[0]:
            flags += ["--decoder-first-pipeline-num-layers", str(split[0])]
        if split[-1] != middle[0]:
            flags += ["--decoder-last-pipeline-num-layers", str(split[-1])]
        return flags
    if n == 2 and min(split) > 0:
        return ["--decoder-first-pipeline-num-layers", str(split[0])]
    return ["--pipeline-model-parallel-layout", layout_string(split)]


def layer_costs_from_calibration(data: dict, micro_batch_size: int | None) -> LayerCosts:
    """A calibration's per-layer profile (`layer` + `num_layers`, or `layers`) with its
    `embedding` and `output` entries; ValueError naming the field."""
    from .calibration_file import _cost_entry, _layer_costs, _select_profile

    profile, where = _select_profile(data, micro_batch_size)
    if "stages" in profile:
        raise ValueError(f"{where}: per-stage costs cannot be re-split; give per-layer costs")
    extras = {
        key: _cost_entry(profile[key], f"{where}.{key}") if key in profile else (0.0,) * 4
        for key in ("embedding", "output")
    }
    return LayerCosts(_layer_costs(profile, where), extras["embedding"], extras["output"])


def layer_costs_from_model(
    options: "ProjectionOptions", shape: "Shape", micro_batch_size: int, efficiency: float
) -> LayerCosts:
    """The projection's cost model per layer (projection.modelled_costs, split by layer)."""
    from .projection import layer_flops, output_flops

    rate = options.peak_tflops * 1e12 * efficiency
    per_param = options.optimizer_bytes_per_param / (options.memory_bandwidth_gbs * 1e9)
    layer = tuple(x / rate for x in layer_flops(shape, micro_batch_size))
    output = tuple(x / rate for x in output_flops(shape, micro_batch_size))
    return LayerCosts(
        [(*layer, shape.layer_params() * per_param)] * shape.num_layers,
        (0.0, 0.0, 0.0, shape.embedding_params() * per_param),
        (*output, shape.output_params() * per_param),
    )
