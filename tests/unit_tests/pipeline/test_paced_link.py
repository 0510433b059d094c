"""The emulated per-rank link (`PacedLink`, --emulated-link-gbs): its pacing arithmetic, the
order and timing of the sends it starts, and which outboxes of the transport go through it."""

import time

import pytest

from megatron.pipeline.p2p import Outbox, PacedLink, PacedOutbox
from megatron.pipeline.transport import DistributedTransport


def test_a_message_occupies_latency_plus_bytes_over_bandwidth():
    link = PacedLink(0.125, 50e-6)  # 1 Gbit/s
    assert link.message_s(1_000_000) == pytest.approx(50e-6 + 8e-3)


def test_messages_queue_one_after_another_and_an_idle_link_starts_afresh():
    link = PacedLink(1.0, 1e-3)  # 1 GB/s: 1 MB takes 1 ms, plus 1 ms latency
    assert link.occupy(1_000_000, now=10.0) == pytest.approx(10.002)
    assert link.occupy(1_000_000, now=10.0) == pytest.approx(10.004)  # behind the first
    assert link.occupy(2_000_000, now=10.001) == pytest.approx(10.007)
    assert link.occupy(1_000_000, now=20.0) == pytest.approx(20.002)  # idle since 10.007


def test_n_minus_1_messages_from_one_rank_take_n_minus_1_times_one():
    """The fan's last stage pays N - 1 messages on its link; each of a tree's nodes two."""
    fan, tree = PacedLink(0.125), PacedLink(0.125)
    one = fan.message_s(2**21)
    assert max(fan.occupy(2**21, 0.0) for _ in range(7)) == pytest.approx(7 * one)
    assert max(tree.occupy(2**21, 0.0) for _ in range(2)) == pytest.approx(2 * one)


def test_sends_start_in_order_when_they_are_through_the_link():
    link, started, t0 = PacedLink(1e-3, 0.0), [], time.perf_counter()  # 1 MB/s
    for index in range(3):
        link.submit(20_000, lambda index=index: started.append((index, time.perf_counter() - t0)))
    link.drain()
    assert [index for index, _ in started] == [0, 1, 2]
    for (index, at), due in zip(started, (0.02, 0.04, 0.06)):
        assert due - 1e-3 <= at < due + 0.05, (index, at)


def test_a_failed_send_surfaces_on_drain():
    link = PacedLink(1.0)

    def fail():
        raise ValueError("peer gone")

    link.submit(10, fail)
    with pytest.raises(RuntimeError, match="emulated link failed: peer gone"):
        link.drain()


def test_bad_links_are_refused():
    with pytest.raises(ValueError):
        PacedLink(0.0)
    with pytest.raises(ValueError):
        PacedLink(1.0, -1e-6)


@pytest.mark.parametrize("pace_embedding", [True, False])
def test_the_transport_paces_every_remote_send(pace_embedding):
    link = PacedLink(1.0)
    transport = DistributedTransport(rank=0, links=[], backend="gloo", device="cpu",
                                     dtype=None, max_pending=4, link=link,
                                     pace_embedding=pace_embedding)  # fmt: skip
    outbox = transport._remote_outbox(1, None)
    assert isinstance(outbox, PacedOutbox) and outbox.link is link
    embedding = transport._remote_outbox(1, None, paced=pace_embedding)
    assert isinstance(embedding, PacedOutbox) == pace_embedding
    plain = DistributedTransport(rank=0, links=[], backend="gloo", device="cpu", dtype=None,
                                 max_pending=4)  # fmt: skip
    assert type(plain._remote_outbox(1, None)) is Outbox


def _flags(extra):
    from megatron.training.arguments import build_parser, validate_args

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "1",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--pipeline-model-parallel-size", "2",
            "--emulated-forward-ms", "1", "--emulated-backward-ms", "2"]  # fmt: skip
    args = build_parser().parse_args(base + extra)
    validate_args(args, world_size=2)
    return args


def test_the_link_flags_reach_the_run_config():
    from megatron.training.config import RunConfig
    from megatron.training.training import emulated_link

    args = _flags(["--emulated-link-gbs", "0.125", "--emulated-link-latency-us", "50"])
    link = emulated_link(RunConfig.from_args(args, vocab_size=65).pipeline)
    assert (link.bandwidth_gbs, link.latency_s) == (0.125, pytest.approx(50e-6))
    assert emulated_link(RunConfig.from_args(_flags([]), vocab_size=65).pipeline) is None


@pytest.mark.parametrize("extra, message", [
    (["--emulated-link-gbs", "0"], "--emulated-link-gbs must be > 0"),
    (["--emulated-link-latency-us", "5"], "need --emulated-link-gbs"),
])  # fmt: skip
def test_bad_link_flags_are_one_line(extra, message):
    from megatron.common.errors import UserError

    with pytest.raises(UserError, match=message):
        _flags(extra)
