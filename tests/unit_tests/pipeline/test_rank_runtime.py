"""The one rank executor on every placement, in one process: real `RankRuntime`s (one thread
per rank) over the in-process transport, each virtual stage a small layer.

Every flush schedule, split backward or not, one chunk per rank or several, must train exactly
as one process does (the same microbatches, the gradient averaged over the step, SGD), run the
simulator's order and hold the simulator's peak of microbatch-chunks; the split backward itself
must equal autograd's full backward; PACI over virtual stages keeps its per-chunk drift bound,
reported per accumulation factor.
"""

import itertools

import pytest
import torch
from test_runtime_state import in_process_context, run_threads

from megatron.pipeline.plan import resolve_plan
from megatron.pipeline.runtime import RankRuntime
from megatron.pipeline.simulation import simulate
from megatron.pipeline.split_backward import backward_input
from megatron.pipeline.trace import action_order
from megatron.pipeline.transport import InProcessTransport

SHAPE = (3, 2, 4)  # (sequence, micro batch, hidden)
LR = 0.05


class Layer(torch.nn.Module):
    """One virtual stage: a linear layer, a norm and tanh (parameters on both sides of the
    input path, so the split backward has boundaries to cut at)."""

    def __init__(self, virtual_stage: int, num_virtual_stages: int):
        super().__init__()
        torch.manual_seed(100 + virtual_stage)
        self.linear = torch.nn.Linear(SHAPE[-1], SHAPE[-1])
        self.norm = torch.nn.LayerNorm(SHAPE[-1])
        self.is_first = virtual_stage == 0
        self.is_last = virtual_stage == num_virtual_stages - 1
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, batch):
        x = batch if self.is_first else self.input_tensor
        return torch.tanh(self.norm(self.linear(x)))


class Chunks(torch.nn.Module):
    def __init__(self, chunks):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)


def forward_step(data_iterator, model):
    output = model(next(data_iterator) if model.is_first else None)

    def loss_func(out):
        loss = out.pow(2).mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def microbatches():
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(SHAPE, generator=generator, dtype=torch.float32)
            for _ in itertools.count())  # fmt: skip


def reference(num_virtual_stages: int, m: int, steps: int) -> list[torch.nn.Module]:
    """One process: the whole model, each step the mean gradient of m microbatches."""
    layers = [Layer(k, num_virtual_stages) for k in range(num_virtual_stages)]
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    data = microbatches()
    for _ in range(steps):
        for _ in range(m):
            x = next(data)
            for layer in layers:
                layer.set_input_tensor(x)
                x = layer(x)
            (x.pow(2).mean() / m).backward()
        optimizer.step()
        optimizer.zero_grad()
    return layers


def build_ranks(plan):
    """One runtime per rank on one in-process transport; rank r's chunk c is the layer of the
    virtual stage the plan's placement gives."""
    placement, n = plan.placement, plan.num_stages
    total = n * plan.chunks_per_rank
    transport = InProcessTransport()
    runtimes = []
    for rank in range(n):
        stages = [rank] if placement is None else placement.stages_of(rank)
        layers = [Layer(k, total) for k in stages]
        model = layers[0] if placement is None else Chunks(layers)
        runtimes.append(RankRuntime(in_process_context(rank, n), model, tensor_shape=SHAPE,
                                    dtype=torch.float32, placement=placement,
                                    transport=transport.for_rank(stages), record_trace=True,
                                    deterministic=True))  # fmt: skip
    return runtimes


def train(runtime, plan, m: int, steps: int) -> None:
    optimizer = torch.optim.SGD(runtime.model.parameters(), lr=LR)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    data = microbatches()
    for k in range(steps):
        runtime.run_training(plan.schedule, forward_step_func=forward_step, data_iterator=data,
                             num_microbatches=m, optimizer_step_func=step,
                             microbatches_before_drain=(steps - k) * m)  # fmt: skip


def layer_of(runtimes, plan, virtual_stage: int) -> torch.nn.Module:
    if plan.placement is None:
        return runtimes[virtual_stage].model
    rank, chunk = plan.placement.locate(virtual_stage)
    return runtimes[rank].model.chunks[chunk]


FLUSH_CASES = [("1f1b", None, 4, 4), ("zb-h1", None, 4, 4), ("zb-h1", None, 4, 7),
               ("1f1b", 2, 4, 4), ("zb-v", None, 4, 8), ("zb-v", None, 3, 4),
               ("dualpipe-v", None, 4, 8), ("dualpipe-v", None, 3, 7),
               ("zb-interleaved", None, 4, 8), ("zb-interleaved", None, 3, 2),
               ("zb-interleaved", 3, 2, 4)]  # fmt: skip


@pytest.mark.parametrize("name, chunks, n, m", FLUSH_CASES)
def test_flush_schedules_train_as_one_process_in_the_simulators_order(name, chunks, n, m):
    plan = resolve_plan(name, num_stages=n, chunks_per_rank=chunks)
    steps = 2
    runtimes = build_ranks(plan)
    run_threads(runtimes, lambda r: train(r, plan, m, steps))
    expected = reference(n * plan.chunks_per_rank, m, steps)
    for k, layer in enumerate(expected):
        ours = layer_of(runtimes, plan, k)
        for a, b in zip(ours.parameters(), layer.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    simulated = simulate(plan.schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                         forward_cost=1.0, backward_cost=1.0, weight_grad_cost=1.0,
                         chunks_per_rank=plan.chunks_per_rank)  # fmt: skip
    events = [event for r in runtimes for event in r.trace]
    assert action_order(events) == action_order(simulated.timeline)
    held = simulated.peak_held_per_stage or simulated.peak_inflight_per_stage
    for rank, runtime in enumerate(runtimes):
        assert runtime.stats.peak_inflight_microbatches == held[rank]
        assert runtime.state.peak_held == held[rank]
        assert runtime.stats.max_drift == 0 and runtime.inflight_microbatches == 0
        assert runtime.stats.optimizer_steps == steps


def test_the_split_backward_equals_the_full_backward():
    """B then W give autograd's input and weight gradients; B alone computes no weight
    gradient, so W is the only pass that touches `.grad` of the parameters."""
    layers = [Layer(k, 3) for k in range(3)]
    params = [p for layer in layers for p in layer.parameters()]

    def run(x):
        for layer in layers:
            layer.set_input_tensor(x)
            x = layer(x)
        return x

    x = torch.randn(SHAPE, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(SHAPE, dtype=torch.float32)
    run(x).backward(grad)
    expected = [x.grad.clone()] + [p.grad.clone() for p in params]
    for tensor in [x, *params]:
        tensor.grad = None
    pending = backward_input(run(x), grad, x)
    torch.testing.assert_close(x.grad, expected[0], rtol=0, atol=0)
    assert all(p.grad is None for p in params)
    pending.run()
    for p, e in zip(params, expected[1:]):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m", [4, 8])
def test_paci_over_virtual_stages_reports_its_drift_by_accumulation_factor(m):
    n, chunks, steps = 4, 2, 4
    plan = resolve_plan("paci", num_stages=n, chunks_per_rank=chunks, arrival_rule="fixed")
    runtimes = build_ranks(plan)
    run_threads(runtimes, lambda r: train(r, plan, m, steps))
    simulated = simulate(plan.schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                         forward_cost=1.0, backward_cost=1.0, chunks_per_rank=chunks)  # fmt: skip
    for rank, runtime in enumerate(runtimes):
        assert runtime.stats.max_drift_by_accumulation == {m: runtime.stats.max_drift}
        assert runtime.stats.max_drift == simulated.max_drift_per_stage[rank]
        assert max(max(c, default=0) for c in runtime.chunk_drift) == runtime.stats.max_drift
        assert runtime.stats.optimizer_steps == steps * 1  # one step per m backwards per chunk


@pytest.mark.parametrize("name, m, per_update", [("1f1b", 4, 4), ("zb-h1", 4, 4), ("paci", 2, 2),
                                                 ("2bw", 4, 4), ("pipedream", 4, 1)])  # fmt: skip
def test_every_backward_pass_announces_the_loss_gradients_scale(name, m, per_update):
    """What a loss added inside the model (megatron-core's MoE aux loss) must be scaled by,
    set before each backward pass (B and W alike): 1/m for flush and 2BW (a step per batch of
    m), 1/a for PACI, 1 for PipeDream, which steps after every microbatch."""
    plan = resolve_plan(name, num_stages=2)
    runtimes = build_ranks(plan)
    heard = {id(r): [] for r in runtimes}
    for runtime in runtimes:
        runtime.backward_scale_listeners.append(heard[id(runtime)].append)
    run_threads(runtimes, lambda r: train(r, plan, m, steps=2))
    passes = 2 if plan.schedule.splits_backward else 1
    for runtime in runtimes:
        assert heard[id(runtime)] == [1.0 / per_update] * (2 * m * passes)
