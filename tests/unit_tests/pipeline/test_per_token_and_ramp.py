"""Per-token loss and a changing number of microbatches per step, on real `RankRuntime`s in
one process (one thread per stage, the in-process transport of test_runtime_state.py), through
the public schedule entry points.

* --calculate-per-token-loss: with a loss mask that differs per microbatch, 1F1B-flush on 3
  stages equals the same model in one piece trained by hand on the summed loss divided by the
  step's token count (not the mean of per-microbatch means); PACI's first step, which no
  microbatch can cross, equals it too.
* --rampup-batch-size and --step-batch-size-schedule: with m changing between calls (growing,
  or also shrinking), every stage steps once per call, after exactly that call's microbatches,
  and PACI's drift stays within ceil((N - 1 - s) / a_min).
"""

import copy
import math

import pytest
import torch
from test_runtime_state import in_process_context, run_threads

from megatron.pipeline import forward_backward as fb
from megatron.pipeline.runtime import RankRuntime, decode_count, encode_count
from megatron.pipeline.transport import InProcessTransport

SEQ, HIDDEN = 6, 4
SHAPE = (SEQ, 1, HIDDEN)
LR = 0.1


class Stage(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, batch):
        return torch.tanh(self.linear(batch if self.input_tensor is None else self.input_tensor))


def microbatches(count: int, seed: int = 0) -> list[dict]:
    """Inputs, and loss masks whose token counts differ per microbatch (1 .. SEQ)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for j in range(count):
        mask = torch.zeros(SEQ, 1)
        mask[: 1 + (j * 5) % SEQ] = 1.0
        data.append({"x": torch.randn(SHAPE, generator=generator), "mask": mask})
    return data


def per_token_forward_step(data_iterator, model):
    item = next(data_iterator)
    output = model(item["x"])

    def loss_func(out):  # Megatron's 3-tuple: loss sum, tokens, both for reporting
        per_token = out.pow(2).sum(-1)  # [seq, micro batch]
        loss_sum, tokens = (per_token * item["mask"]).sum(), item["mask"].sum()
        return loss_sum, tokens, {"lm loss": torch.stack([loss_sum, tokens]).detach()}

    return output, loss_func


def build(linears, per_token: bool = True) -> list[RankRuntime]:
    transport = InProcessTransport()
    runtimes = []
    for s, linear in enumerate(linears):
        runtime = RankRuntime(in_process_context(s, len(linears)), Stage(linear),
                              tensor_shape=SHAPE, dtype=torch.float32, deterministic=True,
                              per_token_loss=per_token, transport=transport.for_rank([s]))  # fmt: skip
        fb.attach_stage_runtime(runtime.model, runtime)
        runtimes.append(runtime)
    return runtimes


def train(runtime, schedule_name, data, sizes, forward_step=per_token_forward_step) -> None:
    """One call per iteration with `sizes[k]` microbatches; the last call drains."""
    optimizer = torch.optim.SGD(runtime.model.parameters(), lr=LR)

    def step():
        optimizer.step()
        optimizer.zero_grad()

    schedule_function = fb.get_forward_backward_func(schedule_name)
    iterator = iter(data)
    for k, m in enumerate(sizes):
        schedule_function(forward_step_func=forward_step, data_iterator=iterator,
                          model=runtime.model, num_microbatches=m, seq_length=SEQ,
                          micro_batch_size=1, optimizer_step_func=step,
                          microbatches_before_drain=sum(sizes[k:]))  # fmt: skip


def reference_step(linears, data) -> None:
    """The stages as one model: SGD on sum over the step of masked losses / step's tokens."""
    total, tokens = 0.0, 0.0
    for item in data:
        hidden = item["x"]
        for linear in linears:
            hidden = torch.tanh(linear(hidden))
        total = total + (hidden.pow(2).sum(-1) * item["mask"]).sum()
        tokens += float(item["mask"].sum())
    (total / tokens).backward()
    with torch.no_grad():
        for linear in linears:
            for param in linear.parameters():
                param -= LR * param.grad
                param.grad = None


def linears(num_stages: int) -> list[torch.nn.Linear]:
    torch.manual_seed(7)
    return [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(num_stages)]


def max_difference(runtimes, reference) -> float:
    return max(
        float((a - b).abs().max())
        for runtime, linear in zip(runtimes, reference)
        for a, b in zip(runtime.model.linear.parameters(), linear.parameters())
    )


@pytest.mark.parametrize("schedule_name, steps", [("1f1b", 2), ("paci", 1)])
def test_per_token_loss_equals_one_model_on_the_steps_tokens(schedule_name, steps):
    m, start = 4, linears(3)
    data = microbatches(m * steps)
    assert len({float(item["mask"].sum()) for item in data[:m]}) > 1  # counts differ
    reference = copy.deepcopy(start)
    for k in range(steps):
        reference_step(reference, data[k * m : (k + 1) * m])
    runtimes = build(copy.deepcopy(start))
    run_threads(runtimes, lambda r: train(r, schedule_name, data, [m] * steps))
    assert max_difference(runtimes, reference) <= 1e-6
    # the mean of per-microbatch means is another model: the flag must make a difference
    averaged = copy.deepcopy(start)
    for k in range(steps):
        for item in data[k * m : (k + 1) * m]:
            item_tokens = float(item["mask"].sum())
            hidden = item["x"]
            for linear in averaged:
                hidden = torch.tanh(linear(hidden))
            ((hidden.pow(2).sum(-1) * item["mask"]).sum() / item_tokens / m).backward()
        with torch.no_grad():
            for linear in averaged:
                for param in linear.parameters():
                    param -= LR * param.grad
                    param.grad = None
    assert max_difference(runtimes, averaged) > 1e-4


def test_token_counts_survive_a_bf16_gradient():
    for count in (0, 1, 255, 256, 4097, 131072, 2**31 + 5):
        assert decode_count(encode_count(count, torch.bfloat16, torch.device("cpu"))) == count


@pytest.mark.parametrize("schedule_name", ["1f1b", "paci"])
@pytest.mark.parametrize(
    "sizes",
    [[1, 1, 2, 2, 3, 4, 4],  # a ramp: a grows from 1 to 4
     [4, 4, 1, 1, 2, 2, 3]],  # a step schedule may also shrink the batch
)  # fmt: skip
def test_changing_microbatches_per_step(schedule_name, sizes):
    runtimes = build(linears(4), per_token=False)
    data = microbatches(sum(sizes))

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        output = model(item["x"])
        return output, lambda out: (out.pow(2).mean(), {"lm loss": out.pow(2).mean().detach()})

    steps_after = {id(r): [] for r in runtimes}

    def record(runtime):
        original = runtime._step

        def step(optimizer_step_func):
            steps_after[id(runtime)].append(runtime.state.chunks[0].backwards)
            original(optimizer_step_func)

        runtime._step = step
        train(runtime, schedule_name, data, sizes, forward_step)

    run_threads(runtimes, record)
    boundaries = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    for s, runtime in enumerate(runtimes):
        assert steps_after[id(runtime)] == boundaries  # one step per call, at its boundary
        assert runtime.state.forwards == runtime.state.backwards == sum(sizes)
        bound = math.ceil((len(runtimes) - 1 - s) / min(sizes)) if schedule_name == "paci" else 0
        assert runtime.stats.max_drift <= bound
    if schedule_name == "paci":
        assert runtimes[0].stats.max_drift > 0
