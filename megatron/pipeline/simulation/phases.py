"""A run whose microbatches per step change at drain points (`--paci-accumulation-schedule`).

Each phase (a, steps) starts from an empty pipeline and ends drained, as the training loop
makes it: the phase's last call gets `microbatches_before_drain` equal to its own count. The
first stage runs the last backward of a drained phase and the first forward of the next, so
with no step cost the run's time is the sum of the phases' makespans.
"""

from dataclasses import dataclass

from ..schedules.base import Schedule
from .engine import simulate
from .results import SimulationResult


@dataclass
class PhasedRun:
    phases: list[tuple[int, int]]  # (a, steps)
    results: list[SimulationResult]  # one per phase

    @property
    def makespan(self) -> float:
        return sum(result.makespan for result in self.results)

    @property
    def microbatches(self) -> int:
        return sum(a * steps for a, steps in self.phases)

    @property
    def microbatches_per_time(self) -> float:
        return self.microbatches / self.makespan


def simulate_phases(
    schedule: Schedule, *, num_stages: int, phases: list[tuple[int, int]], **costs
) -> PhasedRun:
    """Simulate each (a, steps) phase from an empty pipeline; `costs` as `simulate`'s."""
    results = [
        simulate(schedule, num_stages=num_stages, microbatches_per_step=a, steps=steps, **costs)
        for a, steps in phases
    ]
    return PhasedRun(list(phases), results)
