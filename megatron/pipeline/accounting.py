"""What a stage measures about itself: weight-version drift, activation memory, busy time.

Activation memory is measured, not estimated: during each forward a saved-tensors hook sees
every tensor autograd keeps for the backward, and we add up the distinct storages that are not
parameters. The sum over in-flight microbatches is the stage's live activation memory.
"""

import collections
import contextlib
from dataclasses import dataclass, field

import torch


class SavedTensorMeter:
    """Counts bytes autograd saves for backward inside `measure()`, parameters excluded."""

    def __init__(self, parameters):
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}

    @contextlib.contextmanager
    def measure(self, redirection=None):
        """Count saved bytes inside the block. `redirection` (weight stashing, see
        `weight_stash.SavedTensorRedirection`) may save a tensor that aliases a parameter as a
        reference to its weight version instead: a weight, not an activation, so not counted."""
        seen: set[int] = set()
        total = [0]

        def pack(tensor: torch.Tensor):
            if redirection is not None and (saved := redirection.pack(tensor)) is not None:
                return saved
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in seen and pointer not in self._parameter_storages:
                seen.add(pointer)
                total[0] += storage.nbytes()
            return tensor

        unpack = (lambda saved: saved) if redirection is None else redirection.unpack
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield total


@dataclass
class StageStats:
    """Per-stage figures reported in `summary.json` (README: Observability)."""

    stage: int
    drift_histogram: collections.Counter = field(default_factory=collections.Counter)
    # Weight stashing: steps between a microbatch's forward and its backward, i.e. how stale
    # its gradient is when applied (the backward itself sees the forward's weights: drift 0).
    delay_histogram: collections.Counter = field(default_factory=collections.Counter)
    extra_weight_versions: int = 0  # most stashed weight versions held at once
    extra_weight_bytes: int = 0  # their bytes
    peak_inflight_microbatches: int = 0
    live_activation_bytes: int = 0
    peak_activation_bytes: int = 0
    optimizer_steps: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0

    def record_drift(self, drift: int) -> None:
        self.drift_histogram[drift] += 1

    def record_delay(self, delay: int) -> None:
        self.delay_histogram[delay] += 1

    def add_activation(self, nbytes: int, inflight: int) -> None:
        self.live_activation_bytes += nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)
        self.peak_inflight_microbatches = max(self.peak_inflight_microbatches, inflight)

    def release_activation(self, nbytes: int) -> None:
        self.live_activation_bytes -= nbytes

    @property
    def max_drift(self) -> int:
        return max(self.drift_histogram, default=0)

    @property
    def mean_drift(self) -> float:
        count = sum(self.drift_histogram.values())
        return sum(d * n for d, n in self.drift_histogram.items()) / count if count else 0.0

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "max_drift": self.max_drift,
            "mean_drift": self.mean_drift,
            "drift_histogram": {str(d): n for d, n in sorted(self.drift_histogram.items())},
            "peak_inflight_microbatches": self.peak_inflight_microbatches,
            "peak_activation_bytes": self.peak_activation_bytes,
            "extra_weight_versions": self.extra_weight_versions,
            "extra_weight_bytes": self.extra_weight_bytes,
            "max_gradient_delay": max(self.delay_histogram, default=0),
            "gradient_delay_histogram": {
                str(d): n for d, n in sorted(self.delay_histogram.items())
            },
            "optimizer_steps": self.optimizer_steps,
            "busy_s": self.busy_s,
            "wall_s": self.wall_s,
        }


@contextlib.contextmanager
def preserve_versions(parameters):
    """Update parameters in place while older microbatches' graphs still hold them.

    Autograd refuses a backward whose saved tensors were modified in place after the forward
    (the version counter moved). PACI wants exactly that backward, on the current weights, so
    the step runs with the counters restored afterwards. No copy of any weight is made.
    """
    parameters = tuple(parameters)
    with torch.autograd.grad_mode._unsafe_preserve_version_counter(parameters):
        yield
