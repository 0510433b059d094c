"""Wiring a rank into the pipeline from megatron-core's `parallel_state` groups."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .runtime import PipelineContext
from .transport import LaneLinks, VocabLinks


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


def build_pipeline_context(
    device: torch.device, *, decide_per_stage: bool = False
) -> PipelineContext:
    """Collective over the world: creates the gradient and decision groups. A schedule that
    reacts to arrivals decides on one rank for its tensor-parallel peers, which must run the
    same actions; with `decide_per_stage` for every rank of the stage (its TP x DP ranks: what
    expert-parallel all-to-alls across data-parallel replicas need)."""
    ps = parallel_state
    backend = dist.get_backend()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    deciders = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    if decide_per_stage:
        deciders = sorted(ranks_of_my_stage())
    # A second communicator between the same ranks, so gradients never queue behind activations.
    gradient_group = _new_groups(pp_ranks, backend=None)
    decision_group = _new_groups(deciders, backend="gloo") if len(deciders) > 1 else None
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
        decision_leader=min(deciders),
        is_decision_leader=dist.get_rank() == min(deciders),
    )


def build_lane_links(placement) -> list[LaneLinks]:
    """Collective over the world: the streams of this rank's model chunks under `placement`
    (interleaved or V). A stream is named by its direction, the chunk that receives it and
    the sender's offset in ranks from the receiver; each such family gets its own process
    group, so a group never carries two streams between the same two ranks in one direction
    (activations into chunk c from rank r - 1 and, wrapping around, from rank N - 1 to rank 0
    travel on different groups). A hop between two chunks of one rank (the V's turn) is a
    loopback and needs no group."""
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    rank = parallel_state.get_pipeline_model_parallel_rank()
    families = sorted(_stream_families(placement))
    groups = {family: _new_groups(pp_ranks, backend=None) for family in families}
    links = []
    for chunk in range(placement.chunks_per_rank):
        stage = placement.virtual_stage(rank, chunk)
        lane = LaneLinks()
        if stage > 0:
            peer, peer_chunk = placement.locate(stage - 1)
            lane.input_peer = lane.grad_out_peer = pp_ranks[peer]
            lane.input_group = groups.get(("activation", chunk, peer - rank))
            lane.grad_out_group = groups.get(("gradient", peer_chunk, rank - peer))
        if stage < placement.num_virtual_stages - 1:
            peer, peer_chunk = placement.locate(stage + 1)
            lane.output_peer = lane.grad_in_peer = pp_ranks[peer]
            lane.output_group = groups.get(("activation", peer_chunk, rank - peer))
            lane.grad_in_group = groups.get(("gradient", chunk, peer - rank))
        links.append(lane)
    return links


def _stream_families(placement) -> set[tuple[str, int, int]]:
    """(direction, receiving chunk, sender rank - receiver rank) of every stream between two
    different ranks of `placement`."""
    families = set()
    for stage in range(placement.num_virtual_stages - 1):
        (sender, sender_chunk), (receiver, receiver_chunk) = (
            placement.locate(stage),
            placement.locate(stage + 1),
        )
        if sender != receiver:
            families.add(("activation", receiver_chunk, sender - receiver))
            families.add(("gradient", sender_chunk, receiver - sender))
    return families


def ranks_of_my_stage() -> set[int]:
    """Global ranks that hold the same pipeline stage as this rank (its TP x DP ranks)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parallel_state.get_pipeline_model_parallel_rank())
    mine = parallel_state.get_pipeline_model_parallel_rank()
    return {rank for rank, stage in enumerate(gathered) if stage == mine}


def build_vocab_links(tree_arity: int = 2) -> VocabLinks:
    """Collective over the world: the groups of the vocabulary streams between the last stage
    and every stage (--enable-vocab-parallel), three communicators over the pipeline's ranks;
    the output layer's messages on a tree of `tree_arity` (--vocab-parallel-tree-arity)."""
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    hidden_group = _new_groups(pp_ranks, backend=None)
    stats_group = _new_groups(pp_ranks, backend=None)
    embed_group = _new_groups(pp_ranks, backend=None)
    return VocabLinks(tuple(pp_ranks), hidden_group, stats_group, embed_group, tree_arity)
