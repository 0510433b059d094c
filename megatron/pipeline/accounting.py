"""What a stage measures about itself: weight-version drift, activation memory, busy time.

Activation memory is measured, not estimated: during each forward a saved-tensors hook sees
every tensor autograd keeps for the backward, and we add up the distinct storages that are not
parameters. The sum over in-flight microbatches is the stage's live activation memory.
"""

import collections
import contextlib
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor


class SavedTensorMeter:
    """Counts bytes autograd saves for backward inside `measure()`, parameters excluded.

    The storages are added up when the forward ends, not when they are saved: megatron-core's
    selective `layernorm` recomputation saves a norm's output and then frees its storage
    (`CheckpointWithoutOutput`), which must not be counted as held."""

    def __init__(self, parameters):
        self._parameter_storages = {_local(p).untyped_storage().data_ptr() for p in parameters}

    @contextlib.contextmanager
    def measure(self, redirection=None):
        """Count saved bytes inside the block, when it ends (a storage saved several times
        counts once). `redirection` (weight stashing, see `weight_stash.SavedTensorRedirection`)
        may save a tensor that aliases a parameter as a reference to its weight version
        instead: a weight, not an activation, so not counted."""
        storages: dict[int, torch.UntypedStorage] = {}
        total = [0]

        def pack(tensor: torch.Tensor):
            if redirection is not None and (saved := redirection.pack(tensor)) is not None:
                return saved
            if isinstance(tensor, torch.nn.Parameter):  # a weight: FSDP's gathered copy too
                return tensor
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in self._parameter_storages:
                storages.setdefault(pointer, storage)
            return tensor

        unpack = (lambda saved: saved) if redirection is None else redirection.unpack
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield total
        finally:
            total[0] = sum(storage.nbytes() for storage in storages.values())
            storages.clear()


def _local(param: torch.Tensor) -> torch.Tensor:
    """A fully sharded parameter's own rows (fsdp.py), else the parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


@dataclass
class StageStats:
    """Per-stage figures reported in `summary.json` (docs/observability.md)."""

    stage: int
    drift_histogram: collections.Counter = field(default_factory=collections.Counter)
    # The most steps crossed under each accumulation factor a (it changes at drain points).
    max_drift_by_accumulation: dict = field(default_factory=dict)
    # Weight stashing: steps between a microbatch's forward and its backward, i.e. how stale
    # its gradient is when applied (the backward itself sees the forward's weights: drift 0).
    delay_histogram: collections.Counter = field(default_factory=collections.Counter)
    # A vocabulary split over the ranks: steps the rank's output shard took between scoring a
    # microbatch (VF) and taking its weight gradient (VB).
    shard_drift_histogram: collections.Counter = field(default_factory=collections.Counter)
    # ... and with the input embedding split too: steps between looking a microbatch up in
    # the rank's embedding rows (EF) and taking their gradient (EB).
    embed_drift_histogram: collections.Counter = field(default_factory=collections.Counter)
    extra_weight_versions: int = 0  # most stashed weight versions held at once
    extra_weight_bytes: int = 0  # their bytes
    peak_inflight_microbatches: int = 0
    live_activation_bytes: int = 0
    peak_activation_bytes: int = 0
    optimizer_steps: int = 0
    busy_s: float = 0.0
    # A vocabulary split over the ranks: time passes spent blocked on its messages (the last
    # stage's backward on the shards' outputs, the first stage's forward on the embedding parts)
    vocab_wait_s: float = 0.0
    wall_s: float = 0.0
    process_memory: "ProcessPeakMemory | None" = None  # from `start_memory_tracking` on

    def start_memory_tracking(self, device: torch.device) -> None:
        """Real peak memory counts from here (call it when set-up is done)."""
        self.process_memory = ProcessPeakMemory(device)
        self.process_memory.reset()

    def record_drift(self, drift: int, accumulation: int | None = None) -> None:
        self.drift_histogram[drift] += 1
        if accumulation is not None:
            known = self.max_drift_by_accumulation.get(accumulation, 0)
            self.max_drift_by_accumulation[accumulation] = max(known, drift)

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
            "max_drift_by_accumulation": {
                str(a): d for a, d in sorted(self.max_drift_by_accumulation.items())
            },
            "peak_inflight_microbatches": self.peak_inflight_microbatches,
            "peak_activation_bytes": self.peak_activation_bytes,
            "extra_weight_versions": self.extra_weight_versions,
            "extra_weight_bytes": self.extra_weight_bytes,
            "max_gradient_delay": max(self.delay_histogram, default=0),
            "gradient_delay_histogram": {
                str(d): n for d, n in sorted(self.delay_histogram.items())
            },
            "optimizer_steps": self.optimizer_steps,
            **self._shard_report(),
            "busy_s": self.busy_s,
            **({"vocab_wait_s": self.vocab_wait_s} if self.vocab_wait_s else {}),
            "wall_s": self.wall_s,
            **(self.process_memory.report() if self.process_memory is not None else {}),
        }

    def _shard_report(self) -> dict:
        report = {}
        for name, histogram in (("shard", self.shard_drift_histogram),
                                ("embed", self.embed_drift_histogram)):  # fmt: skip
            if histogram:
                report[f"max_{name}_drift"] = max(histogram)
                report[f"{name}_drift_histogram"] = {
                    str(d): n for d, n in sorted(histogram.items())
                }
        return report


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


class ProcessPeakMemory:
    """The process's real peak memory since `reset()` (called when set-up is done, so that the
    import and build baseline is reported apart from what training adds).

    * CPU: the kernel's resident-set high-water mark (`VmHWM` in /proc/self/status), reset by
      writing 5 to /proc/self/clear_refs (Linux >= 4.0). Where that is not possible, the
      process's lifetime maximum (`ru_maxrss`), which then includes set-up.
    * CUDA: the caching allocator's `max_memory_allocated(device)`, reset with
      `reset_peak_memory_stats(device)`; the host's resident figures are reported as well.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline_rss = self.baseline_allocated = None
        self.rss_reset = False

    def reset(self) -> None:
        self.rss_reset = _reset_rss_high_water_mark()
        self.baseline_rss = _resident_bytes()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_allocated = torch.cuda.memory_allocated(self.device)

    def report(self) -> dict:
        """Figures for summary.json, in bytes."""
        lifetime_peak = _lifetime_peak_rss()
        peak_rss = _status_bytes("VmHWM") if self.rss_reset else lifetime_peak
        report = {
            "real_peak_kind": "rss" if self.rss_reset else "rss_lifetime",
            "peak_rss_bytes": peak_rss,
            "baseline_rss_bytes": self.baseline_rss,
            "lifetime_peak_rss_bytes": lifetime_peak,
        }
        if self.device.type == "cuda":
            report["real_peak_kind"] = "cuda_max_allocated"
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            report["baseline_allocated_bytes"] = self.baseline_allocated
        key = "peak_allocated_bytes" if self.device.type == "cuda" else "peak_rss_bytes"
        report["real_peak_bytes"] = report[key]
        return report


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status, in bytes (None where there is no /proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _resident_bytes() -> int | None:
    return _status_bytes("VmRSS")


def _reset_rss_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def _lifetime_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
