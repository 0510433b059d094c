"""The input embedding split by vocabulary over the pipeline ranks with the output layer, in
the real rank runtime (one thread per rank, in-process transport): every rank holds the same
rows of both (with tied embeddings one weight) and runs the EF, EB, VF and VB passes its
schedule places.

Under the flush schedules the run equals one process with the whole embedding and output
layer, tied and untied, loss by loss and parameter by parameter. Under PACI every microbatch
runs once and the embedding rows' drift stays within the stated bound."""

import itertools

import pytest
import test_vocab_runtime as vocab_runtime
import torch
import torch.nn.functional as F
from test_runtime_state import in_process_context, run_threads

from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.runtime import RankRuntime
from megatron.pipeline.schedules.vocab_passes import with_vocab_passes
from megatron.pipeline.transport import InProcessTransport
from megatron.pipeline.vocab_parallel import HiddenForLoss, InputShard, OutputShard, shard_ranges

SEQ, BATCH, HIDDEN, VOCAB, LR = 3, 2, 4, 8, 0.05
SHAPE = (SEQ, BATCH, HIDDEN)


class Layer(torch.nn.Module):
    """One stage: linear, norm, tanh; the first takes the summed embedding parts ([b, s, h])."""

    def __init__(self, stage: int, num_stages: int):
        super().__init__()
        torch.manual_seed(100 + stage)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.input_tensor = self.input_embedding = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def set_input_embedding(self, embedded) -> None:
        self.input_embedding = embedded

    def forward(self):
        x = self.input_embedding.transpose(0, 1) if self.is_first else self.input_tensor
        return torch.tanh(self.norm(self.linear(x)))


def whole_weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    return torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)  # embedding, output layer


def microbatches():
    """{"tokens": [b, s], "labels": [s, b]} per microbatch; every rank draws the same."""
    generator = torch.Generator().manual_seed(7)
    for _ in itertools.count():
        yield {
            "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator),
        }


def masked_mean(per_token, labels):
    mask = (labels % 3 != 0).float()
    return (per_token * mask).sum() / mask.sum()


def forward_step(data_iterator, model):
    batch = next(data_iterator) if (model.is_first or model.is_last) else None
    output = model()

    def loss_func(per_token):
        loss = masked_mean(per_token, batch["labels"])
        return loss, {"lm loss": loss.detach()}

    return (HiddenForLoss(output, batch["labels"]) if model.is_last else output), loss_func


def reference(n: int, m: int, steps: int, tied: bool):
    """One process, the whole embedding and output layer: losses, layers, weights."""
    layers = [Layer(k, n) for k in range(n)]
    embedding, output = (w.requires_grad_(True) for w in whole_weights())
    output = embedding if tied else output
    params = [p for layer in layers for p in layer.parameters()] + [embedding]
    optimizer = torch.optim.SGD(params + ([] if tied else [output]), lr=LR)
    data, losses = microbatches(), []
    for _ in range(steps):
        for _ in range(m):
            batch = next(data)
            x = F.embedding(batch["tokens"], embedding).transpose(0, 1)
            for layer in layers:
                x = torch.tanh(layer.norm(layer.linear(x)))
            per_token = F.cross_entropy((x @ output.t()).view(-1, VOCAB),
                                        batch["labels"].view(-1), reduction="none")  # fmt: skip
            loss = masked_mean(per_token.view(SEQ, BATCH), batch["labels"])
            (loss / m).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, layers, embedding.detach(), output.detach()


class Chunks(torch.nn.Module):
    def __init__(self, chunks):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)


def build_ranks(n: int, tied: bool, plan=None):
    """One runtime per rank; with a `plan` over virtual stages, rank r's chunk c is the layer
    of the virtual stage its placement gives (N x v layers in all)."""
    placement = None if plan is None else plan.placement
    total = n if placement is None else n * plan.chunks_per_rank
    transport, runtimes = InProcessTransport(), []
    embedding, output = whole_weights()
    for rank, (start, end) in enumerate(shard_ranges(VOCAB, n)):
        out = torch.nn.Parameter((embedding if tied else output)[start:end].clone())
        rows = out if tied else torch.nn.Parameter(embedding[start:end].clone())
        stages = [rank] if placement is None else placement.stages_of(rank)
        layers = [Layer(k, total) for k in stages]
        runtimes.append(RankRuntime(
            in_process_context(rank, n), layers[0] if placement is None else Chunks(layers),
            tensor_shape=SHAPE, dtype=torch.float32, placement=placement,
            transport=transport.for_rank(stages), record_trace=True,
            output_shard=OutputShard(out, start), input_shard=InputShard(rows, start, (BATCH, SEQ)),
        ))  # fmt: skip
    return runtimes


def assert_rows_equal(runtimes, embedding, output) -> None:
    """The ranks' rows, in rank order, are the one process's whole layers."""
    rows = torch.cat([r.input_shard.weight.detach() for r in runtimes])
    torch.testing.assert_close(rows, embedding, rtol=1e-5, atol=1e-6)
    shards = torch.cat([r.output_shard.weight.detach() for r in runtimes])
    torch.testing.assert_close(shards, output, rtol=1e-5, atol=1e-6)


def train(runtime, schedule, m: int, steps: int, losses: dict):
    data = microbatches
    if runtime.placement is not None:  # one iterator per chunk, as Megatron passes them
        data = lambda: [microbatches() for _ in runtime.lanes]  # noqa: E731
    vocab_runtime.train(runtime, schedule, m, steps, losses, forward_step=forward_step,
                        microbatches=data)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name, n, m", [("1f1b", 2, 3), ("1f1b", 4, 4), ("zb-h1", 4, 5)])
def test_flush_with_both_layers_split_trains_as_one_process(name, n, m, tied):
    schedule = with_vocab_passes(resolve_plan(name, num_stages=n).schedule, split_input=True)
    runtimes, losses, steps = build_ranks(n, tied), {}, 2
    run_threads(runtimes, lambda r: train(r, schedule, m, steps, losses))
    expected_losses, layers, embedding, output = reference(n, m, steps, tied)
    torch.testing.assert_close(losses[n - 1], expected_losses, rtol=1e-5, atol=1e-6)
    for runtime, layer in zip(runtimes, layers):
        for a, b in zip(runtime.model.parameters(), layer.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_rows_equal(runtimes, embedding, output)
    for runtime in runtimes:  # every lookup took its gradient, in the step it was made for
        assert runtime.stats.embed_drift_histogram == {0: steps * m}
        assert not runtime.embed_lookups and not runtime.read_ahead.batches
        # blocked on the vocabulary's messages: only the first stage's forwards (the parts)
        # and the last stage's backwards (the shards' outputs); part of the rank's waiting
        assert runtime.stats.vocab_wait_s <= runtime.wait_s + 1e-9
    assert all(r.stats.vocab_wait_s == 0.0 for r in runtimes[1:-1])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "name, n, chunks, m",
    [("1f1b", 2, 2, 4), ("1f1b", 4, 2, 4), ("zb-v", 2, 2, 4), ("dualpipe-v", 2, 2, 4)],
)
def test_virtual_stages_with_both_layers_split_train_as_one_process(name, n, chunks, m, tied):
    """Interleaved 1F1B, ZB-V and DualPipeV (two chunks per rank; the V's last virtual stage on
    rank 0): each rank's rows on its first chunk, the passes placed as with one chunk."""
    plan = resolve_plan(name, num_stages=n, chunks_per_rank=chunks, vocab_passes=True)
    assert plan.schedule.embedding_passes and plan.placement is not None
    runtimes, losses, steps = build_ranks(n, tied, plan), {}, 2
    run_threads(runtimes, lambda r: train(r, plan.schedule, m, steps, losses))
    expected_losses, layers, embedding, output = reference(n * chunks, m, steps, tied)
    last_rank, _ = plan.placement.locate(n * chunks - 1)
    torch.testing.assert_close(losses[last_rank], expected_losses, rtol=1e-5, atol=1e-6)
    for runtime in runtimes:
        stages = plan.placement.stages_of(runtime.context.stage)
        for chunk, stage in zip(runtime.model.chunks, stages):
            for a, b in zip(chunk.parameters(), layers[stage].parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_rows_equal(runtimes, embedding, output)


@pytest.mark.parametrize("a", [1, 2])
def test_paci_embedding_rows_drift_within_the_bound(a):
    """Rank r looks microbatch i up once it has backwarded i - W0 (W0: the first stage's
    window on N + 1 stages), and the gradient comes after the first stage's backward of i,
    when r has backwarded at most i + 1 + W0: at most 2 W0 backwards between, so
    ceil(2 W0 / a) steps."""
    n, steps = 4, 6
    schedule = with_vocab_passes(resolve_plan("paci", num_stages=n).schedule, split_input=True)
    runtimes, losses = build_ranks(n, tied=True), {}
    run_threads(runtimes, lambda r: train(r, schedule, a, steps, losses))
    assert len(losses[n - 1]) == steps * a  # every microbatch's loss, once
    window = schedule.inflight_window(0, n, a)
    assert window == n + 1
    for runtime in runtimes:
        drift = runtime.stats.embed_drift_histogram
        assert sum(drift.values()) == steps * a and not runtime.embed_lookups
        assert max(drift) <= -(-2 * window // a)
        assert runtime.stats.optimizer_steps == steps
    assert max(max(r.stats.embed_drift_histogram) for r in runtimes) >= 1


def test_a_schedule_that_stashes_weights_keeps_the_input_whole():
    for name in ("2bw", "pipedream"):
        with pytest.raises(ValueError, match="stashes weights: the input embedding stays"):
            with_vocab_passes(resolve_plan(name, num_stages=4).schedule, split_input=True)
