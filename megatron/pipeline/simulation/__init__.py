"""Simulation, calibration and projection of pipeline schedules (no tensors, no processes).

* `engine`: the discrete-event engine (`simulate`), driving the runtime's own schedules;
* `results`: `SimulationResult` and the one definition of steady-state throughput, which reads a
  simulated timeline and a real run's trace alike;
* `costs`: `StageCosts`, per-stage durations; `CostNoise`, seeded per-action lognormal noise;
* `calibration`: the calibration file format, its reader and its writer;
* `projection`: the cost model and the paper-scale projection;
* `emulated_benchmark`: real runs with emulated compute against the simulator's prediction;
  `runtime_comparison`: every runtime schedule measured side by side on one model's costs;
* `arrival_study`: PACI's arrival rules on uneven and noisy stages;
* `real_compute`: real GPT runs on 2 stages, flush vs PACI, and the balancing split.
"""

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
