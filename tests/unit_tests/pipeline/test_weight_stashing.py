"""Weight stashing in the runtime (PipeDream-2BW, PipeDream), in one process: real
`RankRuntime`s on threads (the harness of test_runtime_state.py), each stage a linear layer.

Independent references, written out by hand here: PipeDream-2BW is the one-step-delayed update
x(t+1) = x(t) - U(grad f_t(x(t-1))) of the whole model, and PipeDream at one stage is a step
after every microbatch. The number of stashed versions and the gradient delays must equal the
schedule's definitions and the simulator's figures for the same run.
"""

import copy

import pytest
import torch
from test_runtime_state import TinyStage, batches, build_pipeline, run_threads
from test_runtime_state import train as train_with_sgd

from megatron.pipeline.schedules import get_schedule
from megatron.pipeline.simulation import simulate
from megatron.pipeline.weight_stash import WeightStash

LR, MOMENTUM = 0.05, 0.9


def train(runtime, schedule, m: int, steps: int) -> None:
    """One call per iteration, the last drains; SGD with momentum on each stage."""
    train_with_sgd(runtime, schedule, m, steps, lr=LR, momentum=MOMENTUM)


def run_pipeline(name: str, num_stages: int, m: int, steps: int, deterministic=True):
    runtimes = build_pipeline(num_stages, deterministic=deterministic)
    schedule = get_schedule(name)
    run_threads(runtimes, lambda r: train(r, schedule, m, steps))
    return runtimes


def whole_model(num_stages: int) -> torch.nn.Sequential:
    """The stages one after another, with the pipeline's initial weights."""
    return torch.nn.Sequential(*(TinyStage(s) for s in range(num_stages)))


def batch_gradient(model, data, microbatches: int) -> list[torch.Tensor]:
    """Gradient of the mean loss over `microbatches` microbatches at the model's weights."""
    model.zero_grad()
    for _ in range(microbatches):
        model(next(data)).pow(2).mean().div(microbatches).backward()
    return [p.grad.clone() for p in model.parameters()]


def delayed_reference(num_stages: int, m: int, steps: int, delay: int):
    """x(t+1) = x(t) - U(grad f_t(x(max(t - delay, 0)))), U: SGD with momentum."""
    model = whole_model(num_stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data, history = batches(0), [copy.deepcopy(model.state_dict())]
    for t in range(steps):
        live = copy.deepcopy(model.state_dict())
        model.load_state_dict(history[max(t - delay, 0)])
        grads = batch_gradient(model, data, m)
        model.load_state_dict(live)
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        optimizer.step()
        history.append(copy.deepcopy(model.state_dict()))
    return model


def assert_stages_equal(runtimes, reference) -> None:
    for runtime, stage in zip(runtimes, reference):
        for ours, theirs in zip(runtime.model.parameters(), stage.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_stages, m", [(4, 4), (4, 3), (1, 2)])
def test_2bw_equals_the_one_step_delayed_run(num_stages, m):
    steps = 6
    runtimes = run_pipeline("2bw", num_stages, m, steps, deterministic=False)
    assert_stages_equal(runtimes, delayed_reference(num_stages, m, steps, delay=1))
    # ... and not the synchronous one: the delay is really there
    synchronous = delayed_reference(num_stages, m, steps, delay=0)
    assert not torch.allclose(runtimes[0].model.linear.weight, synchronous[0].linear.weight)
    simulated = simulate(get_schedule("2bw"), num_stages=num_stages, microbatches_per_step=m,
                         steps=steps, forward_cost=1.0, backward_cost=2.0)  # fmt: skip
    for s, runtime in enumerate(runtimes):
        stats, params = runtime.stats, list(runtime.model.parameters())
        assert stats.extra_weight_versions == 1 == simulated.measured_extra_weight_versions[s]
        assert stats.extra_weight_bytes == sum(p.numel() * p.element_size() for p in params)
        # batch 0 has no older version; every later batch's gradient is one step old
        assert stats.delay_histogram == {0: m, 1: (steps - 1) * m}
        assert stats.max_drift == 0  # the backward sees its forward's weights
        # the next batch would forward on the version before the newest: it is kept
        assert list(runtime.stash.versions) == [steps - 1]


@pytest.mark.parametrize("num_stages", [4, 3])
def test_pipedream_versions_and_delays_equal_the_simulators(num_stages):
    m, steps = 4, 3
    runtimes = run_pipeline("pipedream", num_stages, m, steps)
    schedule = get_schedule("pipedream")
    simulated = simulate(schedule, num_stages=num_stages, microbatches_per_step=m,
                         steps=steps, forward_cost=1.0, backward_cost=2.0)  # fmt: skip
    for s, runtime in enumerate(runtimes):
        stats = runtime.stats
        assert runtime.state.steps == stats.optimizer_steps == steps * m
        expected_versions = schedule.extra_weight_versions(s, num_stages)
        assert stats.extra_weight_versions == expected_versions
        assert simulated.measured_extra_weight_versions[s] == expected_versions
        delay = max(stats.delay_histogram)
        assert delay == simulated.max_gradient_delay_per_stage[s] == num_stages - 1 - s
        assert stats.max_drift == 0 and runtime.stash.versions == {}


def test_pipedream_on_one_stage_steps_after_every_microbatch():
    """No delay at one stage: m steps per iteration, each on one microbatch's gradient (the
    loss is not scaled by 1/m)."""
    m, steps = 3, 2
    runtime = run_pipeline("pipedream", 1, m, steps)[0]
    reference = delayed_reference(1, 1, steps * m, delay=0)
    assert_stages_equal([runtime], reference)
    assert runtime.stats.extra_weight_versions == 0


def test_a_saved_view_of_a_weight_follows_its_version():
    """A forward on the live weights, then an in-place step, then the backward: the saved
    `weight.t()` (a view of the live tensor) must give the forward's values."""
    layer = torch.nn.Linear(3, 2, bias=False)
    stash, x = WeightStash(layer.parameters()), torch.randn(5, 3, requires_grad=True)
    redirection = stash.redirection(0)

    def pack(tensor):  # what the runtime's meter does: a non-parameter is kept as it is
        return redirection.pack(tensor) or tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, redirection.unpack):
        out = torch.nn.functional.linear(x, layer.weight)
    expected = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    stash.keep_live_version()
    with torch.no_grad():
        layer.weight.mul_(-3.0)  # the step, in place
    stash.stepped()
    with stash.swapped_in(0):
        torch.testing.assert_close(layer.weight, stash.versions[0][0])
        (got,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(got, expected)
    assert stash.peak_versions == 1 and layer.weight.data_ptr() != stash.versions[0][0].data_ptr()
    stash.release_unneeded(lambda version: False)
    assert stash.versions == {}
    with pytest.raises(RuntimeError, match="weight version 0 is needed but was not kept"):
        stash.tensors_of(0)


def test_a_schedule_without_stashing_cannot_follow_one():
    runtime = build_pipeline(1)[0]
    train(runtime, get_schedule("2bw"), 2, 1)
    with pytest.raises(RuntimeError, match="paci after a weight-stashing schedule"):
        train(runtime, get_schedule("paci"), 2, 1)
