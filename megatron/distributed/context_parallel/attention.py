"""Which context-parallel attention a layer runs (`--cp-comm-type`, one type or one per layer)
and over which process groups (megatron-core's context-parallel group; for `a2a+p2p` its
hierarchical groups, --hierarchical-context-parallel-sizes A B: the all-to-all inside groups
of A, the ring between them).

* `p2p`: the ring (ring_attention.py): keys and values travel round the CP ranks;
* `all_gather`: every rank gathers the whole sequence's keys and values (cp_all_gather.py);
* `a2a`: heads traded for sequence by an all-to-all, local attention (cp_all_to_all.py);
* `a2a+p2p`: the all-to-all inside groups of A, the ring over the B groups.
"""

from dataclasses import dataclass

from megatron.distributed.context_parallel.all_gather import all_gather_attention
from megatron.distributed.context_parallel.all_to_all import all_to_all_attention
from megatron.distributed.context_parallel.ring import ring_attention

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass
class ContextParallelAttention:
    """One layer's context-parallel attention: its communication type and groups."""

    comm_type: str
    group: object  # megatron-core's context-parallel group
    hierarchical_groups: list | None = None  # [inner (all-to-all), outer (ring)]

    def __call__(self, q, k, v, scale: float, dropout_p: float):
        if self.comm_type == "p2p":
            return ring_attention(q, k, v, self.group, scale, dropout_p)
        if self.comm_type == "all_gather":
            return all_gather_attention(q, k, v, self.group, scale, dropout_p)
        if self.comm_type == "a2a":
            return all_to_all_attention(q, k, v, self.group, None, scale, dropout_p)
        inner, outer = self.hierarchical_groups
        return all_to_all_attention(q, k, v, inner, outer, scale, dropout_p)


def layer_comm_type(comm_types, layer_number: int) -> str:
    """The type of layer `layer_number` (1-based, global): one type for every layer, or one
    per layer (Megatron's list form)."""
    if comm_types is None:
        return "p2p"
    if isinstance(comm_types, str):
        return comm_types
    return comm_types[0] if len(comm_types) == 1 else comm_types[layer_number - 1]


def hierarchical_groups(pg_collection=None) -> list | None:
    """megatron-core's hierarchical context-parallel groups, inner first (None without)."""
    from megatron.core import parallel_state

    groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    return groups or parallel_state.get_hierarchical_context_parallel_groups(False)
