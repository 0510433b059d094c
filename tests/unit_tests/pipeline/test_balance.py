"""The balanced layer split: the exhaustive search's optimum, printed as flags that Megatron's
parser (ours) turns back into the same split."""

import itertools
import random

import pytest
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megatron.benchmarks.balance import (
    LayerCosts,
    arrangements,
    balanced_split,
    layer_costs_from_model,
    layout_string,
    megatron_flags,
    pace,
    partition_vocabulary,
)


def compositions(total: int, parts: int):
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def random_costs(rng: random.Random, layers: int) -> LayerCosts:
    entry = lambda scale: tuple(rng.uniform(0, scale) for _ in range(4))  # noqa: E731
    uniform = rng.random() < 0.5  # as a calibration's `layer` + `num_layers`
    per_layer = [entry(1.0)] * layers if uniform else [entry(1.0) for _ in range(layers)]
    return LayerCosts(per_layer, entry(2.0), entry(6.0))


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_the_exhaustive_searchs_optimum(seed):
    rng = random.Random(seed)
    layers, stages, a = rng.randint(2, 9), rng.randint(1, 5), rng.choice([1, 2, 4, 8])
    costs = random_costs(rng, layers)
    split = balanced_split(costs, stages, a)
    assert len(split) == stages and sum(split) == layers and min(split) >= 0
    slowest = max(pace(costs.stage_costs(split), a))
    best = min(max(pace(costs.stage_costs(c), a)) for c in compositions(layers, stages))
    assert slowest == pytest.approx(best, rel=1e-12)
    for other in arrangements(split):
        assert max(pace(costs.stage_costs(other), a)) == pytest.approx(slowest, rel=1e-12)


def test_a_heavy_output_layer_empties_the_last_stage():
    """GPT-2's 50k vocabulary: the output layer and loss (12 s) are worth four layers (3 s
    each), so the only best split of 12 layers on 4 stages leaves the last one none."""
    costs = LayerCosts([(1.0, 2.0, 0.0, 0.0)] * 12, (0.0,) * 4, (4.0, 8.0, 0.0, 0.0))
    assert balanced_split(costs, 4, 4) == [4, 4, 4, 0]
    assert megatron_flags([4, 4, 4, 0]) == ["--pipeline-model-parallel-layout", "Et*4|t*4|t*4|L"]


@pytest.mark.parametrize(
    "split", [[3, 3, 3, 3], [1, 2, 2, 2], [2, 2, 2, 1], [1, 2, 2, 1], [0, 3, 3, 0], [3, 4, 3, 0],
              [2, 3, 2, 1], [5, 3], [8]],
)  # fmt: skip
def test_flags_give_the_split_back(split):
    layout = PipelineParallelLayerLayout(
        PipelineParallelLayerLayout.parse_str_to_list(layout_string(split)), len(split)
    )
    assert [layout.get_num_layers_to_build(LayerType.decoder, pp_rank=s)
            for s in range(len(split))] == split  # fmt: skip
    from megatron.training.arguments import build_parser, validate_args

    argv = ["--num-layers", str(sum(split)), "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--pipeline-model-parallel-size", str(len(split)), *megatron_flags(split)]  # fmt: skip
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=len(split))
    assert args.stage_layers == split
    if split == [3, 3, 3, 3]:
        assert megatron_flags(split) == []
    if split == [1, 2, 2, 2]:
        assert megatron_flags(split) == ["--decoder-first-pipeline-num-layers", "1"]


def test_a_partitioned_vocabulary_is_every_stages_share():
    """--enable-vocab-parallel: the output layer and the input embedding split over the ranks,
    each stage carries 1/N of both plus its messages, the last rank also the output layer's
    exchange with every other rank, the first the embedding's. The total compute is unchanged,
    and the same model that empties the last stage above splits its layers evenly."""
    from megatron.benchmarks.projection import VocabMessages

    costs = LayerCosts([(1.0, 2.0, 0.0, 0.0)] * 12, (0.5, 0.0, 0.0, 1.0), (4.0, 8.0, 0.0, 2.0))
    messages = VocabMessages((0.25, 0.5), (0.1, 0.2), (0.05, 0.06))
    partitioned = partition_vocabulary(costs, 4, messages)
    assert partitioned.every_stage == (4.5 / 4 + 0.25, 2.0 + 0.5, 0.0, 3.0 / 4)
    assert partitioned.output == (0.1, 0.2, 0.0, 0.0)
    assert partitioned.embedding == (0.05, 0.06, 0.0, 0.0)
    assert balanced_split(partitioned, 4, 4) == [3, 3, 3, 3]
    whole = costs.stage_costs([3, 3, 3, 3])
    split = partition_vocabulary(costs, 4).stage_costs([3, 3, 3, 3])
    for field in ("forward", "backward", "weight_grad", "step"):
        assert sum(getattr(split, field)) == pytest.approx(sum(getattr(whole, field)))
        assert len(set(getattr(split, field))) == 1  # every stage alike
    assert max(pace(split, 4)) < max(pace(whole, 4))  # the same even layers, output whole


def test_gpt2_medium_on_8_stages_takes_3_layers_per_rank_with_the_vocabulary_split():
    from megatron.benchmarks import projection

    args = projection.parse_args(["--preset", "gpt2-medium", "--enable-vocab-parallel",
                                  "--p2p-bandwidth-gbs", "400"])  # fmt: skip
    shape = projection.Shape(24, 1024, 4096, 1024, 50304)
    layers = layer_costs_from_model(args, shape, 4, 0.3)
    assert balanced_split(layers, 8, 8) != [3] * 8  # the output layer whole: uneven
    messages = projection.vocab_messages_s(args, 4)
    assert balanced_split(partition_vocabulary(layers, 8, messages), 8, 8) == [3] * 8
    # closed form, the runtime's messages in bf16 with fp32 labels and statistics: the hidden
    # state and labels in, the shard's output out in the forward, the statistics in in the
    # backward; the input embedding's part out and its gradient in; the last and the first
    # rank 6 more of theirs
    tokens, hidden = 4 * 1024, 1024
    forward_bytes = tokens * (2 * hidden + 4) + tokens * (12 + 4 * hidden)
    embed_bytes = tokens * hidden * 2
    assert messages.every == pytest.approx(
        (3 * 20e-6 + (forward_bytes + embed_bytes) / 400e9,
         2 * 20e-6 + (12 * tokens + embed_bytes) / 400e9), rel=1e-12)  # fmt: skip
    assert messages.last == pytest.approx((6 * forward_bytes / 400e9, 6 * 12 * tokens / 400e9),
                                          rel=1e-12)  # fmt: skip
    assert messages.first == pytest.approx((6 * embed_bytes / 400e9,) * 2, rel=1e-12)
