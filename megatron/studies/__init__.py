"""Studies and measurements that tools/ run (delay, memory, calibration); not imported by training."""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
