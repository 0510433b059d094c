"""The pipeline: schedules as data, the runtime that executes them, and the simulator."""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
