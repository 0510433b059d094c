"""Tied input and output embeddings under asynchronous schedules, point to point only.

Megatron keeps the first stage's word embedding and the last stage's output layer (two copies
of one weight) equal by all-reducing their gradients over the embedding group before every
step: a synchronization of the first and last stages at each step, which PACI, PipeDream-2BW
and PipeDream do not have. Here the first stage owns the weight and the last stage's copy
follows it, over the same embedding group, with sends and receives only:

* At its k-th step the last stage sends the gradient it accumulated for its copy (this rank's,
  before the data-parallel average, in fp32 and unscaled) to the first stage and leaves the
  copy alone: its optimizer holds the copy in a group whose learning rate and weight decay are
  0 (`suite.decay_groups`), so the copy's update is exactly zero.
* At its k-th step the first stage receives that gradient and adds it to its own before the
  data-parallel average, so it steps the sum that Megatron's all-reduce forms; then it sends
  the updated weight (model dtype) to the last stage.
* After its k-th step the last stage adopts the first stage's weight of step k - L, with
  L = ceil(N / a) (N stages, a microbatches per step), and at every drain (evaluation,
  checkpoint, end of training) every weight not yet adopted, so the copies are bit-identical
  there and a checkpoint resumes under any schedule.

Why that weight is already there. The first stage admits a forward only while it has fewer
than N in flight, so the forward that follows its step j is microbatch (j + 1) a - 1 + N, and
the last stage's backward of that microbatch comes after it. The last stage's step k follows
its backward of (k + 1) a - 1, which is that microbatch or a later one when j <= k - N / a.
So the weight of step k - L was sent before the last stage needed it: it waits for no more than
the message's own transfer, and never on a stage's progress. The first stage's receive of
gradient k has the same property: the last stage sent it before the backward that lets the
first stage reach step k left the last stage.

The lag this leaves: between drains the last stage's copy misses at most L of the first
stage's updates (measured at every last-stage step: `lag_histogram`). Traffic per step: the
gradient (4 bytes per element) one way, the weight (the model's dtype) the other. Memory: the
two copies and their optimizer states, as Megatron's, plus the messages in flight: a send
keeps its buffer until the peer has received it, at most L + 1 messages per side (the first stage
holds weights, the last stage fp32 gradients; `peak_message_bytes`). A send is only waited for
once a message from the peer shows it was received, so that wait returns at once.
"""

import math
import time
from collections import Counter, deque

import torch
import torch.distributed as dist


def lag_bound(num_stages: int, microbatches_per_update: int) -> int:
    """L = ceil(N / a): the steps the last stage's copy trails the first stage's weight."""
    return math.ceil(num_stages / microbatches_per_update)


class ProcessGroupChannel:
    """Messages to the embedding-group peer, point to point over torch.distributed."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group

    def send(self, tensor: torch.Tensor):
        """Starts the send; returns a request whose `wait()` returns once it is received."""
        return dist.isend(tensor, dst=self.peer, group=self.group)

    def receive(self, buffer: torch.Tensor) -> None:
        dist.irecv(buffer, src=self.peer, group=self.group).wait()


class TiedEmbeddingExchange:
    """One rank's side (first or last stage) of the exchange, called around each step;
    `channel` carries the messages (`ProcessGroupChannel` on the ranks)."""

    def __init__(self, weight: torch.nn.Parameter, *, is_first: bool, channel, lag: int,
                 gradient_of, refresh_main=None):  # fmt: skip
        self.weight, self.is_first, self.channel = weight, is_first, channel
        self.lag = lag
        self.gradient_of = gradient_of  # the step's gradient of a parameter (fp32 main_grad)
        self.refresh_main = refresh_main  # an optimizer's fp32 main copy follows the model's
        self.steps = 0  # steps taken (both stages count alike)
        self.adopted = 0  # last stage: the first stage's steps its copy includes
        self.pending: deque = deque()  # (number, request, buffer) of sends not yet received
        self.peak_message_bytes = 0
        self.lag_histogram: Counter = Counter()
        self.wait_s = 0.0
        self.bytes_sent = 0

    # ------------------------------------------------------------------ around a step
    def before_step(self) -> None:
        grad = self.gradient_of(self.weight)
        if self.is_first:
            received = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
            self._receive(received)
            grad.add_(received.to(grad.dtype))
            # The last stage sent gradient k after adopting weight k - L: received, so done.
            self._finish_sends(up_to=self.steps - self.lag)
        else:
            self._send(self.steps, grad.detach().float().clone())  # gradient of step k
            grad.zero_()

    def after_step(self) -> None:
        self.steps += 1
        if self.is_first:
            self._send(self.steps, self.weight.detach().clone())  # weight after step k
            return
        if self.steps - self.adopted > self.lag:
            self._adopt_next()
            # The first stage sent weight v after receiving gradient v - 1: received, so done.
            self._finish_sends(up_to=self.adopted - 1)
        self.lag_histogram[self.steps - self.adopted] += 1

    def catch_up(self) -> None:
        """At a drain: every step of the first stage is in the copy; sends are complete."""
        if not self.is_first:
            while self.adopted < self.steps:
                self._adopt_next()
        self._finish_sends(up_to=self.steps)

    # ------------------------------------------------------------------ messages
    def _adopt_next(self) -> None:
        received = torch.empty_like(self.weight.detach())
        self._receive(received)
        self.weight.data.copy_(received)  # in place, as a step: no autograd version bump
        if self.refresh_main is not None:
            self.refresh_main(self.weight)
        self.adopted += 1

    def _send(self, index: int, tensor: torch.Tensor) -> None:
        request = self.channel.send(tensor)
        self.pending.append((index, request, tensor))
        self.bytes_sent += _bytes(tensor)
        self.peak_message_bytes = max(self.peak_message_bytes, self._held_bytes())

    def _finish_sends(self, *, up_to: int) -> None:
        """Free the buffers of the sends numbered up to `up_to`, which the peer has received.
        (gloo's requests only report completion once waited for, so this is known, not
        polled.)"""
        while self.pending and self.pending[0][0] <= up_to:
            self.pending.popleft()[1].wait()

    def _held_bytes(self) -> int:
        return sum(_bytes(tensor) for _, _, tensor in self.pending)

    def _receive(self, buffer: torch.Tensor) -> None:
        start = time.perf_counter()
        self.channel.receive(buffer)
        self.wait_s += time.perf_counter() - start

    # ------------------------------------------------------------------ report
    def report(self) -> dict:
        """summary.json's `tied_embedding` of this stage."""
        report = {
            "role": "first" if self.is_first else "last",
            "lag_bound": self.lag,
            "steps": self.steps,
            "bytes_sent_per_step": self.bytes_sent / self.steps if self.steps else 0,
            "wait_s": self.wait_s,
            "peak_message_bytes": self.peak_message_bytes,
        }
        if not self.is_first:
            report["max_lag"] = max(self.lag_histogram, default=0)
            report["lag_histogram"] = {str(k): v for k, v in sorted(self.lag_histogram.items())}
        return report


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
