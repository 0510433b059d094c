"""Point-to-point transfers between adjacent pipeline stages, on any torch.distributed backend.

Each direction between two stages is one ordered stream of fixed-shape tensors: activations
flow downstream, gradients upstream. They travel on two different process groups so that on
NCCL the two directions never queue behind each other on one communicator.

An `Inbox` receives one stream. A schedule that reacts to arrivals (PACI) must know whether the
next tensor *has arrived* without blocking, and must be able to sleep until *either* stream
delivers. Backends differ here:

* gloo: `irecv(...).is_completed()` stays False until `wait()` is called, so a background
  thread does blocking receives and hands finished tensors over;
* NCCL (and other accelerators): `is_completed()` reports real completion, so receives are
  posted up front and polled.

Both flavours notify one `threading.Condition` per stage, which the runtime sleeps on.

A stream that relays (the vocabulary split's trees) always receives on a thread, polling the
receive's completion where the backend reports it, and hands each tensor to its `relay`
there, before the rank's own loop sees it: forwarding never waits for the rank's compute or
its optimizer step.
"""

import collections
import re
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist


class PeerLost(RuntimeError):
    """A receive from a neighbouring stage failed: it timed out (the peer is stuck) or the
    peer is gone. The message names both stages and ranks."""

    def __init__(self, peer: int, cause: BaseException):
        self.peer = peer
        self.timed_out = "timed out" in str(cause).lower() or "timeout" in str(cause).lower()
        if self.timed_out:
            what = "got nothing within --distributed-timeout-minutes from"
            problem = "it is stuck or too slow"
        else:
            # gloo's message starts with its source location: keep what follows
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(cause).strip()) or type(cause).__name__
            what, problem = "lost", text.splitlines()[0]
        super().__init__(
            f"{describe_rank(dist.get_rank())} {what} {describe_rank(peer)}: {problem}"
        )


_STAGES: dict[int, int] = {}  # global rank -> pipeline stage, every rank's (register_stages)


def register_stages(stages: dict[int, int]) -> None:
    """Every rank's stage, gathered at set-up, so that a rank of another pipeline (a replica)
    is named by its stage too."""
    _STAGES.clear()
    _STAGES.update(stages)


def describe_rank(rank: int) -> str:
    from megatron.core import parallel_state

    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    stage = ranks.index(rank) if rank in ranks else _STAGES.get(rank, "?")
    return f"stage {stage} (rank {rank})"


class Inbox:
    """An ordered stream of tensors of one shape from one peer rank."""

    def __init__(self, *, peer: int, group, shape, dtype, device, arrivals: threading.Condition):
        self.peer, self.group = peer, group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.arrivals = arrivals
        self.expected = 0  # receives asked for so far
        self.taken = 0

    def expect_total(self, total: int) -> None:
        """Make sure `total` tensors in all will be received (cumulative over the run)."""
        if total > self.expected:
            self._post(total - self.expected)
            self.expected = total

    def outstanding(self) -> int:
        return self.expected - self.taken

    def check(self) -> None:
        """Raise a receive's error that would otherwise go unseen (none here)."""

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


class ThreadedInbox(Inbox):
    """Blocking receives on a helper thread (gloo: its irecv cannot be polled). With `relay`,
    each tensor is handed to it on that thread first; with `keep` False only to it (the rank
    never takes from the inbox). `poll`: wait for a receive by polling its completion (NCCL,
    whose wait() returns before the data is there). Errors of the `watched` inboxes (relaying
    ones that the rank never takes from) surface in this one's ready()."""

    def __init__(self, *, relay: Callable | None = None, keep: bool = True, poll: bool = False,
                 **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self.relay, self.keep, self.poll = relay, keep, poll
        self.watched: tuple = ()
        self._arrived: collections.deque[torch.Tensor] = collections.deque()
        self._credits = threading.Semaphore(0)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive_loop, daemon=True)
        self._thread.start()

    def _post(self, count: int) -> None:
        for _ in range(count):
            self._credits.release()

    def _receive_loop(self) -> None:
        try:
            while True:
                self._credits.acquire()
                buffer = self._buffer()
                self._receive(buffer)
                if self.relay is not None:
                    self.relay(buffer)
                if self.keep:
                    with self.arrivals:
                        self._arrived.append(buffer)
                        self.arrivals.notify_all()
        except BaseException as error:  # surfaced on the main thread by take()/ready()
            with self.arrivals:
                self._error = error
                self.arrivals.notify_all()

    def _receive(self, buffer: torch.Tensor) -> None:
        if not self.poll:
            dist.recv(buffer, src=self.peer, group=self.group)
            return
        work = dist.irecv(buffer, src=self.peer, group=self.group)
        while not work.is_completed():
            time.sleep(20e-6)
        work.wait()

    def check(self) -> None:
        """Raise the receive thread's error (`PeerLost`), if any."""
        for inbox in self.watched:
            inbox.check()
        if self._error is not None:
            raise PeerLost(self.peer, self._error) from self._error

    def ready(self) -> bool:
        self.check()
        return len(self._arrived) > 0

    def take(self) -> torch.Tensor:
        with self.arrivals:
            while not self.ready():
                self.arrivals.wait()
            self.taken += 1
            return self._arrived.popleft()


class PolledInbox(Inbox):
    """Receives posted up front and polled (backends whose `is_completed` is truthful)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._pending: collections.deque = collections.deque()

    def _post(self, count: int) -> None:
        for _ in range(count):
            buffer = self._buffer()
            self._pending.append((dist.irecv(buffer, src=self.peer, group=self.group), buffer))

    def ready(self) -> bool:
        return bool(self._pending) and self._pending[0][0].is_completed()

    def take(self) -> torch.Tensor:
        work, buffer = self._pending.popleft()
        work.wait()
        self.taken += 1
        return buffer


class Outbox:
    """Asynchronous sends to one peer; keeps each tensor alive until its send completed."""

    def __init__(self, *, peer: int, group, max_pending: int):
        self.peer, self.group, self.max_pending = peer, group, max_pending
        self._pending: collections.deque = collections.deque()
        # a relaying receive thread sends while the rank's loop may flush
        self._lock = threading.Lock()

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        with self._lock:
            self._post(tensor)
            self._trim(self.max_pending)

    def flush(self) -> None:
        with self._lock:
            self._trim(0)

    def _post(self, tensor: torch.Tensor) -> None:
        """Start the send (the caller holds the lock)."""
        self._pending.append((dist.isend(tensor, dst=self.peer, group=self.group), tensor))

    def _trim(self, most: int) -> None:
        while len(self._pending) > most:
            self._pending.popleft()[0].wait()


class PacedLink:
    """One rank's outgoing link, emulated (the benchmarks' --emulated-link-gbs and
    --emulated-link-latency-us): each message occupies the link for latency + bytes /
    bandwidth, one after another in the order they were sent (a token bucket of no burst), and
    its real send starts when that time is over. A thread waits out each message's due time,
    so the rank's compute goes on meanwhile; what the backend then takes comes on top."""

    def __init__(self, bandwidth_gbs: float, latency_s: float = 0.0, *,
                 clock: Callable[[], float] = time.perf_counter):  # fmt: skip
        if not bandwidth_gbs > 0 or not latency_s >= 0:
            raise ValueError(f"an emulated link needs bandwidth > 0 and latency >= 0, got "
                             f"{bandwidth_gbs} GB/s and {latency_s} s")  # fmt: skip
        self.bandwidth_gbs, self.latency_s, self.clock = bandwidth_gbs, latency_s, clock
        self._free_at = 0.0  # when the link has sent everything queued so far
        self._queue: collections.deque = collections.deque()  # (due, start the send)
        self._unsent = 0
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def message_s(self, num_bytes: int) -> float:
        """Seconds one message of `num_bytes` occupies the link."""
        return self.latency_s + num_bytes / (self.bandwidth_gbs * 1e9)

    def occupy(self, num_bytes: int, now: float) -> float:
        """Queue a message sent at `now` behind the link's earlier ones: when it is through."""
        self._free_at = max(now, self._free_at) + self.message_s(num_bytes)
        return self._free_at

    def submit(self, num_bytes: int, start_send: Callable[[], None]) -> None:
        """`start_send` runs on the link's thread once the message is through the link."""
        with self._changed:
            self._raise_error()
            self._queue.append((self.occupy(num_bytes, self.clock()), start_send))
            self._unsent += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_loop, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def drain(self) -> None:
        """Wait until every queued message's send has started."""
        with self._changed:
            while self._unsent and self._error is None:
                self._changed.wait()
            self._raise_error()

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                due, start_send = self._queue.popleft()
            time.sleep(max(0.0, due - self.clock()))
            try:
                start_send()
            except BaseException as error:  # surfaced on the sender's next submit or drain
                with self._changed:
                    self._error = error
            with self._changed:
                self._unsent -= 1
                self._changed.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a send through the emulated link failed: {self._error}")


class PacedOutbox(Outbox):
    """An `Outbox` whose sends go through the rank's emulated link (`PacedLink`) first."""

    def __init__(self, *, link: PacedLink, **kwargs):
        super().__init__(**kwargs)
        self.link = link

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        self.link.submit(tensor.numel() * tensor.element_size(), lambda: self._post_locked(tensor))
        while True:  # waits with the lock released: the link's thread posts meanwhile
            with self._lock:
                if len(self._pending) <= self.max_pending:
                    return
                work, _ = self._pending.popleft()
            work.wait()

    def flush(self) -> None:
        self.link.drain()
        super().flush()

    def _post_locked(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._post(tensor)


def scale_elements(dtype: torch.dtype) -> int:
    """Payload elements that carry a gradient's fp32 loss scale: its 4 bytes reinterpreted in
    the payload's dtype (2 for bf16/fp16, whose range could not hold 2**32 as a value)."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def encode_scale(scale: float, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor([scale], dtype=torch.float32).view(dtype).to(device)


def decode_scale(payload_tail: torch.Tensor) -> float:
    return float(payload_tail.detach().cpu().contiguous().view(torch.float32)[0])


def make_inbox(*, backend: str, relay: Callable | None = None, keep: bool = True,
               **kwargs) -> Inbox:  # fmt: skip
    """An inbox for `backend`; one that relays (or keeps nothing) receives on a thread."""
    if backend == "gloo" or relay is not None or not keep:
        return ThreadedInbox(relay=relay, keep=keep, poll=backend != "gloo", **kwargs)
    return PolledInbox(**kwargs)
