"""What a pipeline run did, measured the same way for a simulation and for a real run's trace.

Metrics of a simulated run (`SimulationResult`):

* ``utilization[s]`` = busy time of stage s / makespan (whole run, fill and drain included);
  ``bubble_fraction`` = 1 - the mean utilization. For a flush schedule every step repeats the
  same timeline, so this is the per-step bubble: with uniform costs and no latency, 1F1B gives
  exactly ``(N - 1) / (m + N - 1)``. For the asynchronous schedules it is the one-time fill and
  drain spread over the run.
* ``steady_utilization[s]``: the same inside stage s's steady-state window (below, starting
  after step max(1, steps // 4)), which leaves out the one-time fill and drain of the
  asynchronous schedules: equal to
  ``utilization`` for flush schedules (whole steps, each one period), 1.0 for PACI with
  uniform costs. None when the run has too few steps for a window.
* ``idle_per_step[s]`` = (makespan - busy time of s) / steps: the bubble in time units per
  optimizer step; for a flush schedule every stage idles this long in each step, one step
  being one period (uniform costs: 1F1B ``(N - 1)(F + B + W)``, ZB-H1 with m >= N
  ``(N - 1)(F + B - W)``).
* ``throughput_vs_ideal`` = the busiest stage's compute time / makespan: 1.0 means the run takes
  no longer than its bottleneck stage's work (with uniform costs, the mean utilization).
* ``max_drift_per_stage[s]``: forward/backward inconsistency, the largest (weight version used
  by a microbatch's backward) - (version used by its forward). Schedules that stash weights
  (PipeDream, 2BW) back-propagate on the forward's version: 0 by construction.
* ``max_gradient_delay_per_stage[s]``: staleness, the largest (version a gradient is applied to
  by the step) - (version its forward used). PACI: equals its drift; 2BW: 1; PipeDream: N-1-s;
  flush schedules: 0.
* ``peak_inflight_per_stage[s]``: the most microbatches forwarded and not yet backwarded
  (`StageView.inflight`): PACI gives N - s, 1F1B min(N - s, m), GPipe m. ZB-H1 also keeps
  N - s; its deferred W passes hold the smaller rest of the activations (inputs, gradients).
* virtual stages (schedules with a placement; ``to_dict`` then adds ``virtual_stages``): a
  stage is a rank, ``peak_inflight_per_stage`` counts microbatch-chunks, ``peak_held_per_stage``
  those not yet through W either, and ``bubble_over_ideal`` is idle over compute time
  (Narayanan et al.'s t_bubble / t_ideal: uniform interleaved 1F1B gives (N - 1) / (v m)).
* ``extra_weight_versions``: what the schedule declares; ``measured_extra_weight_versions``: the
  most distinct versions a stashing stage held at once (live + stashes of its in-flight
  microbatches) minus one.

Steady state, the one definition used everywhere (simulator, projection, benchmark):
steady-state throughput (`steady_state_throughput`) reads any timeline, a simulation's or a real
run's Chrome trace: per stage, microbatches per second between the end of the backward that
closes step ``first`` and the end of the backward that closes step ``last``
(`steady_state_window`): the first step (start-up, PACI's one-time pipeline fill) and the last
steps (the final drain) are left out; whole steps only, so every optimizer step and, for
1F1B-flush, every per-step bubble in between is counted. The figure is the window's
microbatches over the stages' mean window length.
"""

import json
import math
import statistics
from dataclasses import dataclass, field

from ..schedules.base import ActionKind
from ..trace import TraceEvent


@dataclass
class SimulationResult:
    """What one simulated run measured; `to_dict`/`to_json` leave the timeline out."""

    schedule: str
    num_stages: int
    microbatches_per_step: int
    steps: int
    makespan: float
    busy_per_stage: list[float]
    utilization: list[float]
    mean_utilization: float
    bubble_fraction: float
    steady_utilization: list[float] | None
    steady_bubble_fraction: float | None
    idle_per_step: list[float]
    throughput_vs_ideal: float
    microbatches_per_second: float
    max_drift_per_stage: list[int]
    mean_drift_per_stage: list[float]
    max_gradient_delay_per_stage: list[int]
    peak_inflight_per_stage: list[int]
    extra_weight_versions: list[int]
    measured_extra_weight_versions: list[int]
    optimizer_steps_per_stage: list[int]
    timeline: list[TraceEvent] = field(default_factory=list, repr=False)
    # Virtual stages (None/1: one chunk per stage): the placement's shape, the chunks per rank,
    # each rank's virtual stages by chunk id, and the most microbatch-chunks each rank held
    # alive (forwarded, not yet through their last backward pass: W when it is split off).
    placement: str | None = None
    chunks_per_rank: int = 1
    virtual_stages_per_rank: list[list[int]] = field(default_factory=list)
    peak_held_per_stage: list[int] = field(default_factory=list)
    # a vocabulary split over the ranks: the most steps a rank's output shard took between
    # scoring a microbatch (VF) and taking its weight gradient (VB); None without the split
    max_shard_drift_per_stage: list[int] | None = None
    # ... and with the input embedding split too: the most steps between a rank's EF of a
    # microbatch and its EB (the step after takes the gradient)
    max_embed_drift_per_stage: list[int] | None = None

    @property
    def total_microbatches(self) -> int:
        return self.microbatches_per_step * self.steps

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time over compute time, summed over the stages: Narayanan et al.'s bubble time
        fraction, t_bubble / t_ideal (uniform interleaved 1F1B: (N - 1) / (v m)). The optimizer
        step counts as compute."""
        busy = sum(self.busy_per_stage)
        idle = self.num_stages * self.makespan - busy
        return idle / busy if busy > 0 else 0.0

    def virtual_stage_report(self) -> dict | None:
        """The figures of a run with virtual stages (None without): placement, peak activations
        per rank in chunk units and in whole-stage units (a chunk is 1/v of a rank's layers)."""
        if self.placement is None:
            return None
        v = self.chunks_per_rank
        return {
            "placement": self.placement,
            "chunks_per_rank": v,
            "virtual_stages_per_rank": self.virtual_stages_per_rank,
            "bubble_over_ideal": self.bubble_over_ideal,
            "peak_activation_chunks_per_rank": self.peak_inflight_per_stage,
            "peak_held_chunks_per_rank": self.peak_held_per_stage,
            "peak_activations_in_stages_per_rank": [p / v for p in self.peak_inflight_per_stage],
        }

    def to_dict(self) -> dict:
        steady = self.steady_utilization
        return {
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "microbatches_per_step": self.microbatches_per_step,
            "steps": self.steps,
            "total_microbatches": self.total_microbatches,
            "makespan": self.makespan,
            "utilization": {"per_stage": self.utilization, "mean": self.mean_utilization},
            "bubble_fraction": self.bubble_fraction,
            "steady_utilization": (
                None if steady is None else {"per_stage": steady, "mean": sum(steady) / len(steady)}
            ),
            "steady_bubble_fraction": self.steady_bubble_fraction,
            "idle_per_step": {
                "per_stage": self.idle_per_step,
                "mean": sum(self.idle_per_step) / self.num_stages,
            },
            "throughput_vs_ideal": self.throughput_vs_ideal,
            "microbatches_per_second": self.microbatches_per_second,
            "busy_per_stage": self.busy_per_stage,
            "max_drift_per_stage": self.max_drift_per_stage,
            "mean_drift_per_stage": self.mean_drift_per_stage,
            "max_gradient_delay_per_stage": self.max_gradient_delay_per_stage,
            "peak_inflight_per_stage": self.peak_inflight_per_stage,
            "extra_weight_versions": self.extra_weight_versions,
            "measured_extra_weight_versions": self.measured_extra_weight_versions,
            "optimizer_steps_per_stage": self.optimizer_steps_per_stage,
            **({} if self.placement is None else {"virtual_stages": self.virtual_stage_report()}),
            **(
                {}
                if self.max_shard_drift_per_stage is None
                else {"max_shard_drift_per_stage": self.max_shard_drift_per_stage}
            ),
            **(
                {}
                if self.max_embed_drift_per_stage is None
                else {"max_embed_drift_per_stage": self.max_embed_drift_per_stage}
            ),
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def by_stage(events) -> dict[int, list[TraceEvent]]:
    """Each stage's work events (WAIT/DONE left out) in order of start time."""
    stages: dict[int, list[TraceEvent]] = {}
    for event in events:
        if event.action.kind not in (ActionKind.WAIT, ActionKind.DONE):
            stages.setdefault(event.stage, []).append(event)
    return {s: sorted(evs, key=lambda e: e.start_s) for s, evs in sorted(stages.items())}


def steady_state_window(
    num_stages: int, microbatches: int, steps: int, first: int = 1
) -> tuple[int, int]:
    """Steps (first, last) whose closing backwards bound the measurement window.

    It starts after step `first` (at least 1: start-up; PACI's fill) and ends before the final
    drain: stage s forwards its last microbatch right after its backward N - s microbatches
    earlier, so the window ends at least N microbatches before the end of the data, on a step
    boundary.
    """
    last = steps - math.ceil(num_stages / microbatches)
    if last <= first:
        need = first + 1 + math.ceil(num_stages / microbatches)
        raise ValueError(f"a steady-state window needs at least {need} steps, got {steps}")
    return first, last


def backward_ends(events) -> dict[int, dict[int, float]]:
    """Per stage, microbatch -> end time of its backward."""
    ends: dict[int, dict[int, float]] = {}
    for event in events:
        if event.action.kind is ActionKind.BACKWARD:
            ends.setdefault(event.stage, {})[event.action.microbatch] = event.end_s
    return ends


def window_per_stage(ends, num_stages: int, microbatches: int, steps: int, first: int = 1):
    """The steady-state window of every stage as (start, end) times, and the microbatches it
    holds: from the end of the backward closing step `first` to the end of the one closing
    the last step before the drain (`steady_state_window`)."""
    first, last = steady_state_window(num_stages, microbatches, steps, first)
    lo, hi = first * microbatches - 1, last * microbatches - 1
    if len(ends) != num_stages:
        raise ValueError(f"the trace has {len(ends)} stages, expected {num_stages}")
    windows = []
    for stage, stage_ends in sorted(ends.items()):
        if lo not in stage_ends or hi not in stage_ends:
            raise ValueError(f"stage {stage}: the trace lacks backward {lo} or {hi}")
        windows.append((stage_ends[lo], stage_ends[hi]))
    return windows, hi - lo


def steady_state_throughput(
    events, num_stages: int, microbatches: int, steps: int, first: int = 1
) -> float:
    """Microbatches per second in the steady-state window (see the module docstring)."""
    windows, count = window_per_stage(backward_ends(events), num_stages, microbatches, steps, first)
    return count / statistics.fmean(hi - lo for lo, hi in windows)


def steady_utilization(ends, busy_intervals, num_stages: int, microbatches: int, steps: int):
    """Per stage, the busy fraction inside its steady-state window, started after a quarter of
    the steps (a long fill, as with p2p latency, is then left out); None: too few steps."""
    try:
        first = max(1, steps // 4)
        windows, _ = window_per_stage(ends, num_stages, microbatches, steps, first)
    except ValueError:
        return None
    result = []
    for (lo, hi), intervals in zip(windows, busy_intervals):
        if hi <= lo:
            return None
        busy = sum(max(0.0, min(e, hi) - max(b, lo)) for b, e in intervals)
        result.append(busy / (hi - lo))
    return result
