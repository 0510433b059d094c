"""A link model: what a message and a collective cost on a cluster of nodes.

A rank talks to the ranks of its own node over the intra-node link (NVLink) and to other
nodes' ranks over the inter-node link (the NIC); each link has a latency alpha (seconds per
message) and a bandwidth beta (bytes per second, per GPU). Costs by the standard formulas,
n ranks in the group and B bytes per rank:

* point to point: alpha + B / beta on the link between the two ranks;
* ring all-reduce: 2 (n - 1) / n * B / beta + 2 (n - 1) alpha;
* reduce-scatter, all-gather: (n - 1) / n * B / beta + (n - 1) alpha;
* all-to-all (pairwise exchange): (n - 1) / n * B / beta + (n - 1) alpha;
* tree broadcast and reduce: ceil(log2 n) steps of alpha + B / beta;
* the output layer's vocabulary messages (`vocab_tree_s`): the runtime's tree of arity k
  rooted at the last stage (`VocabTree`), each rank forwarding to its k children one after
  another: the last rank reached waits for 1, 2, 4, 6, 8 messages at n = 2, 4, 8, 16, 32
  (binary: 2 log2 n - 2 from n = 4 on, against the fan's n - 1; the root's link carries 2
  messages a microbatch each way); arity n - 1 is the fan through one rank, n - 1 messages
  one after another (`fan_s`, what the input embedding's messages still do).

A collective whose group spans several nodes runs at the slowest link it crosses (a ring is
as fast as its slowest hop). `RankLayout` says which ranks share a node: Megatron's rank order
(megatron-core's default ``tp-cp-ep-dp-pp``: tensor-parallel ranks adjacent, then the
data-parallel replicas, then the pipeline stages) filled into nodes of ``ranks_per_node``.
`Communication` is what the event engine takes: these costs in seconds, per stage pair and
per stage, with whether the data-parallel reduction overlaps the backward.
"""

import math
from dataclasses import dataclass, field

from ..vocab_tree import VocabTree


@dataclass(frozen=True)
class LinkModel:
    """Latency (seconds) and bandwidth (GB/s per GPU) of the intra- and inter-node links, and
    how many ranks (GPUs) a node holds."""

    intra_latency_s: float = 2e-6
    intra_bandwidth_gbs: float = 450.0
    inter_latency_s: float = 5e-6
    inter_bandwidth_gbs: float = 25.0
    ranks_per_node: int = 8

    def __post_init__(self):
        for name in ("intra_latency_s", "inter_latency_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        for name in ("intra_bandwidth_gbs", "inter_bandwidth_gbs"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def link(self, intra: bool) -> tuple[float, float]:
        """(alpha seconds, beta bytes per second) of the intra- or inter-node link."""
        if intra:
            return self.intra_latency_s, self.intra_bandwidth_gbs * 1e9
        return self.inter_latency_s, self.inter_bandwidth_gbs * 1e9

    def point_to_point_s(self, num_bytes: float, intra: bool) -> float:
        alpha, beta = self.link(intra)
        return alpha + num_bytes / beta

    def all_reduce_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """Ring all-reduce of `num_bytes` per rank over `ranks` ranks."""
        if ranks <= 1:
            return 0.0
        alpha, beta = self.link(intra)
        return 2 * (ranks - 1) / ranks * num_bytes / beta + 2 * (ranks - 1) * alpha

    def reduce_scatter_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """Ring reduce-scatter of `num_bytes` per rank (each keeps 1/ranks of the sum)."""
        if ranks <= 1:
            return 0.0
        alpha, beta = self.link(intra)
        return (ranks - 1) / ranks * num_bytes / beta + (ranks - 1) * alpha

    def all_gather_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """Ring all-gather to `num_bytes` per rank (each contributes 1/ranks)."""
        return self.reduce_scatter_s(num_bytes, ranks, intra)

    def all_to_all_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """All-to-all of `num_bytes` per rank, 1/ranks of it to each rank (pairwise)."""
        return self.reduce_scatter_s(num_bytes, ranks, intra)

    def tree_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """Binomial-tree broadcast or reduce of `num_bytes` over `ranks` ranks."""
        if ranks <= 1:
            return 0.0
        return math.ceil(math.log2(ranks)) * self.point_to_point_s(num_bytes, intra)

    def vocab_tree_s(self, num_bytes: float, ranks: int, intra: bool, arity: int = 2) -> float:
        """`num_bytes` from the root of a `VocabTree` of `arity` over `ranks` ranks to its
        deepest rank, each rank sending to its children one after another: the last arrival."""
        tree, root = VocabTree(ranks, ranks - 1, arity), ranks - 1
        messages = {root: 0}  # messages' time from the root's send to each rank's arrival
        for stage in sorted(range(ranks), key=tree.depth):  # parents before their children
            for order, child in enumerate(tree.children(stage), start=1):
                messages[child] = messages[stage] + order
        return max(messages.values()) * self.point_to_point_s(num_bytes, intra)

    def fan_s(self, num_bytes: float, ranks: int, intra: bool) -> float:
        """One rank sending `num_bytes` to each of the other ranks - 1 ranks (or receiving
        from each) point to point, one after another through its link: the last message's
        arrival."""
        return max(ranks - 1, 0) * self.point_to_point_s(num_bytes, intra)


# A GPU cluster: 8 GPUs per node on NVLink (450 GB/s, ~2 us per message), 25 GB/s per GPU
# between nodes (a 200 Gbit/s NIC per GPU, ~5 us).
CLUSTERS = {"gpu": LinkModel(2e-6, 450.0, 5e-6, 25.0, 8)}


@dataclass(frozen=True)
class RankLayout:
    """Tensor x pipeline x data-parallel ranks in Megatron's order (tensor-parallel ranks
    adjacent, then the data-parallel replicas, then the pipeline stages), ``ranks_per_node``
    consecutive ranks to a node."""

    tensor: int
    pipeline: int
    data: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("tensor", "pipeline", "data", "ranks_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def rank(self, tensor: int, data: int, stage: int) -> int:
        return tensor + self.tensor * (data + self.data * stage)

    def node(self, tensor: int, data: int, stage: int) -> int:
        return self.rank(tensor, data, stage) // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.tensor * self.pipeline * self.data / self.ranks_per_node)

    def stages_share_node(self, first: int, second: int) -> bool:
        """Whether every rank of stage `first` talks to its peer of stage `second` (same
        tensor and data rank) inside a node: otherwise the slower link bounds the hop."""
        return all(
            self.node(t, d, first) == self.node(t, d, second)
            for t in range(self.tensor)
            for d in range(self.data)
        )

    def data_group_in_node(self, stage: int) -> bool:
        """Whether each data-parallel group of `stage` (one per tensor rank) is inside a node."""
        return all(
            len({self.node(t, d, stage) for d in range(self.data)}) == 1 for t in range(self.tensor)
        )


@dataclass(frozen=True)
class Communication:
    """What the event engine charges for communication, in seconds.

    * ``hop_s[i][j]``: a pipeline activation or gradient message from rank i to rank j;
    * ``message_s[kind][i][j]``: one vocabulary message (kind 'hidden', 'shard', 'stats',
      'embed', 'embed_grad') from rank i to rank j. The output layer's ('hidden', 'stats'
      down, 'shard' up) travel on a tree of ``vocab_tree_arity`` rooted at the last stage, as
      the runtime sends them (`VocabTree`; N - 1: the fan); the input embedding's are sent
      one after another through the link of the rank that sends them to every rank, and
      received one after another on the rank that gathers them (a fan, point to point);
    * ``reduce_s[s]``: the data-parallel gradient reduction of stage s's step (all-reduce, or
      reduce-scatter with the distributed optimizer); ``gather_s[s]``: the parameters'
      all-gather after the step (distributed optimizer; 0 otherwise);
    * ``overlap_grad_reduce``: the reduction starts when the step's last gradient pass
      (backward, or W with a split backward) begins instead of after it ends;
    * ``expert_s[s]``: (forward, backward) seconds of the expert all-to-alls inside each
      forward and input-gradient backward of stage s (blocking: added to the pass).
    """

    hop_s: tuple[tuple[float, ...], ...]
    reduce_s: tuple[float, ...]
    gather_s: tuple[float, ...] = ()
    message_s: dict = field(default_factory=dict)
    overlap_grad_reduce: bool = False
    expert_s: tuple[tuple[float, float], ...] = ()
    vocab_tree_arity: int = 2  # the runtime's `VocabLinks.tree_arity`
    # every message a rank sends queues on its one outbound link, pipeline hops and a shard's
    # first hop up the tree too (the benchmarks' emulated links, `p2p.PacedLink`)
    one_link_per_rank: bool = False

    def check(self, num_ranks: int) -> None:
        rows = [self.hop_s, *self.message_s.values()]
        if any(len(m) != num_ranks or any(len(r) != num_ranks for r in m) for m in rows):
            raise ValueError(f"communication: every message matrix must be {num_ranks} x "
                             f"{num_ranks}")  # fmt: skip
        for name in ("reduce_s", "gather_s", "expert_s"):
            value = getattr(self, name)
            if value and len(value) != num_ranks:
                raise ValueError(f"communication.{name}: {len(value)} values for {num_ranks} ranks")

    def reduce_of(self, stage: int) -> float:
        return self.reduce_s[stage] if self.reduce_s else 0.0

    def gather_of(self, stage: int) -> float:
        return self.gather_s[stage] if self.gather_s else 0.0

    def expert_of(self, stage: int) -> tuple[float, float]:
        return self.expert_s[stage] if self.expert_s else (0.0, 0.0)


def per_rank_link_communication(
    num_ranks: int, bandwidth_gbs: float, latency_s: float, message_bytes: dict, *,
    vocab_tree_arity: int = 2, base_latency_s: float = 0.0,
) -> Communication:  # fmt: skip
    """Every rank with one outbound link of `bandwidth_gbs` and `latency_s` per message, each
    message queued behind the rank's earlier ones (`one_link_per_rank`), as the emulated links
    pace them: `message_bytes` by kind ('activation' for the pipeline's hops, 'hidden',
    'shard', 'stats', 'embed', 'embed_grad'; a kind left out costs `base_latency_s` alone);
    `base_latency_s` the backend's own time per message, on top."""
    beta = bandwidth_gbs * 1e9

    def matrix(kind: str) -> tuple:
        seconds = base_latency_s
        if kind in message_bytes:
            seconds += latency_s + message_bytes[kind] / beta
        return tuple(tuple(0.0 if i == j else seconds for j in range(num_ranks))
                     for i in range(num_ranks))  # fmt: skip

    kinds = ("hidden", "shard", "stats", "embed", "embed_grad")
    return Communication(
        hop_s=matrix("activation"), reduce_s=(0.0,) * num_ranks,
        message_s={kind: matrix(kind) for kind in kinds},
        vocab_tree_arity=vocab_tree_arity, one_link_per_rank=True,
    )  # fmt: skip


def hop_matrix(links: LinkModel, layout: RankLayout, num_bytes: float) -> list[list[float]]:
    """Seconds of a `num_bytes` message (per GPU) between every pair of pipeline stages."""
    n = layout.pipeline
    return [
        [links.point_to_point_s(num_bytes, layout.stages_share_node(i, j)) for j in range(n)]
        for i in range(n)
    ]


def gradient_reduction_s(
    links: LinkModel, layout: RankLayout, stage: int, grad_bytes: float, distributed: bool
) -> float:
    """The data-parallel reduction of one stage's step: an all-reduce of its gradients, or a
    reduce-scatter with the distributed optimizer; at the slowest link the group crosses."""
    intra = layout.data_group_in_node(stage)
    if distributed:
        return links.reduce_scatter_s(grad_bytes, layout.data, intra)
    return links.all_reduce_s(grad_bytes, layout.data, intra)
