import socket

import pytest


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = 1), for tests
    that build model pieces in process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():  # left by an earlier in-process run (delayed_reference.py)
        assert dist.get_world_size() == 1
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
