"""How a rank's model chunks exchange tensors with the virtual stages before and after them.

The runtime (`megatron.pipeline.runtime`) runs one lane per model chunk; each lane has up to
four ordered streams: activations in (from virtual stage k - 1) and out (to k + 1), gradients in
(from k + 1) and out (to k - 1). A *transport* opens them. The runtime only needs, of an inbox,
`expect_total`, `outstanding`, `ready` and `take`, and of an outbox `send` and `flush`, so any
carrier will do:

* `DistributedTransport`: torch.distributed point-to-point between processes (gloo, NCCL;
  `megatron.pipeline.p2p`), one process group per stream family so that no communicator carries
  two streams between the same two ranks in the same direction;
* a loopback when both virtual stages run on the same rank (the turn of the V placement on the
  last rank): a local queue, no network send;
* `InProcessTransport`: every rank in one process (threads), each stream a queue. Tests and the
  single-process studies run the real runtime over it.

Every inbox of a rank notifies one `threading.Condition` (the rank's `arrivals`) when a tensor
arrives, so the runtime can sleep until any stream delivers.
"""

import collections
import threading
from dataclasses import dataclass, field

import torch

from .p2p import Outbox, make_inbox, scale_elements
from .vocab_parallel import carried_words


@dataclass(frozen=True)
class LaneEnds:
    """Which streams a lane has: virtual stage 0 takes no input, the last sends no output."""

    virtual_stage: int
    num_virtual_stages: int

    @property
    def has_input(self) -> bool:
        return self.virtual_stage > 0

    @property
    def has_output(self) -> bool:
        return self.virtual_stage < self.num_virtual_stages - 1


@dataclass
class LaneStreams:
    """A lane's four streams (None where the lane has no such neighbour)."""

    activations_in: object = None
    gradients_in: object = None
    activations_out: object = None
    gradients_out: object = None

    def outboxes(self) -> tuple:
        return tuple(o for o in (self.activations_out, self.gradients_out) if o is not None)

    def inboxes(self) -> tuple:
        return tuple(i for i in (self.activations_in, self.gradients_in) if i is not None)


class QueueInbox:
    """An inbox whose tensors a `QueueOutbox` puts there, in order (same process)."""

    def __init__(self, arrivals: threading.Condition | None = None):
        self.arrivals = arrivals or threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.expected = self.taken = 0

    def deliver(self, tensor: torch.Tensor) -> None:
        with self.arrivals:
            self.queue.append(tensor.detach().clone())
            self.arrivals.notify_all()

    def expect_total(self, total: int) -> None:
        self.expected = max(self.expected, total)

    def outstanding(self) -> int:
        return self.expected - self.taken

    def ready(self) -> bool:
        return bool(self.queue)

    def take(self) -> torch.Tensor:
        with self.arrivals:
            while not self.queue:
                self.arrivals.wait()
            self.taken += 1
            return self.queue.popleft()


class QueueOutbox:
    def __init__(self, inbox: QueueInbox):
        self.inbox = inbox

    def send(self, tensor: torch.Tensor) -> None:
        self.inbox.deliver(tensor)

    def flush(self) -> None:
        pass


@dataclass
class VocabStreams:
    """A rank's streams for its output shard (a vocabulary split over the ranks): the last
    stage's hidden states and softmax statistics in, the shard's output to the last stage.
    The last stage also holds one stream per rank the other way (its own through a queue)."""

    hidden_in: object
    stats_in: object
    shard_out: object
    hidden_out: list = field(default_factory=list)  # last stage only, by rank
    stats_out: list = field(default_factory=list)
    shard_in: list = field(default_factory=list)
    # the input embedding split too: the rank's part out and its gradient in; the first
    # stage's parts in and gradients out, by rank
    embed_out: object = None
    embed_grad_in: object = None
    embed_in: list = field(default_factory=list)
    embed_grad_out: list = field(default_factory=list)

    def inboxes(self) -> tuple:
        embedding = (self.embed_grad_in, *self.embed_in) if self.embed_out is not None else ()
        return (self.hidden_in, self.stats_in, *self.shard_in, *embedding)

    def outboxes(self) -> tuple:
        embedding = (self.embed_out, *self.embed_grad_out) if self.embed_out is not None else ()
        return (self.shard_out, *self.hidden_out, *self.stats_out, *embedding)


@dataclass(frozen=True)
class VocabLinks:
    """The global ranks of the pipeline (by stage) and the process groups of the vocabulary
    streams: hidden states out and shard outputs back on one (opposite directions), the
    statistics on another (same direction as the hidden states); the input embedding's parts
    in and gradients out of the first stage on a third."""

    pipeline_ranks: tuple[int, ...]
    hidden_group: object = None
    stats_group: object = None
    embed_group: object = None


def vocab_message_sizes(tokens: int, hidden_size: int, dtype=torch.float32) -> dict[str, int]:
    """Elements of each vocabulary message (`pipeline.vocab_parallel`): the hidden state and the
    shards' outputs in `dtype` (fp32 values carried in it), the statistics in fp32."""
    words = carried_words(dtype)
    return {
        "hidden": tokens * (hidden_size + words),
        "shard": tokens * (3 * words + 2 * hidden_size),
        "stats": 3 * tokens,
    }


@dataclass
class LaneLinks:
    """Global peer ranks and process groups of one lane's streams (peers None where the lane
    has no such neighbour; a peer equal to this rank is a loopback)."""

    input_peer: int | None = None
    input_group: object = None
    output_peer: int | None = None
    output_group: object = None
    grad_in_peer: int | None = None  # the gradient comes from the output's peer ...
    grad_in_group: object = None
    grad_out_peer: int | None = None  # ... and goes to the input's
    grad_out_group: object = None


class DistributedTransport:
    """Streams over torch.distributed, as `links` (one `LaneLinks` per lane) say; loopbacks
    where a lane's neighbour is on this rank."""

    def __init__(
        self,
        *,
        rank: int,
        links: list[LaneLinks],
        backend: str,
        device,
        dtype,
        max_pending: int,
        vocab_links: VocabLinks | None = None,
    ):
        self.rank, self.links = rank, links
        self.backend, self.device, self.dtype = backend, device, dtype
        self.max_pending = max_pending
        self.vocab_links = vocab_links
        self._loopbacks: dict[tuple[str, int], QueueInbox] = {}  # (stream, receiving lane)

    def open_vocab(
        self, stage, num_stages, arrivals, *, tokens, hidden_size, embed_elements=None,
        last_stage=None,
    ) -> VocabStreams:  # fmt: skip
        """The output shard's streams of pipeline stage `stage` (the last stage's own messages
        to itself through local queues); with `embed_elements` (a part's), the input embedding's
        too, its gradients with the sender's loss scale after them. All
        in the pipeline's dtype but the statistics (fp32). `last_stage`: the pipeline rank of
        the last virtual stage (default the last; the V placement's is rank 0)."""
        links = self.vocab_links
        if links is None:
            raise RuntimeError("a split vocabulary needs the transport's vocab_links")
        sizes = vocab_message_sizes(tokens, hidden_size, self.dtype)
        ranks = links.pipeline_ranks
        last_stage = num_stages - 1 if last_stage is None else last_stage
        last = ranks[last_stage]

        if embed_elements is not None:  # a gradient carries its sender's loss scale after it
            sizes.update(embed=embed_elements,
                         embed_grad=embed_elements + scale_elements(self.dtype))  # fmt: skip
        dtypes = dict.fromkeys(("hidden", "shard", "embed", "embed_grad"), self.dtype)

        def inbox(stream, peer, group):
            if peer == self.rank:
                return self._vocab_loopback(stream, arrivals)
            return make_inbox(backend=self.backend, peer=peer, group=group,
                              shape=(sizes[stream],), dtype=dtypes.get(stream, torch.float32),
                              device=self.device, arrivals=arrivals)  # fmt: skip

        def outbox(stream, peer, group):
            if peer == self.rank:
                return QueueOutbox(self._vocab_loopback(stream, arrivals))
            return Outbox(peer=peer, group=group, max_pending=self.max_pending)

        streams = VocabStreams(
            hidden_in=inbox("hidden", last, links.hidden_group),
            stats_in=inbox("stats", last, links.stats_group),
            shard_out=outbox("shard", last, links.hidden_group),
        )
        if stage == last_stage:
            streams.hidden_out = [outbox("hidden", r, links.hidden_group) for r in ranks]
            streams.stats_out = [outbox("stats", r, links.stats_group) for r in ranks]
            streams.shard_in = [inbox("shard", r, links.hidden_group) for r in ranks]
        if embed_elements is not None:
            first = ranks[0]
            streams.embed_out = outbox("embed", first, links.embed_group)
            streams.embed_grad_in = inbox("embed_grad", first, links.embed_group)
            if stage == 0:
                streams.embed_in = [inbox("embed", r, links.embed_group) for r in ranks]
                streams.embed_grad_out = [outbox("embed_grad", r, links.embed_group) for r in ranks]
        return streams

    def _vocab_loopback(self, stream: str, arrivals) -> QueueInbox:
        inbox = self._loopbacks.setdefault((stream, -1), QueueInbox())
        inbox.arrivals = arrivals
        return inbox

    def open(
        self,
        lane: int,
        ends: LaneEnds,
        *,
        activation_elements: int,
        gradient_elements: int,
        arrivals: threading.Condition,
    ) -> LaneStreams:
        links, streams = self.links[lane], LaneStreams()
        if ends.has_input:
            streams.activations_in = self._inbox(
                "activation",
                lane,
                links.input_peer,
                links.input_group,
                activation_elements,
                arrivals,
            )
            streams.gradients_out = self._outbox(
                "gradient", links.grad_out_peer, links.grad_out_group, lane, -1
            )
        if ends.has_output:
            streams.gradients_in = self._inbox(
                "gradient",
                lane,
                links.grad_in_peer,
                links.grad_in_group,
                gradient_elements,
                arrivals,
            )
            streams.activations_out = self._outbox(
                "activation", links.output_peer, links.output_group, lane, +1
            )
        return streams

    def _inbox(self, stream, lane, peer, group, elements, arrivals):
        if peer == self.rank:
            inbox = self._loopbacks.setdefault((stream, lane), QueueInbox())
            inbox.arrivals = arrivals
            return inbox
        return make_inbox(
            backend=self.backend,
            peer=peer,
            group=group,
            shape=(elements,),
            dtype=self.dtype,
            device=self.device,
            arrivals=arrivals,
        )

    def _outbox(self, stream, peer, group, lane, direction):
        if peer == self.rank:  # the neighbouring lane of this rank: the next/previous chunk
            receiver = self._receiving_lane(lane, direction)
            return QueueOutbox(self._loopbacks.setdefault((stream, receiver), QueueInbox()))
        return Outbox(peer=peer, group=group, max_pending=self.max_pending)

    def _receiving_lane(self, lane: int, direction: int) -> int:
        """The lane of this rank that a loopback from `lane` feeds (the V's turn: its chunks
        0 and 1 are consecutive virtual stages)."""
        peers = [
            index
            for index, links in enumerate(self.links)
            if (links.input_peer if direction > 0 else links.grad_in_peer) == self.rank
            and index != lane
        ]
        if len(peers) != 1:
            raise RuntimeError(f"lane {lane}: no single local lane to loop back to ({peers})")
        return peers[0]


class InProcessTransport:
    """Every rank in one process: stream k -> k + 1 (activations) and k + 1 -> k (gradients) is
    one queue, shared by the sending and the receiving runtime. Build all the runtimes on one
    transport before any of them runs."""

    def __init__(self):
        self._queues: dict[tuple[str, int], QueueInbox] = {}  # (stream, receiving stage)
        self._lanes: dict[tuple[int, int], int] = {}  # (rank id, lane) -> virtual stage

    def for_rank(self, virtual_stages: list[int]) -> "_InProcessRankTransport":
        """The transport of one rank whose lanes run `virtual_stages` (by lane)."""
        return _InProcessRankTransport(self, list(virtual_stages))

    def queue(self, stream: str, receiving_stage: int) -> QueueInbox:
        return self._queues.setdefault((stream, receiving_stage), QueueInbox())

    def vocab_streams(
        self, rank: int, num_ranks: int, arrivals, *, embed_elements=None, last_stage=None,
        **sizes,
    ) -> VocabStreams:  # fmt: skip
        """Rank `rank`'s output-shard streams (shard outputs are queued by sender), and its
        input embedding's with `embed_elements` (parts queued by sender)."""
        last = num_ranks - 1 if last_stage is None else last_stage
        streams = VocabStreams(
            hidden_in=self.queue("hidden", rank),
            stats_in=self.queue("stats", rank),
            shard_out=QueueOutbox(self.queue(f"shard from {rank}", last)),
        )
        if rank == last:
            streams.hidden_out = [QueueOutbox(self.queue("hidden", r)) for r in range(num_ranks)]
            streams.stats_out = [QueueOutbox(self.queue("stats", r)) for r in range(num_ranks)]
            streams.shard_in = [self.queue(f"shard from {r}", last) for r in range(num_ranks)]
        if embed_elements is not None:
            streams.embed_out = QueueOutbox(self.queue(f"embed from {rank}", 0))
            streams.embed_grad_in = self.queue("embed_grad", rank)
            if rank == 0:
                ranks = range(num_ranks)
                streams.embed_in = [self.queue(f"embed from {r}", 0) for r in ranks]
                streams.embed_grad_out = [QueueOutbox(self.queue("embed_grad", r)) for r in ranks]
        for inbox in streams.inboxes():
            inbox.arrivals = arrivals
        return streams


@dataclass
class _InProcessRankTransport:
    hub: InProcessTransport
    virtual_stages: list[int]

    def open(
        self,
        lane: int,
        ends: LaneEnds,
        *,
        activation_elements: int,
        gradient_elements: int,
        arrivals: threading.Condition,
    ) -> LaneStreams:
        stage, hub, streams = self.virtual_stages[lane], self.hub, LaneStreams()
        if ends.has_input:
            streams.activations_in = hub.queue("activation", stage)
            streams.activations_in.arrivals = arrivals
            streams.gradients_out = QueueOutbox(hub.queue("gradient", stage - 1))
        if ends.has_output:
            streams.gradients_in = hub.queue("gradient", stage)
            streams.gradients_in.arrivals = arrivals
            streams.activations_out = QueueOutbox(hub.queue("activation", stage + 1))
        return streams

    def open_vocab(self, rank: int, num_ranks: int, arrivals, **sizes) -> VocabStreams:
        return self.hub.vocab_streams(rank, num_ranks, arrivals, **sizes)
