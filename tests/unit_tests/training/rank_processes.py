"""A unit test's ranks as processes forked from one fork server per pytest process, which has
imported torch and megatron-core once: a spawned rank imported them itself, the most of its
CPU time in these tests. The server is forked from nothing of the test process (no threads,
no torch state), as a spawned rank was; the rank function and its arguments travel pickled as
with spawn."""

import multiprocessing

import torch.multiprocessing

# What every rank of these tests imports: loaded once into the server.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.training.optimizer.build",
    "megatron.training.reporting",
    "megatron.distributed.context_parallel.attention",
]


def start_ranks(function, args: tuple, nprocs: int) -> None:
    """Run `function(rank, *args)` in `nprocs` processes and wait for them (an exception in any
    fails the call, as torch.multiprocessing.spawn does)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    torch.multiprocessing.start_processes(
        function, args=args, nprocs=nprocs, join=True, start_method="forkserver"
    )
