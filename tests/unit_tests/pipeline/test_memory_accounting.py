"""Real peak memory of the process (reset after set-up) and the saved-tensor meter."""

import os

import pytest
import torch

from megatron.pipeline.accounting import ProcessPeakMemory, SavedTensorMeter

MiB = 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_rss_is_reset_and_sees_a_freed_allocation():
    """After the reset the peak starts at the current resident set; a 64 MiB tensor written
    and freed again still shows in the peak, and the lifetime peak is at least as high."""
    memory = ProcessPeakMemory(torch.device("cpu"))
    memory.reset()
    start = memory.report()
    assert start["real_peak_kind"] == "rss"
    assert start["peak_rss_bytes"] - start["baseline_rss_bytes"] < 16 * MiB
    block = torch.ones(64 * MiB // 4)  # written, so resident
    del block
    after = memory.report()
    assert after["real_peak_bytes"] == after["peak_rss_bytes"]
    assert after["peak_rss_bytes"] >= start["baseline_rss_bytes"] + 60 * MiB
    assert after["lifetime_peak_rss_bytes"] >= after["peak_rss_bytes"] - MiB


def test_meter_counts_saved_storages_once_and_not_parameters():
    weight = torch.nn.Parameter(torch.randn(32, 32))
    x = torch.randn(8, 32, requires_grad=True)
    with SavedTensorMeter([weight]).measure() as saved:
        hidden = x @ weight  # saves x and weight (a parameter: not counted)
        torch.tanh(hidden).sum()  # saves tanh's output
    assert saved[0] == x.numel() * 4 + hidden.numel() * 4


def test_meter_does_not_count_storages_freed_during_the_forward():
    """megatron-core's output-discarding checkpoints free a saved storage before the forward
    ends; the meter adds up the storages when the forward ends."""
    x = torch.randn(8, 32, requires_grad=True)
    with SavedTensorMeter([]).measure() as saved:
        y = x * 2.0
        z = torch.tanh(y)  # saves z
        z.untyped_storage().resize_(0)
    assert saved[0] == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_freed_tensors_leave_the_resident_set_on_cpu():
    """With malloc's mmap threshold fixed, 8 MiB tensors (below glibc's dynamic 32 MiB limit,
    so heap blocks by default once one was freed) go back to the system when freed."""
    from megatron.training.host_memory import unmap_large_blocks_when_freed

    assert not unmap_large_blocks_when_freed(torch.device("meta"))
    assert not unmap_large_blocks_when_freed(torch.device("cpu"), threshold_kib=0)  # glibc's
    assert unmap_large_blocks_when_freed(torch.device("cpu"))
    memory = ProcessPeakMemory(torch.device("cpu"))
    memory.reset()
    blocks = [torch.ones(8 * MiB // 4) for _ in range(8)]
    held = memory.report()["peak_rss_bytes"] - memory.baseline_rss
    del blocks
    from megatron.pipeline.accounting import _resident_bytes

    # 64 MiB touched; under memory pressure the kernel may page some out, hence the margin
    assert held >= 32 * MiB
    assert _resident_bytes() - memory.baseline_rss < 8 * MiB
