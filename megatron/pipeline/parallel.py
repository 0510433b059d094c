"""Wiring a rank into the pipeline from megatron-core's `parallel_state` groups."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .chunked_runtime import ChunkChannels
from .runtime import PipelineContext


def _all_groups(my_ranks: list[int]) -> list[list[int]]:
    """Every rank's group of one kind, deduplicated, in the same order on every rank
    (`new_group` must be called collectively, in the same order, by all ranks)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(my_ranks))
    return sorted({tuple(ranks) for ranks in gathered})


def _new_groups(my_ranks: list[int], backend: str | None):
    mine = None
    for ranks in _all_groups(my_ranks):
        group = dist.new_group(list(ranks), backend=backend)
        if rank_in(ranks):
            mine = group
    return mine


def rank_in(ranks) -> bool:
    return dist.get_rank() in ranks


def build_pipeline_context(device: torch.device) -> PipelineContext:
    """Collective over the world: creates the gradient and decision groups."""
    ps = parallel_state
    backend = dist.get_backend()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    tp_ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    # A second communicator between the same ranks, so gradients never queue behind activations.
    gradient_group = _new_groups(pp_ranks, backend=None)
    decision_group = _new_groups(tp_ranks, backend="gloo") if len(tp_ranks) > 1 else None
    stage, num_stages = ps.get_pipeline_model_parallel_rank(), len(pp_ranks)
    return PipelineContext(
        stage=stage,
        num_stages=num_stages,
        device=device,
        backend=backend,
        activation_group=pp_group,
        gradient_group=gradient_group,
        prev_rank=pp_ranks[stage - 1] if stage > 0 else None,
        next_rank=pp_ranks[stage + 1] if stage < num_stages - 1 else None,
        decision_group=decision_group,
        decision_leader=min(tp_ranks),
        is_decision_leader=dist.get_rank() == min(tp_ranks),
    )


def build_chunk_channels(placement) -> list[ChunkChannels]:
    """Collective over the world: the streams of this rank's model chunks (`placement`, the
    interleaved one). Activations into chunk c come on one group per c for the hops between
    ranks r - 1 -> r and on another for the wrap-around N - 1 -> 0 (chunk c - 1 -> c), so a
    group never carries two streams between the same two ranks; gradients the same way back.
    """
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    rank, n = parallel_state.get_pipeline_model_parallel_rank(), placement.num_ranks
    v, last = placement.chunks_per_rank, placement.num_virtual_stages - 1
    groups = {}  # (direction, receiving chunk, wrap) -> group
    for direction in ("activation", "gradient"):
        for chunk in range(v):
            for wrap in (False, True):
                # nothing wraps into the first chunk's input or the last chunk's gradient
                if wrap and chunk == (0 if direction == "activation" else v - 1):
                    continue
                groups[(direction, chunk, wrap)] = _new_groups(pp_ranks, backend=None)
    channels = []
    for chunk in range(v):
        stage = placement.virtual_stage(rank, chunk)
        links = ChunkChannels()
        if stage > 0:
            peer, _ = placement.locate(stage - 1)
            links.input_peer = pp_ranks[peer]
            links.input_group = groups[("activation", chunk, rank == 0)]
            links.grad_out_peer = pp_ranks[peer]
            links.grad_out_group = groups[("gradient", placement.locate(stage - 1)[1], rank == 0)]
        if stage < last:
            peer, next_chunk = placement.locate(stage + 1)
            links.output_peer = pp_ranks[peer]
            links.output_group = groups[("activation", next_chunk, rank == n - 1)]
            links.grad_in_peer = pp_ranks[peer]
            links.grad_in_group = groups[("gradient", chunk, rank == n - 1)]
        channels.append(links)
    return channels


def ranks_of_my_stage() -> set[int]:
    """Global ranks that hold the same pipeline stage as this rank (its TP x DP ranks)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parallel_state.get_pipeline_model_parallel_rank())
    mine = parallel_state.get_pipeline_model_parallel_rank()
    return {rank for rank, stage in enumerate(gathered) if stage == mine}
