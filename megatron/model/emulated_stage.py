"""A stand-in stage whose forward and backward take given wall-clock times.

Schedule benchmarks on a 2-core machine cannot run real compute on 4+ processes without
measuring CPU contention instead of the schedule. This stage sleeps instead of computing, so
the measured throughput reflects the schedule and its communication only. It keeps the GPT
stage's interface (input tensor from the previous stage, per-token loss on the last stage).

With the vocabulary split over the ranks (--enable-vocab-parallel) every rank also holds a small
output shard whose VF and VB passes wait `--emulated-vocab-forward-ms` and
`--emulated-vocab-backward-ms` (per rank) on top of their real (tiny) arithmetic.

Times may differ per stage (`--emulated-forward-ms 20,40,20,20`), and each action's time may
be drawn around them (`--emulated-noise-cv`): the k-th forward (backward) of stage s takes its
nominal time times `CostNoise(cv, seed).factor(s, "F" ("B"), k)`, the very draws the simulator
makes for the same seed, so a prediction can replay them.

A stage holds only a hidden-size weight, so its data-parallel reduction moves next to nothing.
`--emulated-param-count N` gives it N more parameters in `PARAM_TENSORS` tensors, so that the
reduction moves what a real stage's would (4N bytes in fp32) and `--ddp-bucket-size` cuts it
into several buckets. Their gradients are ones, made for free (an expanded scalar) but added to
`.grad` by autograd itself, so the post-accumulate-grad hooks of the bucketed reduction fire as
for real parameters; and they arrive spread over the backward as a real one's do, last tensor
first: the backward's time is spent in `PARAM_TENSORS + 1` equal parts, one before each
tensor's gradient and the last before the hidden-size weight's (the first layer's). With a
split backward (`--emulated-weight-grad-ms`) the parts and the gradients are the W pass's.
"""

import time
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron.pipeline.simulation.costs import CostNoise, value_of_stage
from megatron.pipeline.vocab_parallel import InputShard, OutputShard

# --emulated-param-count's parameters are split into this many tensors (fewer if N is smaller):
# enough for several buckets, as a real stage's layers give
PARAM_TENSORS = 8


def param_tensor_sizes(count: int) -> list[int]:
    """`count` elements in at most PARAM_TENSORS tensors, as even as integers allow."""
    tensors = min(PARAM_TENSORS, count)
    return [count // tensors + (i < count % tensors) for i in range(tensors)]


class _Shares:
    """One pass's time, drawn when the pass's first part runs (so that the noise draws keep
    their order) and then spent in `parts` equal parts."""

    def __init__(self, draw, parts: int):
        self.draw, self.parts, self.seconds = draw, parts, None

    def next_s(self) -> float:
        if self.seconds is None:
            self.seconds = self.draw()
        return self.seconds / self.parts


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take the time the stage's clock names (the
    backward: its input-gradient part when a weight-gradient time is set; one part of it when
    `shares` spreads it over the stage's parameters)."""

    @staticmethod
    def forward(ctx, tensor, stage, shares=None):
        ctx.stage, ctx.shares = stage, shares
        time.sleep(stage.next_forward_s())
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        shares = ctx.shares
        time.sleep(ctx.stage.next_backward_s() if shares is None else shares.next_s())
        return grad, None, None


class _WeightGradSleep(torch.autograd.Function):
    """Zero whose backward takes the stage's weight-gradient time (or one of its `shares`) and
    reaches only the weight: a split backward runs it in the weight-gradient pass, a full
    backward with the rest."""

    @staticmethod
    def forward(ctx, hidden, weight, stage, shares=None):
        ctx.stage, ctx.shares = stage, shares
        return torch.zeros_like(hidden)

    @staticmethod
    def backward(ctx, grad):
        shares = ctx.shares
        time.sleep(ctx.stage.next_weight_grad_s() if shares is None else shares.next_s())
        weight_grad = torch.zeros(grad.shape[-1], dtype=grad.dtype, device=grad.device)
        return None, weight_grad, None, None


class _Wait(torch.autograd.Function):
    """Identity whose backward waits one of the pass's `shares`. Apart from `_OnesGradient`, so
    that a split backward, which may run a node that reaches a parameter twice (B, then W from
    the gradients B kept), never runs a wait twice."""

    @staticmethod
    def forward(ctx, tensor, shares):
        ctx.shares = shares
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.shares.next_s())
        return grad, None


class _OnesGradient(torch.autograd.Function):
    """Identity on the hidden state whose backward gives `param` a gradient of ones: an
    expanded scalar, so nothing is computed; autograd accumulates it into `.grad` (one pass
    over the tensor) and then runs the parameter's post-accumulate-grad hooks."""

    @staticmethod
    def forward(ctx, tensor, param):
        ctx.like = (param.shape, param.dtype, param.device)
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return grad, torch.ones((), dtype=dtype, device=device).expand(shape)


@dataclass(frozen=True)
class EmulatedOutputShard(OutputShard):
    """An output shard whose VF and VB passes also wait the given seconds."""

    forward_s: float = 0.0
    backward_s: float = 0.0

    def score(self, hidden, labels):
        time.sleep(self.forward_s)
        return super().score(hidden, labels)

    def weight_gradient(self, score, stats) -> None:
        time.sleep(self.backward_s)
        super().weight_gradient(score, stats)


class EmulatedShardModule(torch.nn.Module):
    """The rank's rows [start, start + rows) of a small output layer, for emulated runs."""

    def __init__(self, start: int, rows: int, hidden_size: int, forward_s: float, backward_s):
        super().__init__()
        self.start, self.forward_s, self.backward_s = start, forward_s, backward_s
        generator = torch.Generator().manual_seed(start)
        self.weight = torch.nn.Parameter(0.02 * torch.randn(rows, hidden_size, generator=generator))

    def runtime_shard(self, tokens: int) -> EmulatedOutputShard:
        return EmulatedOutputShard(
            self.weight, self.start, tokens=tokens, forward_s=self.forward_s,
            backward_s=self.backward_s,
        )  # fmt: skip

    def runtime_input_shard(self, batch_shape: tuple[int, int]) -> InputShard:
        """The input embedding's rows (the same small weight, as tied): real, tiny lookups."""
        return InputShard(self.weight, self.start, tuple(batch_shape))


class EmulatedStage(torch.nn.Module):
    """One per model chunk, as virtual stage `virtual_stage` of `num_virtual_stages` (default:
    the rank's stage); the times (and noise) are given per virtual stage, as the simulator
    takes them. `weight_grad_ms` (per virtual stage; None: no split) is the part of the
    backward spent on the weight gradient, which a split-backward schedule runs apart.
    `param_count` (--emulated-param-count): that many more parameters (`params`), whose
    gradients the backward gives over its course."""

    def __init__(self, forward_ms, backward_ms, hidden_size: int, noise_cv=0.0, seed: int = 0,
                 weight_grad_ms=None, virtual_stage: int | None = None,
                 num_virtual_stages: int | None = None,
                 param_count: int | None = None):  # fmt: skip
        super().__init__()
        if virtual_stage is None:
            virtual_stage = parallel_state.get_pipeline_model_parallel_rank()
            num_virtual_stages = parallel_state.get_pipeline_model_parallel_world_size()
        self.stage, stages = virtual_stage, num_virtual_stages
        # Same attribute names as GPTModel's: does this stage embed / compute the loss?
        self.pre_process = virtual_stage == 0
        self.post_process = virtual_stage == stages - 1
        self.forward_s = value_of_stage(forward_ms, self.stage, stages, "forward ms") / 1000.0
        backward_s = value_of_stage(backward_ms, self.stage, stages, "backward ms") / 1000.0
        self.weight_grad_s = 0.0
        if weight_grad_ms is not None:
            self.weight_grad_s = value_of_stage(weight_grad_ms, self.stage, stages,
                                                "weight-gradient ms") / 1000.0  # fmt: skip
        self.backward_s = backward_s - self.weight_grad_s  # the input-gradient part
        cv = value_of_stage(noise_cv, self.stage, stages, "noise cv")
        self.noise = CostNoise(cv, seed) if cv > 0 else None
        self.forwards = self.backwards = self.weight_grads = 0  # the noise draws' indices
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        # after the weight, so in model order they are the later layers, reduced first
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(size)) for size in param_tensor_sizes(param_count or 0)
        )
        self.input_tensor = self.input_embedding = None
        self.splits_vocabulary = False

    def split_vocabulary(self, start: int, rows: int, forward_ms, backward_ms) -> None:
        """--enable-vocab-parallel: this rank's output shard (`output_shard`), its passes'
        times per rank, and on the last stage the hidden state as the output."""
        rank = parallel_state.get_pipeline_model_parallel_rank()
        ranks = parallel_state.get_pipeline_model_parallel_world_size()
        forward_s = value_of_stage(forward_ms, rank, ranks, "vocabulary forward ms") / 1000.0
        backward_s = value_of_stage(backward_ms, rank, ranks, "vocabulary backward ms") / 1000.0
        self.output_shard = EmulatedShardModule(start, rows, self.hidden_size, forward_s,
                                                backward_s)  # fmt: skip
        self.splits_vocabulary = True

    def next_forward_s(self) -> float:
        self.forwards += 1
        return self._scaled(self.forward_s, "F", self.forwards - 1)

    def next_backward_s(self) -> float:
        self.backwards += 1
        return self._scaled(self.backward_s, "B", self.backwards - 1)

    def next_weight_grad_s(self) -> float:
        self.weight_grads += 1
        return self._scaled(self.weight_grad_s, "W", self.weight_grads - 1)

    def _scaled(self, seconds: float, kind: str, index: int) -> float:
        return (
            seconds if self.noise is None else seconds * self.noise.factor(self.stage, kind, index)
        )

    def _gradients_of_params(self, hidden, shares):
        """The parameters' gradients on `hidden`'s backward, the last tensor's first, each
        after one of the pass's `shares`."""
        for param in self.params:
            hidden = _Wait.apply(_OnesGradient.apply(hidden, param), shares)
        return hidden

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def set_input_embedding(self, embedded) -> None:
        """The input embedding split too: every rank's part summed ([b, s, h])."""
        self.input_embedding = embedded

    def forward(self, input_ids, position_ids, attention_mask, labels=None, **unused):
        if self.pre_process and self.input_embedding is not None:
            hidden, self.input_embedding = self.input_embedding.transpose(0, 1), None
        elif self.pre_process:
            batch, seq = input_ids.shape
            hidden = torch.zeros(seq, batch, self.hidden_size, device=self.weight.device)
        else:
            hidden = self.input_tensor
        # with parameters, the (weight-gradient) backward is spent in parts between theirs
        parts = len(self.params) + 1
        if self.weight_grad_s > 0:  # the weight only under the weight-gradient part
            hidden = hidden if hidden.requires_grad else hidden.requires_grad_(True)
            shares = _Shares(self.next_weight_grad_s, parts) if self.params else None
            weight_part = _WeightGradSleep.apply(hidden.detach(), self.weight, self, shares)
            hidden = _Sleep.apply(hidden, self) + self._gradients_of_params(weight_part, shares)
        else:
            shares = _Shares(self.next_backward_s, parts) if self.params else None
            hidden = _Sleep.apply(hidden * self.weight, self, shares)
            hidden = self._gradients_of_params(hidden, shares)
        if self.post_process and self.splits_vocabulary:  # [b, s, h], as GPTModel's then
            return hidden.transpose(0, 1)
        if self.post_process and labels is not None:
            # [b, s] "per-token loss", contiguous like GPTModel's (loss functions .view it)
            return (hidden.mean(dim=-1).transpose(0, 1) + 1.0).contiguous()
        return hidden
