"""Host memory: keep large freed blocks out of glibc's heap on CPU runs.

glibc's malloc serves a block below its mmap threshold from its heap and, when the block is
freed, keeps the pages (they are reused for later blocks, but stay resident). By default the
threshold is dynamic: every freed mmapped block raises it to that block's size, up to 32 MiB,
so after the first iterations nearly every activation and temporary tensor lives in the heap.
The resident set then follows the heap's extent, which depends on the order of allocations and
frees (fragmentation), not on what is live: measured on a 4-stage CPU run (docs/memory_report.md), the
heap held 250-800 MiB of free blocks on a stage whose live peak was 850 MiB, and two schedules
with the same live peak differed by up to 6% in resident set.

A fixed threshold (glibc's initial 128 KiB, no longer raised) maps every larger block on its
own and unmaps it when freed: the resident set follows live memory. The price is a page fault
per first touch of every page of such a block: on the 2-stage benchmark model (8 layers, hidden
128) 1.12-1.21 s per iteration against 0.82-0.87 s with glibc's dynamic threshold, four times
the system time (docs/memory_report.md). `--cpu-mmap-threshold-kib 0` keeps glibc's default (speed
benchmarks do); a run that reports memory keeps the fixed one.
"""

import ctypes

import torch

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
DEFAULT_THRESHOLD_KIB = 128  # glibc's initial threshold, before it starts raising it


def unmap_large_blocks_when_freed(
    device: torch.device, threshold_kib: int = DEFAULT_THRESHOLD_KIB
) -> bool:
    """On a CPU run under glibc, fix malloc's mmap threshold at `threshold_kib` (0: leave
    glibc's dynamic threshold). Returns whether it was set (not on CUDA, where activations are
    device memory, nor without glibc's `mallopt`)."""
    if device.type != "cpu" or threshold_kib == 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold_kib * 1024) == 1
