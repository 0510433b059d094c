"""A discrete-event simulator that runs the runtime's own schedule definitions.

`simulate` drives a `Schedule`'s `next_action` exactly as the runtime does, with compute and
transfers replaced by durations, and measures what the schedule does with them: makespan,
utilization, bubble, drift, gradient delay, in-flight microbatches and weight versions.

Execution model (what the runtime does, minus the tensors):

* Calls. A run is `steps` calls of the schedule, as the training loop makes one per iteration.
  Call k (1-based) has ``backward_target = k * m`` and, for the whole run,
  ``forward_limit = steps * m`` (the data ends there; nothing needs to drain earlier). Counters
  are cumulative. Stages are not synchronized between calls: a stage whose call k returns DONE
  starts call k + 1 at once.
* A stage is idle or busy. When idle it builds a `StageView` (``input_ready``: the first stage
  always, otherwise the activation of microbatch ``forwards`` has arrived; ``grad_ready``: the
  last stage when it has a microbatch in flight (its own loss), otherwise the output gradient
  of microbatch ``backwards`` has arrived) and asks `next_action`:

  - FORWARD / BACKWARD / WEIGHT_GRAD run for their cost. A FORWARD or BACKWARD whose input has
    not arrived yet (static schedules such as 1F1B-flush ask for them in a fixed order) blocks
    the stage until it arrives and then runs;
  - STEP runs for ``step_cost`` and raises the stage's weight version by one;
  - WAIT idles the stage until the next arrival at it, then it asks again;
  - DONE ends the stage's call.

* A forward's output reaches stage s + 1 at its end + ``p2p_latency``; a backward's input
  gradient reaches stage s - 1 at its end + ``p2p_latency``. Events at the same instant are all
  applied before any idle stage decides, stages deciding in stage order.
* ``p2p_latency`` is pure delay: it occupies no stage, and nothing hides it. The 1F1B in-flight
  window (N - s, PACI's admission too) covers exactly the compute of a round trip, so every
  transfer shows: PACI's steady state is then N(F+B) / (N(F+B) + 2(N-1)L) busy, not 1.
* Costs are per stage (a number is used for every stage). A schedule without a split backward
  pays ``backward_cost + weight_grad_cost`` per backward; a split one (ZB-H1) pays
  ``backward_cost`` for the input-gradient pass B and ``weight_grad_cost`` for W.

Metrics (`SimulationResult`):

* ``utilization[s]`` = busy time of stage s / makespan (whole run, fill and drain included);
  ``bubble_fraction`` = 1 - the mean utilization. For a flush schedule every step repeats the
  same timeline, so this is the per-step bubble: with uniform costs and no latency, 1F1B gives
  exactly ``(N - 1) / (m + N - 1)``. For the asynchronous schedules it is the one-time fill and
  drain spread over the run.
* ``steady_utilization[s]``: the same over the middle half of stage s's calls (from the end of
  its call q to the end of its call steps - q, q = max(1, steps // 4)), which leaves out the
  one-time fill and drain of the asynchronous schedules once steps is large enough: equal to
  ``utilization`` for flush schedules (each call is one period), 1.0 for PACI with uniform
  costs. None when steps < 3.
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
* ``extra_weight_versions``: what the schedule declares; ``measured_extra_weight_versions``: the
  most distinct versions a stashing stage held at once (live + stashes of its in-flight
  microbatches) minus one.
"""

import heapq
import json
import math
from dataclasses import dataclass, field
from typing import Sequence

from .schedules.base import Action, ActionKind, Schedule, StageView
from .trace import TraceEvent

_FINISH, _ACTIVATION, _GRADIENT = 0, 1, 2


class SimulationError(RuntimeError):
    """The schedule did something impossible (a deadlock, an action that cannot run)."""


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    """Broadcast a number to every stage, or check a per-stage sequence; finite and >= 0."""
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    elif isinstance(value, str):
        raise ValueError(f"{name}: expected a number or one number per stage, got {value!r}")
    else:
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(f"{name}: {len(values)} values given for {num_stages} stages")
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}: costs must be finite and >= 0, got {v}")
    return values


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

    @property
    def total_microbatches(self) -> int:
        return self.microbatches_per_step * self.steps

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
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


class _Stage:
    """The simulator's bookkeeping for one stage: counters, arrivals, versions, measurements."""

    def __init__(self, index: int):
        self.index = index
        self.forwards = self.backwards = self.weight_grads = self.steps = 0
        self.call = 1
        self.call_ends: list[float] = []
        self.finished = False
        self.busy = False
        self.current: tuple[Action, float] | None = None
        self.blocked: Action | None = None  # a FORWARD/BACKWARD waiting for its input
        self.waiting = False  # WAIT: ask again at the next arrival
        self.activations_arrived = 0  # arrivals are in microbatch order (FIFO, fixed latency)
        self.gradients_arrived = 0
        self.busy_time = 0.0
        self.forward_version: dict[int, int] = {}  # microbatch -> version its forward used
        self.stash: dict[int, int] = {}  # version -> in-flight microbatches that stashed it
        self.pending_grads: list[int] = []  # forward versions of gradients not yet applied
        self.max_drift = 0
        self.drift_sum = 0
        self.drift_count = 0
        self.max_delay = 0
        self.peak_inflight = 0
        self.peak_extra_versions = 0


class _Simulator:
    def __init__(self, schedule, num_stages, m, steps, costs, p2p_latency, record_timeline):
        self.schedule = schedule
        self.n = num_stages
        self.m = m
        self.calls = steps
        self.forward_cost, self.backward_cost, self.wgrad_cost, self.step_cost = costs
        self.latency = p2p_latency
        self.stages = [_Stage(s) for s in range(num_stages)]
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.timeline: list[TraceEvent] | None = [] if record_timeline else None
        self.busy_intervals: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]
        if schedule.splits_backward:
            self.full_backward_cost = self.backward_cost
        else:
            self.full_backward_cost = [b + w for b, w in zip(self.backward_cost, self.wgrad_cost)]

    # -- events -----------------------------------------------------------------------------

    def push(self, time: float, kind: int, stage: int, microbatch: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, stage, microbatch))

    def run(self) -> None:
        dirty = set(range(self.n))
        while True:
            for s in sorted(dirty):
                self.decide(self.stages[s])
            dirty.clear()
            if not self.events:
                break
            self.now = self.events[0][0]
            while self.events and self.events[0][0] <= self.now:
                _, _, kind, s, _ = heapq.heappop(self.events)
                if self.apply(kind, self.stages[s]):
                    dirty.add(s)
        unfinished = [st for st in self.stages if not st.finished]
        if unfinished:
            states = "; ".join(self.describe(st) for st in unfinished)
            raise SimulationError(f"{self.schedule.name}: deadlock at t={self.now:g}: {states}")

    def describe(self, st: _Stage) -> str:
        state = "blocked on " + str(st.blocked) if st.blocked else "waiting"
        counters = f"F={st.forwards} B={st.backwards} W={st.weight_grads} S={st.steps}"
        return f"stage {st.index} call {st.call} {counters} {state}"

    def apply(self, kind: int, st: _Stage) -> bool:
        """Apply one event; True when the stage must decide again."""
        if kind == _FINISH:
            self.finish(st)
            return True
        if kind == _ACTIVATION:
            st.activations_arrived += 1
        else:
            st.gradients_arrived += 1
        if st.blocked is not None and self.input_ready(st, st.blocked):
            action, st.blocked = st.blocked, None
            self.start(st, action)
            return False
        if st.waiting:
            st.waiting = False
            return True
        return False

    # -- decisions --------------------------------------------------------------------------

    def view(self, st: _Stage) -> StageView:
        last = st.index == self.n - 1
        return StageView(
            stage=st.index,
            num_stages=self.n,
            microbatches_per_step=self.m,
            forwards=st.forwards,
            backwards=st.backwards,
            steps=st.steps,
            forward_limit=self.calls * self.m,
            backward_target=st.call * self.m,
            input_ready=st.index == 0 or st.activations_arrived > st.forwards,
            grad_ready=(
                (st.forwards > st.backwards) if last else st.gradients_arrived > st.backwards
            ),
            weight_grads=st.weight_grads,
        )

    def input_ready(self, st: _Stage, action: Action) -> bool:
        if action.kind is ActionKind.FORWARD:
            return st.index == 0 or st.activations_arrived > st.forwards
        if st.index == self.n - 1:
            return True
        return st.gradients_arrived > st.backwards

    def decide(self, st: _Stage) -> None:
        """Ask the schedule what an idle stage does next, until it starts, blocks or waits."""
        while not (st.finished or st.busy or st.blocked or st.waiting):
            action = self.schedule.next_action(self.view(st))
            kind = action.kind
            if kind is ActionKind.DONE:
                st.call_ends.append(self.now)
                st.call += 1
                st.finished = st.call > self.calls
            elif kind is ActionKind.WAIT:
                st.waiting = True
            else:
                self.check(st, action)
                if kind in (ActionKind.FORWARD, ActionKind.BACKWARD) and not self.input_ready(
                    st, action
                ):
                    st.blocked = action
                else:
                    self.start(st, action)

    def check(self, st: _Stage, action: Action) -> None:
        """Reject actions no runtime could carry out."""
        kind, mb = action.kind, action.microbatch
        problem = None
        if kind is ActionKind.FORWARD:
            if mb != st.forwards:
                problem = f"names microbatch {mb}, the stage's next forward is {st.forwards}"
            elif st.forwards >= self.calls * self.m:
                problem = "forwards past the end of the data"
        elif kind is ActionKind.BACKWARD:
            if mb != st.backwards:
                problem = f"names microbatch {mb}, the stage's next backward is {st.backwards}"
            elif st.backwards >= st.forwards:
                problem = "backwards a microbatch that was not forwarded"
        elif kind is ActionKind.WEIGHT_GRAD:
            if not self.schedule.splits_backward or mb != st.weight_grads:
                problem = f"names weight gradient {mb}, the stage's next is {st.weight_grads}"
            elif st.weight_grads >= st.backwards:
                problem = "computes a weight gradient before its input gradient"
        elif kind is not ActionKind.STEP:
            problem = "is not an action the simulator knows"
        if problem:
            raise SimulationError(f"{self.schedule.name}: stage {st.index}: {action} {problem}")

    # -- execution --------------------------------------------------------------------------

    def start(self, st: _Stage, action: Action) -> None:
        s, kind = st.index, action.kind
        if kind is ActionKind.FORWARD:
            cost = self.forward_cost[s]
            self.on_forward(st, action.microbatch)
        elif kind is ActionKind.BACKWARD:
            cost = self.full_backward_cost[s]
            self.on_backward(st, action.microbatch)
        elif kind is ActionKind.WEIGHT_GRAD:
            cost = self.wgrad_cost[s]
        else:
            cost = self.step_cost[s]
            self.on_step(st)
        st.busy = True
        st.current = (action, self.now)
        self.push(self.now + cost, _FINISH, s)

    def finish(self, st: _Stage) -> None:
        action, start = st.current
        st.busy, st.current = False, None
        st.busy_time += self.now - start
        self.busy_intervals[st.index].append((start, self.now))
        if self.timeline is not None:
            self.timeline.append(TraceEvent(st.index, action, start, self.now))
        kind, mb = action.kind, action.microbatch
        if kind is ActionKind.FORWARD:
            st.forwards += 1
            if st.index < self.n - 1:
                self.push(self.now + self.latency, _ACTIVATION, st.index + 1, mb)
        elif kind is ActionKind.BACKWARD:
            st.backwards += 1
            if st.index > 0:
                self.push(self.now + self.latency, _GRADIENT, st.index - 1, mb)
            if not self.schedule.splits_backward:
                self.gradient_done(st, mb)
        elif kind is ActionKind.WEIGHT_GRAD:
            st.weight_grads += 1
            self.gradient_done(st, mb)
        else:
            st.steps += 1
            self.count_versions(st)

    # -- versions, drift, delay ---------------------------------------------------------------

    def on_forward(self, st: _Stage, mb: int) -> None:
        st.peak_inflight = max(st.peak_inflight, st.forwards + 1 - st.backwards)
        version = st.steps
        pinned = self.schedule.forward_weight_version
        if pinned is not None:
            version = pinned(mb, self.m, st.steps)
            if version > st.steps:
                raise SimulationError(
                    f"{self.schedule.name}: stage {st.index}: forward {mb} needs weight version "
                    f"{version}, only {st.steps} exist"
                )
        st.forward_version[mb] = version
        if self.schedule.stashes_weights:
            st.stash[version] = st.stash.get(version, 0) + 1
            self.count_versions(st)

    def on_backward(self, st: _Stage, mb: int) -> None:
        fwd = st.forward_version[mb]
        drift = 0 if self.schedule.stashes_weights else st.steps - fwd
        st.max_drift = max(st.max_drift, drift)
        st.drift_sum += drift
        st.drift_count += 1

    def gradient_done(self, st: _Stage, mb: int) -> None:
        """The microbatch's weight gradient is accumulated: it waits for the next step."""
        version = st.forward_version.pop(mb)
        st.pending_grads.append(version)
        if self.schedule.stashes_weights:
            st.stash[version] -= 1
            if not st.stash[version]:
                del st.stash[version]

    def on_step(self, st: _Stage) -> None:
        for version in st.pending_grads:
            st.max_delay = max(st.max_delay, st.steps - version)
        st.pending_grads.clear()

    def count_versions(self, st: _Stage) -> None:
        if self.schedule.stashes_weights:
            versions = len(st.stash) + (0 if st.steps in st.stash else 1)
            st.peak_extra_versions = max(st.peak_extra_versions, versions - 1)

    # -- results ------------------------------------------------------------------------------

    def steady_utilization(self) -> list[float] | None:
        """Per stage, the busy fraction over the middle half of its calls (none when < 3)."""
        if self.calls < 3:
            return None
        skip = max(1, self.calls // 4)
        result = []
        for st, intervals in zip(self.stages, self.busy_intervals):
            lo, hi = st.call_ends[skip - 1], st.call_ends[self.calls - skip - 1]
            if hi <= lo:
                return None
            busy = sum(max(0.0, min(e, hi) - max(b, lo)) for b, e in intervals)
            result.append(busy / (hi - lo))
        return result

    def result(self) -> SimulationResult:
        n, stages = self.n, self.stages
        makespan = max((max(st.call_ends) for st in stages), default=0.0)
        busy = [st.busy_time for st in stages]
        util = [b / makespan if makespan > 0 else 1.0 for b in busy]
        mean_util = sum(util) / n
        steady = self.steady_utilization()
        total = self.calls * self.m
        return SimulationResult(
            schedule=self.schedule.name,
            num_stages=n,
            microbatches_per_step=self.m,
            steps=self.calls,
            makespan=makespan,
            busy_per_stage=busy,
            utilization=util,
            mean_utilization=mean_util,
            bubble_fraction=1.0 - mean_util,
            steady_utilization=steady,
            steady_bubble_fraction=None if steady is None else 1.0 - sum(steady) / n,
            idle_per_step=[(makespan - b) / self.calls for b in busy],
            throughput_vs_ideal=max(busy) / makespan if makespan > 0 else 1.0,
            microbatches_per_second=total / makespan if makespan > 0 else math.inf,
            max_drift_per_stage=[st.max_drift for st in stages],
            mean_drift_per_stage=[st.drift_sum / max(st.drift_count, 1) for st in stages],
            max_gradient_delay_per_stage=[st.max_delay for st in stages],
            peak_inflight_per_stage=[st.peak_inflight for st in stages],
            extra_weight_versions=[self.schedule.extra_weight_versions(s, n) for s in range(n)],
            measured_extra_weight_versions=[st.peak_extra_versions for st in stages],
            optimizer_steps_per_stage=[st.steps for st in stages],
            timeline=self.timeline or [],
        )


@dataclass(frozen=True)
class StageCosts:
    """Per-stage durations (seconds) of one forward, backward, weight-gradient pass and step."""

    forward: list[float]
    backward: list[float]
    weight_grad: list[float]
    step: list[float]
    p2p_latency: float | None = None  # from the calibration, when it measured one

    def simulate_kwargs(self) -> dict:
        """The cost keywords of `simulate` (latency excluded)."""
        return {
            "forward_cost": self.forward,
            "backward_cost": self.backward,
            "weight_grad_cost": self.weight_grad,
            "step_cost": self.step,
        }


_COST_KEYS = ("forward_s", "backward_s", "weight_grad_s", "step_s")


def _cost_entry(entry, where: str) -> tuple[float, float, float, float]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with forward_s and backward_s")
    unknown = sorted(set(entry) - set(_COST_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {list(_COST_KEYS)})")
    values = []
    for key in _COST_KEYS:
        if key not in entry and key in ("forward_s", "backward_s"):
            raise ValueError(f"{where}: missing {key}")
        value = entry.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}.{key}: expected a number of seconds, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
        values.append(float(value))
    return tuple(values)


def _select_profile(data, micro_batch_size: int | None) -> tuple[dict, str]:
    if not isinstance(data, dict):
        raise ValueError("calibration: expected a JSON object")
    if "profiles" not in data:
        return data, "calibration"
    profiles = data["profiles"]
    if not isinstance(profiles, list) or not profiles:
        raise ValueError("calibration.profiles: expected a non-empty list")
    if micro_batch_size is None:
        if len(profiles) == 1:
            return profiles[0], "calibration.profiles[0]"
        sizes = [p.get("micro_batch_size") for p in profiles if isinstance(p, dict)]
        raise ValueError(f"calibration has profiles for micro-batch sizes {sizes}: choose one")
    for i, profile in enumerate(profiles):
        if isinstance(profile, dict) and profile.get("micro_batch_size") == micro_batch_size:
            return profile, f"calibration.profiles[{i}]"
    raise ValueError(f"calibration has no profile for micro-batch size {micro_batch_size}")


def _layer_costs(profile: dict, where: str) -> list[tuple[float, float, float, float]]:
    if "layers" in profile:
        layers = profile["layers"]
        if not isinstance(layers, list) or not layers:
            raise ValueError(f"{where}.layers: expected a non-empty list")
        return [_cost_entry(e, f"{where}.layers[{i}]") for i, e in enumerate(layers)]
    count = profile.get("num_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}: 'layer' needs 'num_layers', a positive integer")
    return [_cost_entry(profile["layer"], f"{where}.layer")] * count


def stage_costs_from_calibration(
    data: dict, num_stages: int, micro_batch_size: int | None = None
) -> StageCosts:
    """Per-stage costs from a calibration object (the format of `tools/simulate_pipeline.py`).

    A profile gives either ``stages`` (one cost entry per pipeline stage) or per-layer costs
    (``layers``: one entry per layer, or ``layer`` + ``num_layers``), which are split into
    equal contiguous blocks, plus optional ``embedding`` (added to the first stage) and
    ``output`` (output layer and loss, added to the last). A cost entry has ``forward_s``,
    ``backward_s`` and optional ``weight_grad_s`` and ``step_s``. ``profiles`` holds one
    profile per micro-batch size. Raises ValueError naming the offending field.
    """
    profile, where = _select_profile(data, micro_batch_size)
    if not isinstance(profile, dict):
        raise ValueError(f"{where}: expected an object")
    forms = [key for key in ("stages", "layers", "layer") if key in profile]
    if len(forms) != 1:
        raise ValueError(f"{where}: give exactly one of 'stages', 'layers' or 'layer'")
    if forms[0] == "stages":
        stages = profile["stages"]
        if not isinstance(stages, list) or len(stages) != num_stages:
            got = len(stages) if isinstance(stages, list) else stages
            raise ValueError(f"{where}.stages: {got} entries for {num_stages} stages")
        per_stage = [list(_cost_entry(e, f"{where}.stages[{i}]")) for i, e in enumerate(stages)]
    else:
        layers = _layer_costs(profile, where)
        if len(layers) % num_stages:
            raise ValueError(
                f"{where}: {len(layers)} layers do not split evenly into {num_stages} stages"
            )
        size = len(layers) // num_stages
        per_stage = [
            [sum(values) for values in zip(*layers[s * size : (s + 1) * size])]
            for s in range(num_stages)
        ]
    for key, stage in (("embedding", 0), ("output", num_stages - 1)):
        if key in profile:
            extra = _cost_entry(profile[key], f"{where}.{key}")
            per_stage[stage] = [a + b for a, b in zip(per_stage[stage], extra)]
    latency = profile.get("p2p_s", data.get("p2p_s"))
    if latency is not None and (
        isinstance(latency, bool)
        or not isinstance(latency, (int, float))
        or not math.isfinite(latency)
        or latency < 0
    ):
        raise ValueError(f"{where}.p2p_s: expected a finite number >= 0, got {latency!r}")
    columns = [list(c) for c in zip(*per_stage)]
    return StageCosts(*columns, p2p_latency=None if latency is None else float(latency))


def simulate(
    schedule: Schedule,
    *,
    num_stages: int,
    microbatches_per_step: int,
    steps: int,
    forward_cost: float | Sequence[float],
    backward_cost: float | Sequence[float],
    weight_grad_cost: float | Sequence[float] = 0.0,
    step_cost: float | Sequence[float] = 0.0,
    p2p_latency: float = 0.0,
    record_timeline: bool = True,
) -> SimulationResult:
    """Run `steps` calls of `schedule` on `num_stages` stages and measure the run.

    Costs are durations in any unit (seconds for the CLI and the runtime's traces), one per
    stage or one number for all. `microbatches_per_step` is m for flush schedules and the
    accumulation factor a for PACI. Raises ValueError for bad arguments and `SimulationError`
    when the schedule deadlocks or asks for an impossible action.
    """
    counts = {"num_stages": num_stages, "microbatches_per_step": microbatches_per_step}
    for name, value in {**counts, "steps": steps}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    least = schedule.min_microbatches_per_step(num_stages)
    if microbatches_per_step < least:
        raise ValueError(
            f"{schedule.name} needs at least {least} microbatches per step on {num_stages} "
            f"stages, got {microbatches_per_step}"
        )
    if not math.isfinite(p2p_latency) or p2p_latency < 0:
        raise ValueError(f"p2p_latency must be finite and >= 0, got {p2p_latency}")
    costs = tuple(
        _per_stage(name, value, num_stages)
        for name, value in (
            ("forward_cost", forward_cost),
            ("backward_cost", backward_cost),
            ("weight_grad_cost", weight_grad_cost),
            ("step_cost", step_cost),
        )
    )
    latency = float(p2p_latency)
    sim = _Simulator(
        schedule, num_stages, microbatches_per_step, steps, costs, latency, record_timeline
    )
    sim.run()
    return sim.result()
