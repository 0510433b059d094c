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

The output layer split by vocabulary (`vocab_parallel`) sends on trees rooted at the last stage
(`wire_output_tree`): a rank's hidden-state and statistics inboxes relay each tensor to its
children as it arrives (on the receive thread, or the sender's thread in process), and its
shard's outputs go to a `ShardReducer` that combines them with its children's partials and
sends one message up when a microbatch's inputs are all there, whoever delivers the last one.
"""

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .p2p import Outbox, PacedLink, PacedOutbox, make_inbox, scale_elements
from .vocab_parallel import carried_words, combine_partials
from .vocab_tree import VocabTree


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
        # a tree's node: each tensor goes to `relay` first (on the sender's thread), and is
        # queued only with `keep`; `watched`: inboxes whose errors surface here
        self.relay: Callable | None = None
        self.keep = True
        self.watched: tuple = ()

    def deliver(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().clone()
        if self.relay is not None:
            self.relay(tensor)
        if not self.keep:
            return
        with self.arrivals:
            self.queue.append(tensor)
            self.arrivals.notify_all()

    def check(self) -> None:
        for inbox in self.watched:
            inbox.check()

    def expect_total(self, total: int) -> None:
        self.expected = max(self.expected, total)

    def outstanding(self) -> int:
        return self.expected - self.taken

    def ready(self) -> bool:
        self.check()
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
    stage's hidden states and softmax statistics in, the shard's output towards the last
    stage. The last stage also sends the hidden states and statistics (down the tree, to
    itself through a queue) and takes the shards' outputs combined (one message each)."""

    hidden_in: object
    stats_in: object
    shard_out: object
    hidden_out: list = field(default_factory=list)  # last stage only
    stats_out: list = field(default_factory=list)
    shard_in: list = field(default_factory=list)
    relays: list = field(default_factory=list)  # sends the receive path makes (to flush)
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
        output = (self.shard_out, *self.hidden_out, *self.stats_out, *self.relays)
        return (*output, *embedding)


class ShardReducer:
    """A rank's node of the reduction tree: its own shard's outputs (input 0) and its
    children's partials (inputs 1, 2, ...), combined microbatch by microbatch as soon as all
    of a microbatch's are there (`combine_partials`), one message to `up`. Whichever thread
    delivers the last input combines: the rank's loop after its VF, or a receive thread."""

    def __init__(self, inputs: int, up, hidden_size: int):
        self.up, self.hidden_size = up, hidden_size
        self._queues = [collections.deque() for _ in range(inputs)]
        self._lock = threading.Lock()

    def input(self, index: int) -> "ReducerInput":
        return ReducerInput(self, index)

    def put(self, index: int, tensor: torch.Tensor) -> None:
        with self._lock:  # one combine at a time, sent up in microbatch order
            self._queues[index].append(tensor.detach())
            while all(self._queues):
                messages = [queue.popleft() for queue in self._queues]
                self.up.send(combine_partials(messages, self.hidden_size))

    def flush(self) -> None:
        self.up.flush()


@dataclass
class ReducerInput:
    """One input of a `ShardReducer`, as an outbox (the rank's shard_out, a child's relay)."""

    reducer: ShardReducer
    index: int

    def send(self, tensor: torch.Tensor) -> None:
        self.reducer.put(self.index, tensor)

    def flush(self) -> None:
        self.reducer.flush()


@dataclass
class TreeBroadcast:
    """One tensor to several outboxes (a node's children, the root's own queue), after
    `before_send` (which credits the receives of what the children will send back)."""

    outboxes: list
    before_send: Callable[[], None] = lambda: None

    def send(self, tensor: torch.Tensor) -> None:
        self.before_send()
        for outbox in self.outboxes:
            outbox.send(tensor)

    def flush(self) -> None:
        for outbox in self.outboxes:
            outbox.flush()


def _credit_one_more(inboxes: list) -> None:
    """Each child answers every hidden state with one partial: receive one more from each."""
    for inbox in inboxes:
        inbox.expect_total(inbox.expected + 1)


def wire_output_tree(
    tree: VocabTree, stage: int, hidden_size: int, *, link_in, link_out, local
) -> VocabStreams:
    """The output shard's streams of `stage` on `tree`: `link_in(stream, peer, relay=, keep=)`
    and `link_out(stream, peer)` open a stream from or to another stage, `local(stream)` a
    queue of this rank (the root's messages to itself)."""
    parent, children = tree.parent(stage), tree.children(stage)
    shard_in = [local("shard")] if parent is None else []
    up = QueueOutbox(shard_in[0]) if parent is None else link_out("shard", parent)
    reducer = ShardReducer(1 + len(children), up, hidden_size)
    partials = [link_in("shard", child, relay=reducer.input(1 + index).send, keep=False)
                for index, child in enumerate(children)]  # fmt: skip
    hidden_down = TreeBroadcast([link_out("hidden", child) for child in children],
                                before_send=lambda: _credit_one_more(partials))  # fmt: skip
    stats_down = TreeBroadcast([link_out("stats", child) for child in children])
    if parent is None:
        hidden_in, stats_in = local("hidden"), local("stats")
        streams = VocabStreams(
            hidden_in, stats_in, reducer.input(0), shard_in=shard_in,
            hidden_out=[TreeBroadcast([hidden_down, QueueOutbox(hidden_in)])],
            stats_out=[TreeBroadcast([stats_down, QueueOutbox(stats_in)])],
        )  # fmt: skip
        shard_in[0].watched = tuple(partials)
    else:
        hidden_in = link_in("hidden", parent, relay=hidden_down.send)
        stats_in = link_in("stats", parent, relay=stats_down.send)
        streams = VocabStreams(hidden_in, stats_in, reducer.input(0))
        streams.relays = [hidden_down, stats_down]
    hidden_in.watched = tuple(partials)
    return streams


@dataclass(frozen=True)
class VocabLinks:
    """The global ranks of the pipeline (by stage) and the process groups of the vocabulary
    streams: hidden states down the tree and partials up on one (opposite directions), the
    statistics on another (same direction as the hidden states); the input embedding's parts
    in and gradients out of the first stage on a third."""

    pipeline_ranks: tuple[int, ...]
    hidden_group: object = None
    stats_group: object = None
    embed_group: object = None
    # children per rank of the output layer's trees (`VocabTree`); N - 1 or more: the fan,
    # every rank the last stage's child
    tree_arity: int = 2


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
        link: PacedLink | None = None,
        pace_embedding: bool = True,
    ):
        self.rank, self.links = rank, links
        self.backend, self.device, self.dtype = backend, device, dtype
        self.max_pending = max_pending
        self.vocab_links = vocab_links
        # an emulated link for every send of this rank to another (None: the backend's own);
        # `pace_embedding` False lets the input embedding's messages bypass it
        self.link, self.pace_embedding = link, pace_embedding
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
        if embed_elements is not None:  # a gradient carries its sender's loss scale after it
            sizes.update(embed=embed_elements,
                         embed_grad=embed_elements + scale_elements(self.dtype))  # fmt: skip
        dtypes = dict.fromkeys(("hidden", "shard", "embed", "embed_grad"), self.dtype)
        groups = {"hidden": links.hidden_group, "shard": links.hidden_group,
                  "stats": links.stats_group}  # fmt: skip

        def inbox(stream, peer, group, **relaying):
            if peer == self.rank:
                return self._vocab_loopback(stream, arrivals)
            return make_inbox(backend=self.backend, peer=peer, group=group,
                              shape=(sizes[stream],), dtype=dtypes.get(stream, torch.float32),
                              device=self.device, arrivals=arrivals, **relaying)  # fmt: skip

        def outbox(stream, peer, group):
            if peer == self.rank:
                return QueueOutbox(self._vocab_loopback(stream, arrivals))
            paced = self.pace_embedding or stream not in ("embed", "embed_grad")
            return self._remote_outbox(peer, group, paced=paced)

        streams = wire_output_tree(
            VocabTree(len(ranks), last_stage, links.tree_arity), stage, hidden_size,
            link_in=lambda stream, peer, **kw: inbox(stream, ranks[peer], groups[stream], **kw),
            link_out=lambda stream, peer: outbox(stream, ranks[peer], groups[stream]),
            local=lambda stream: self._vocab_loopback(stream, arrivals),
        )  # fmt: skip
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
        return self._remote_outbox(peer, group)

    def _remote_outbox(self, peer: int, group, paced: bool = True) -> Outbox:
        """Sends to another rank, through the emulated link where there is one."""
        if self.link is not None and paced:
            return PacedOutbox(link=self.link, peer=peer, group=group,
                               max_pending=self.max_pending)  # fmt: skip
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

    def __init__(self, tree_arity: int = 2):
        self._queues: dict[tuple[str, int], QueueInbox] = {}  # (stream, receiving stage)
        self._lanes: dict[tuple[int, int], int] = {}  # (rank id, lane) -> virtual stage
        self.tree_arity = tree_arity  # the output layer's trees (`VocabLinks.tree_arity`)

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

        def link_in(stream, peer, relay=None, keep=True):
            inbox = self.queue(f"{stream} from {peer}", rank)
            inbox.relay, inbox.keep = relay, keep
            return inbox

        streams = wire_output_tree(
            VocabTree(num_ranks, last, self.tree_arity), rank, sizes["hidden_size"],
            link_in=link_in,
            link_out=lambda stream, peer: QueueOutbox(self.queue(f"{stream} from {rank}", peer)),
            local=lambda stream: self.queue(f"{stream} from {rank}", rank),
        )  # fmt: skip
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
