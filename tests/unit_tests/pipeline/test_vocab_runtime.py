"""The vocabulary split over the pipeline ranks in the real rank runtime (one thread per rank,
in-process transport): every rank holds a quarter (a half) of the output layer and runs the
VF and VB passes its schedule places.

Under the flush schedules the run equals one process with the whole output layer (same
microbatches, the mean gradient of each step, SGD), loss by loss and parameter by parameter;
the runtime runs the simulator's order. Under PACI the shards' drift is measured and stays
within the schedule's bound, and no microbatch is lost."""

import itertools
import time

import pytest
import torch
import torch.nn.functional as F
from test_rank_runtime import SHAPE, Layer
from test_runtime_state import in_process_context, run_threads

from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.runtime import RankRuntime
from megatron.pipeline.schedules.vocab_passes import with_vocab_passes
from megatron.pipeline.simulation import simulate
from megatron.pipeline.trace import action_order
from megatron.pipeline.transport import InProcessTransport
from megatron.pipeline.vocab_parallel import HiddenForLoss, OutputShard, shard_ranges

VOCAB, LR = 8, 0.05


def output_weight() -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randn(VOCAB, SHAPE[-1])


def microbatches():
    """(input, labels) per microbatch; every rank draws the same sequence."""
    generator = torch.Generator().manual_seed(7)
    for _ in itertools.count():
        x = torch.randn(SHAPE, generator=generator)
        yield x, torch.randint(0, VOCAB, SHAPE[:2], generator=generator)


def forward_step(data_iterator, model):
    x, labels = next(data_iterator)
    output = model(x if model.is_first else None)

    def loss_func(per_token):  # Megatron's shape: per-token losses, masked mean
        mask = (labels % 3 != 0).float()
        loss = (per_token * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return (HiddenForLoss(output, labels) if model.is_last else output), loss_func


def accumulate_whole(layers, weight, batch, m: int) -> float:
    """One microbatch through the layers and the whole output layer: its gradient over m
    accumulated, its loss returned (the masked mean of `forward_step`'s loss function)."""
    x, labels = batch
    for layer in layers:
        layer.set_input_tensor(x)
        x = layer(x)
    per_token = F.cross_entropy((x @ weight.t()).view(-1, VOCAB), labels.view(-1),
                                reduction="none").view(labels.shape)  # fmt: skip
    mask = (labels % 3 != 0).float()
    loss = (per_token * mask).sum() / mask.sum()
    (loss / m).backward()
    return loss.item()


def reference(n: int, m: int, steps: int):
    """One process, the whole output layer: losses per microbatch, trained layers and weight."""
    layers = [Layer(k, n) for k in range(n)]
    weight = output_weight().requires_grad_(True)
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.parameters()] + [weight],
                                lr=LR)  # fmt: skip
    data, losses = microbatches(), []
    for _ in range(steps):
        for _ in range(m):
            losses.append(accumulate_whole(layers, weight, next(data), m))
        optimizer.step()
        optimizer.zero_grad()
    return losses, layers, weight.detach()


def build_ranks(n: int):
    transport, runtimes = InProcessTransport(), []
    full = output_weight()
    for rank, (start, end) in enumerate(shard_ranges(VOCAB, n)):
        shard = OutputShard(torch.nn.Parameter(full[start:end].clone()), start)
        runtimes.append(RankRuntime(in_process_context(rank, n), Layer(rank, n), tensor_shape=SHAPE,
                                    dtype=torch.float32, transport=transport.for_rank([rank]),
                                    record_trace=True, output_shard=shard))  # fmt: skip
    return runtimes


def shard_parameters(runtime) -> list:
    """The rank's vocabulary rows: its output shard's, and its input embedding's if they are
    other rows (untied)."""
    weights = [runtime.output_shard.weight]
    if runtime.input_shard is not None and runtime.input_shard.weight is not weights[0]:
        weights.append(runtime.input_shard.weight)
    return weights


def train(runtime, schedule, m: int, steps: int, losses: dict, *, forward_step=forward_step,
          microbatches=microbatches):  # fmt: skip
    optimizer = torch.optim.SGD([*runtime.model.parameters(), *shard_parameters(runtime)], lr=LR)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    data = microbatches()
    for k in range(steps):
        reported = runtime.run_training(schedule, forward_step_func=forward_step,
                                        data_iterator=data, num_microbatches=m,
                                        optimizer_step_func=step,
                                        microbatches_before_drain=(steps - k) * m)  # fmt: skip
        losses.setdefault(runtime.context.stage, []).extend(float(d["lm loss"]) for d in reported)


@pytest.mark.parametrize("name, n, m", [("1f1b", 2, 3), ("1f1b", 4, 4), ("zb-h1", 4, 5)])
def test_flush_with_the_vocabulary_split_trains_as_one_process(name, n, m):
    schedule, steps = with_vocab_passes(resolve_plan(name, num_stages=n).schedule), 2
    runtimes, losses = build_ranks(n), {}
    run_threads(runtimes, lambda r: train(r, schedule, m, steps, losses))
    expected_losses, layers, weight = reference(n, m, steps)
    torch.testing.assert_close(losses[n - 1], expected_losses, rtol=1e-5, atol=1e-6)
    for runtime, layer in zip(runtimes, layers):
        for a, b in zip(runtime.model.parameters(), layer.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    shards = torch.cat([r.output_shard.weight.detach() for r in runtimes])
    torch.testing.assert_close(shards, weight, rtol=1e-5, atol=1e-6)
    for runtime in runtimes:
        assert runtime.shard_drift == {0: steps * m} and not runtime.shard_scores

    simulated = simulate(schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                         forward_cost=1.0, backward_cost=1.0, weight_grad_cost=1.0,
                         vocab_forward_cost=0.5, vocab_backward_cost=0.5)  # fmt: skip
    # the schedule's own passes in the simulator's order; the shards' passes go where their
    # inputs arrive, so only their count is fixed (every rank scores every microbatch once)
    def own_and_vocab(events):
        order = action_order(events)
        own = {s: [a for a in names if not a.startswith("V")] for s, names in order.items()}
        vocab = {s: sorted(a for a in names if a.startswith("V")) for s, names in order.items()}
        return own, vocab

    assert own_and_vocab([e for r in runtimes for e in r.trace]) == own_and_vocab(
        simulated.timeline
    )


class RecordingShard(OutputShard):
    """An output shard that notes the rank's weight version at each VF (microbatch order)."""

    def score(self, hidden, labels):
        self.versions.append(self.runtime.state.steps)
        return super().score(hidden, labels)


def record_versions(runtimes) -> list[list[int]]:
    versions = []
    for runtime in runtimes:
        shard = RecordingShard(runtime.output_shard.weight, runtime.output_shard.start)
        object.__setattr__(shard, "versions", [])
        object.__setattr__(shard, "runtime", runtime)
        runtime.output_shard = shard
        versions.append(shard.versions)
    return versions


def hold_first_backward_until_stepped_score(first, last_versions: list, timeout_s=30.0):
    """Pins the interleaving that shows drift across shards, which thread timing alone may
    not give: the first rank's first backward waits until the last rank's shard has scored a
    microbatch after that rank's first step. The first rank then scores that microbatch
    before its own first step (a VF is taken before anything else), on an older version."""
    parameter = next(first.model.parameters())
    held = []

    def hold(gradient):
        if not held:
            held.append(True)
            deadline = time.monotonic() + timeout_s  # no hang if it never comes: the test fails
            while not any(v >= 1 for v in last_versions) and time.monotonic() < deadline:
                time.sleep(1e-3)
        return gradient

    parameter.register_hook(hold)


@pytest.mark.parametrize("a", [1, 2])
def test_paci_shards_drift_within_the_bound(a):
    """Per shard: steps between scoring a microbatch and its weight gradient, within the
    stage's own bound one stage deeper. Across shards: the versions that scored one
    microbatch differ by at most ceil(N / a) + 1 (rank r has backwarded between i - N + r and
    i microbatches when it scores microbatch i, and one due step may still be pending)."""
    n, steps = 4, 6
    schedule = with_vocab_passes(resolve_plan("paci", num_stages=n).schedule)
    runtimes, losses = build_ranks(n), {}
    versions = record_versions(runtimes)
    hold_first_backward_until_stepped_score(runtimes[0], versions[n - 1])
    run_threads(runtimes, lambda r: train(r, schedule, a, steps, losses))
    spreads = [max(v) - min(v) for v in zip(*versions)]
    assert len(spreads) == steps * a and max(spreads) <= -(-n // a) + 1
    assert max(spreads) >= 1  # the shards that score one microbatch are not all alike
    assert len(losses[n - 1]) == steps * a  # every microbatch's loss, once
    for runtime in runtimes:
        s = runtime.context.stage
        assert sum(runtime.shard_drift.values()) == steps * a and not runtime.shard_scores
        assert max(runtime.shard_drift) <= schedule.drift_bound(s, n, a)
        assert runtime.stats.max_drift <= schedule.drift_bound(s, n, a)
        assert runtime.stats.optimizer_steps == steps
    assert max(max(r.shard_drift) for r in runtimes) >= 1  # shards do step in between


@pytest.mark.parametrize("rule", ["backward-first", "forward-first"])
def test_every_paci_arrival_rule_runs_the_split_to_the_end(rule):
    """The reactive rules (the fixed one is above) on the real runtime: no deadlock, every
    microbatch's loss once, the drift bounds kept."""
    n, a, steps = 4, 2, 5
    plan = resolve_plan("paci", num_stages=n, arrival_rule=rule, vocab_passes=True,
                        split_input=False)  # fmt: skip
    runtimes, losses = build_ranks(n), {}
    run_threads(runtimes, lambda r: train(r, plan.schedule, a, steps, losses))
    assert len(losses[n - 1]) == steps * a
    for runtime in runtimes:
        bound = plan.schedule.drift_bound(runtime.context.stage, n, a)
        assert max(runtime.shard_drift) <= bound and runtime.stats.max_drift <= bound


def test_2bw_with_the_split_equals_2bw_with_the_layer_whole():
    """2BW pins batch b to W(b - 1) on every rank, the shards included (stashed with their
    rank's weights): the split run's losses and weights equal one process doing 2BW's
    one-step-delayed update with the whole output layer."""
    n, m, steps = 4, 4, 3  # 2BW: m >= N - 1, one more with the split
    plan = resolve_plan("2bw", num_stages=n, vocab_passes=True)
    runtimes, losses = build_ranks(n), {}
    run_threads(runtimes, lambda r: train(r, plan.schedule, m, steps, losses))
    expected_losses, layers, weight = delayed_reference(n, m, steps)
    torch.testing.assert_close(losses[n - 1], expected_losses, rtol=1e-5, atol=1e-6)
    shards = torch.cat([r.output_shard.weight.detach() for r in runtimes])
    torch.testing.assert_close(shards, weight, rtol=1e-5, atol=1e-6)
    for runtime, layer in zip(runtimes, layers):
        for a, b in zip(runtime.model.parameters(), layer.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def delayed_reference(n: int, m: int, steps: int):
    """One process, the whole output layer, 2BW's update: batch b's gradient (taken on W(b-1))
    applied to W(b): w(b+1) = w(b) - lr g(w(b-1))."""
    layers = [Layer(k, n) for k in range(n)]
    weight = output_weight().requires_grad_(True)
    params = [p for layer in layers for p in layer.parameters()] + [weight]
    previous = [p.detach().clone() for p in params]  # W(b - 1)
    data, losses = microbatches(), []
    for _ in range(steps):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, old in zip(params, previous):
                p.copy_(old)
        for _ in range(m):
            losses.append(accumulate_whole(layers, weight, next(data), m))
        with torch.no_grad():
            for p, now in zip(params, current):
                p.copy_(now - LR * p.grad)
                p.grad = None
        previous = current
    return losses, layers, weight.detach()


def test_a_last_stage_without_hidden_for_loss_is_refused():
    schedule = with_vocab_passes(resolve_plan("1f1b", num_stages=1).schedule)
    runtimes = build_ranks(1)  # one rank: first and last stage

    def plain_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        return (output.hidden if model.is_last else output), loss_func

    def run(runtime):
        runtime.run_training(schedule, forward_step_func=plain_step, data_iterator=microbatches(),
                             num_microbatches=1, optimizer_step_func=lambda: None,
                             microbatches_before_drain=1)  # fmt: skip

    with pytest.raises(TypeError, match="must return a HiddenForLoss"):
        run(runtimes[0])
