"""One gloo transport device per process, shared by every gloo process group.

torch gives each gloo group a transport device of its own, and each device an event-loop
thread. megatron-core creates about sixty groups a run (most of them never used on a CPU run):
a process then holds ~180 threads, and the idle loops alone took ~5% of a core a process
(measured: 60 idle groups, 0.23 CPU-seconds in 5 s; 0.01 on one shared device). Inside
`shared_gloo_device()` new gloo groups share one device, one loop thread, as gloo's own
programs do; what each group sends and the order of its operations do not change.
"""

import contextlib
import os

import torch.distributed.distributed_c10d as c10d

_UNSHARED = getattr(c10d, "ProcessGroupGloo", None)  # torch's class; None without gloo
_DEVICES: dict[int, list] = {}  # pid -> the devices (a forked child builds its own)


def _devices() -> list:
    """The process's devices, made as torch makes a group's: one per GLOO_SOCKET_IFNAME
    interface, else the one the host name resolves to."""
    pid = os.getpid()
    if pid not in _DEVICES:
        interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
        _DEVICES[pid] = (
            [_UNSHARED.create_device(interface=name) for name in interfaces]
            if interfaces
            else [_UNSHARED.create_default_device()]
        )
    return _DEVICES[pid]


if _UNSHARED is not None:

    class _SharedDeviceGloo(_UNSHARED):
        """torch's ProcessGroupGloo on the process's shared devices."""

        def __init__(self, store, rank, size, timeout=None):
            options = _UNSHARED._Options()
            if timeout is not None:
                options._timeout = timeout
            options._devices = _devices()
            options._threads = 2 * len(options._devices)  # torch's default
            super().__init__(store, rank, size, options)


@contextlib.contextmanager
def shared_gloo_device():
    """Gloo groups created inside share the process's transport device."""
    if _UNSHARED is None or c10d.ProcessGroupGloo is not _UNSHARED:  # no gloo, or nested
        yield
        return
    c10d.ProcessGroupGloo = _SharedDeviceGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = _UNSHARED
