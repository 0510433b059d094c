"""Host memory: keep large freed blocks out of glibc's heap on CPU runs.

glibc's malloc serves a block below its mmap threshold from its heap and, when the block is
freed, keeps the pages (they are reused for later blocks, but stay resident). By default the
threshold is dynamic: every freed mmapped block raises it to that block's size, up to 32 MiB,
so after the first iterations nearly every activation and temporary tensor lives in the heap.
The resident set then follows the heap's extent, which depends on the order of allocations and
frees (fragmentation), not on what is live: measured on a 4-stage CPU run (docs/memory.md), the
heap held 250-800 MiB of free blocks on a stage whose live peak was 850 MiB, and two schedules
with the same live peak differed by up to 6% in resident set.

A fixed threshold (glibc's initial 128 KiB, no longer raised) maps every larger block on its
own and unmaps it when freed: the resident set follows live memory. The price is a page fault
per first touch of such a block (measured in docs/memory.md).
"""

import ctypes

import torch

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
FIXED_MMAP_THRESHOLD_BYTES = 128 * 1024


def unmap_large_blocks_when_freed(device: torch.device) -> bool:
    """On a CPU run under glibc, fix malloc's mmap threshold. Returns whether it was set (not
    on CUDA, where activations are device memory, nor without glibc's `mallopt`)."""
    if device.type != "cpu":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD_BYTES) == 1
