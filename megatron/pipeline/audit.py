"""Records collectives whose group spans more than one pipeline stage.

PACI promises no global synchronization while training: collectives stay inside a stage
(tensor- and data-parallel groups); only point-to-point messages cross stages. This audit
wraps torch.distributed's collectives and records every call whose group reaches a rank of
another stage. The training loop turns it on around the training iterations when the
environment variable MEGATRON_AUDIT_COLLECTIVES=1 is set (tests do), and reports the count.
"""

import contextlib
import functools
import inspect
import os

import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)


def audit_requested() -> bool:
    return os.environ.get("MEGATRON_AUDIT_COLLECTIVES") == "1"


class CollectiveAudit:
    """Offending calls so far, as (collective name, group ranks); `paused()` exempts work done
    at drained points (a checkpoint's barrier is not a training step)."""

    def __init__(self):
        self.violations: list[tuple[str, list[int]]] = []
        self.active = True

    @contextlib.contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True


@contextlib.contextmanager
def record_cross_stage_collectives(stage_ranks: set[int]):
    """Yields a `CollectiveAudit` recording collectives whose group leaves `stage_ranks`."""
    audit = CollectiveAudit()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def audited(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            ranks = (
                list(range(dist.get_world_size()))
                if group is None
                else dist.get_process_group_ranks(group)
            )
            if audit.active and not set(ranks) <= stage_ranks:
                audit.violations.append((name, ranks))
            return function(*args, **kwargs)

        return audited

    for name, function in originals.items():
        setattr(dist, name, wrap(name, function))
    try:
        yield audit
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
