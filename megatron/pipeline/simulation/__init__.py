"""The simulator core: schedules run against a clock (no tensors, no processes).

* `engine`: the discrete-event engine (`simulate`), driving the runtime's own schedules;
* `results`: `SimulationResult` and the one definition of steady-state throughput, which reads a
  simulated timeline and a real run's trace alike;
* `costs`: `StageCosts`, per-stage durations; `CostNoise`, seeded per-action lognormal noise;
* `phases`: a run of several accumulation phases, simulated phase by phase.

Benchmarks, projections and reports built on it live in `megatron.benchmarks`."""

from .costs import StageCosts
from .engine import SimulationError, simulate
from .results import SimulationResult, steady_state_throughput

__all__ = [
    "SimulationError",
    "SimulationResult",
    "StageCosts",
    "simulate",
    "steady_state_throughput",
]
