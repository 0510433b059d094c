"""The pipeline: schedules as data, the runtime that executes them, and the simulator."""
