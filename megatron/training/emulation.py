"""A stand-in stage whose forward and backward take fixed wall-clock times.

Schedule benchmarks on a 2-core machine cannot run real compute on 4+ processes without
measuring CPU contention instead of the schedule. This stage sleeps instead of computing, so
the measured throughput reflects the schedule and its communication only. It keeps the GPT
stage's interface (input tensor from the previous stage, per-token loss on the last stage).
"""

import time

import torch
from megatron.core import parallel_state


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed time."""

    @staticmethod
    def forward(ctx, tensor, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedStage(torch.nn.Module):
    def __init__(self, forward_ms: float, backward_ms: float, hidden_size: int):
        super().__init__()
        self.forward_s, self.backward_s = forward_ms / 1000.0, backward_ms / 1000.0
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.input_tensor = None
        # Same attribute names as GPTModel's: does this stage embed / compute the loss?
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids, position_ids, attention_mask, labels=None, **unused):
        if self.pre_process:
            batch, seq = input_ids.shape
            hidden = torch.zeros(seq, batch, self.hidden_size, device=self.weight.device)
        else:
            hidden = self.input_tensor
        hidden = _Sleep.apply(hidden * self.weight, self.forward_s, self.backward_s)
        if self.post_process and labels is not None:
            return hidden.mean(dim=-1).transpose(0, 1) + 1.0  # [b, s] "per-token loss"
        return hidden
