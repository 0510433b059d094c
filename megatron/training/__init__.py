"""The training library: the loop, its flags, the model stage, run control and reporting."""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
