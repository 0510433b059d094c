"""Parallelisms apart from the pipeline, one file or folder each: fully sharded data parallelism
(`fsdp.py`, its flags in `fsdp_flags.py`) and context parallelism (`context_parallel/`: ring,
all-gather and all-to-all attention). Imports only megatron.common and megatron.pipeline."""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
