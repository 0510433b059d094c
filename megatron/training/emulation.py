"""A stand-in stage whose forward and backward take given wall-clock times.

Schedule benchmarks on a 2-core machine cannot run real compute on 4+ processes without
measuring CPU contention instead of the schedule. This stage sleeps instead of computing, so
the measured throughput reflects the schedule and its communication only. It keeps the GPT
stage's interface (input tensor from the previous stage, per-token loss on the last stage).

Times may differ per stage (`--emulated-forward-ms 20,40,20,20`), and each action's time may
be drawn around them (`--emulated-noise-cv`): the k-th forward (backward) of stage s takes its
nominal time times `CostNoise(cv, seed).factor(s, "F" ("B"), k)`, the very draws the simulator
makes for the same seed, so a prediction can replay them.
"""

import time

import torch
from megatron.core import parallel_state

from megatron.pipeline.simulation.costs import CostNoise, value_of_stage


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take the time the stage's clock names."""

    @staticmethod
    def forward(ctx, tensor, stage):
        ctx.stage = stage
        time.sleep(stage.next_forward_s())
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.stage.next_backward_s())
        return grad, None


class EmulatedStage(torch.nn.Module):
    """With virtual stages, one per model chunk: chunk c of rank r is virtual stage c N + r,
    and the times (and noise) are given per virtual stage, as the simulator takes them."""

    def __init__(self, forward_ms, backward_ms, hidden_size: int, noise_cv=0.0, seed: int = 0,
                 chunk: int = 0, chunks: int = 1):  # fmt: skip
        super().__init__()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        ranks = parallel_state.get_pipeline_model_parallel_world_size()
        # Same attribute names as GPTModel's: does this stage embed / compute the loss?
        self.pre_process = rank == 0 and chunk == 0
        self.post_process = rank == ranks - 1 and chunk == chunks - 1
        self.stage, stages = chunk * ranks + rank, ranks * chunks
        self.forward_s = value_of_stage(forward_ms, self.stage, stages, "forward ms") / 1000.0
        self.backward_s = value_of_stage(backward_ms, self.stage, stages, "backward ms") / 1000.0
        cv = value_of_stage(noise_cv, self.stage, stages, "noise cv")
        self.noise = CostNoise(cv, seed) if cv > 0 else None
        self.forwards = self.backwards = 0  # emulated actions so far: the noise draw's index
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.input_tensor = None

    def next_forward_s(self) -> float:
        self.forwards += 1
        return self._scaled(self.forward_s, "F", self.forwards - 1)

    def next_backward_s(self) -> float:
        self.backwards += 1
        return self._scaled(self.backward_s, "B", self.backwards - 1)

    def _scaled(self, seconds: float, kind: str, index: int) -> float:
        return (
            seconds if self.noise is None else seconds * self.noise.factor(self.stage, kind, index)
        )

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids, position_ids, attention_mask, labels=None, **unused):
        if self.pre_process:
            batch, seq = input_ids.shape
            hidden = torch.zeros(seq, batch, self.hidden_size, device=self.weight.device)
        else:
            hidden = self.input_tensor
        hidden = _Sleep.apply(hidden * self.weight, self)
        if self.post_process and labels is not None:
            # [b, s] "per-token loss", contiguous like GPTModel's (loss functions .view it)
            return (hidden.mean(dim=-1).transpose(0, 1) + 1.0).contiguous()
        return hidden
