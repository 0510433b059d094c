"""The link model (`simulation.links`) against hand-computed closed forms, and the event engine
counting communication with it (`simulate(..., communication=...)`)."""

import math

import pytest

from megatron.pipeline.schedules import SIMULATED_SCHEDULES
from megatron.pipeline.schedules.base import ActionKind
from megatron.pipeline.schedules.vocab_passes import with_vocab_passes
from megatron.pipeline.simulation import simulate
from megatron.pipeline.simulation.links import (
    CLUSTERS,
    Communication,
    LinkModel,
    RankLayout,
    gradient_reduction_s,
    hop_matrix,
)

# alpha 1 us / 10 us, beta 100 / 10 GB/s: round numbers for the closed forms
LINKS = LinkModel(1e-6, 100.0, 10e-6, 10.0, 4)
GB = 1e9


def test_point_to_point_is_alpha_plus_bytes_over_beta():
    assert LINKS.point_to_point_s(GB, intra=True) == pytest.approx(1e-6 + 0.01)
    assert LINKS.point_to_point_s(GB, intra=False) == pytest.approx(10e-6 + 0.1)


def test_ring_all_reduce():
    # 2 (n - 1) / n * B / beta + 2 (n - 1) alpha, n = 4: 1.5 * 0.1 s + 6 * 10 us
    assert LINKS.all_reduce_s(GB, 4, intra=False) == pytest.approx(0.15 + 60e-6)
    assert LINKS.all_reduce_s(GB, 8, intra=True) == pytest.approx(1.75 * 0.01 + 14e-6)
    assert LINKS.all_reduce_s(GB, 1, intra=False) == 0.0


def test_reduce_scatter_all_gather_and_all_to_all():
    # (n - 1) / n * B / beta + (n - 1) alpha, n = 4
    expected = 0.75 * 0.1 + 3 * 10e-6
    assert LINKS.reduce_scatter_s(GB, 4, intra=False) == pytest.approx(expected)
    assert LINKS.all_gather_s(GB, 4, intra=False) == pytest.approx(expected)
    assert LINKS.all_to_all_s(GB, 4, intra=False) == pytest.approx(expected)
    # reduce-scatter + all-gather is the ring all-reduce
    pair = LINKS.reduce_scatter_s(GB, 4, False) + LINKS.all_gather_s(GB, 4, False)
    assert pair == pytest.approx(LINKS.all_reduce_s(GB, 4, False))


def test_tree_and_fan():
    step = 1e-6 + 0.01
    assert LINKS.tree_s(GB, 8, intra=True) == pytest.approx(3 * step)
    assert LINKS.tree_s(GB, 5, intra=True) == pytest.approx(3 * step)  # ceil(log2 5)
    assert LINKS.fan_s(GB, 8, intra=True) == pytest.approx(7 * step)
    assert LINKS.fan_s(GB, 1, intra=True) == 0.0
    # the output layer's tree: each rank forwards to its children one after another
    for n, messages in [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 4), (16, 6), (32, 8)]:
        assert LINKS.vocab_tree_s(GB, n, intra=True) == pytest.approx(messages * step)
    for n in (2, 4, 8):  # arity n - 1: the fan
        assert LINKS.vocab_tree_s(GB, n, intra=True, arity=n - 1) == LINKS.fan_s(GB, n, True)


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="inter_bandwidth_gbs"):
        LinkModel(inter_bandwidth_gbs=0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        LinkModel(ranks_per_node=0)


def test_gpu_cluster_preset():
    gpu = CLUSTERS["gpu"]
    assert (gpu.ranks_per_node, gpu.intra_bandwidth_gbs, gpu.inter_bandwidth_gbs) == (8, 450, 25)


def test_layout_pp8_dp4_on_four_nodes():
    # rank = dp + 4 * stage: stages 0-1 on node 0, 2-3 on node 1, ...
    layout = RankLayout(tensor=1, pipeline=8, data=4, ranks_per_node=8)
    assert layout.num_nodes == 4
    assert [layout.stages_share_node(s, s + 1) for s in range(7)] == [
        True, False, True, False, True, False, True,
    ]  # fmt: skip
    assert all(layout.data_group_in_node(s) for s in range(8))


def test_layout_tp8_pp8_dp4():
    # rank = tp + 8 * (dp + 4 * stage): a node per (stage, replica)
    layout = RankLayout(tensor=8, pipeline=8, data=4, ranks_per_node=8)
    assert layout.num_nodes == 32
    assert not any(layout.stages_share_node(s, s + 1) for s in range(7))
    assert not any(layout.data_group_in_node(s) for s in range(8))


def test_hop_matrix_and_reduction_take_the_right_link():
    layout = RankLayout(1, 4, 2, 4)  # stages 0-1 on node 0, 2-3 on node 1
    hops = hop_matrix(LINKS, layout, GB)
    assert hops[0][1] == pytest.approx(LINKS.point_to_point_s(GB, True))
    assert hops[1][2] == pytest.approx(LINKS.point_to_point_s(GB, False))
    assert gradient_reduction_s(LINKS, layout, 0, GB, False) == pytest.approx(
        LINKS.all_reduce_s(GB, 2, True)
    )
    assert gradient_reduction_s(LINKS, layout, 0, GB, True) == pytest.approx(
        LINKS.reduce_scatter_s(GB, 2, True)
    )


# ----------------------------------------------------------------------------- the engine
def _uniform(n: int, hop: float, reduce: float = 0.0, overlap: bool = False, **extra):
    hops = tuple(tuple(0.0 if i == j else hop for j in range(n)) for i in range(n))
    return Communication(hops, (reduce,) * n, overlap_grad_reduce=overlap, **extra)


def _run(name, n=4, m=8, steps=3, communication=None, **kwargs):
    schedule = kwargs.pop("schedule", SIMULATED_SCHEDULES[name])
    costs = dict(forward_cost=1.0, backward_cost=2.0)
    costs.update(kwargs)
    return simulate(schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                    communication=communication, **costs)  # fmt: skip


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "paci", "gpipe", "2bw"])
def test_uniform_hops_equal_the_fixed_latency(name):
    extra = {"weight_grad_cost": 1.0} if name == "zb-h1" else {}
    fixed = _run(name, p2p_latency=0.25, **extra)
    linked = _run(name, communication=_uniform(4, 0.25), **extra)
    assert linked.makespan == pytest.approx(fixed.makespan)


def test_flush_step_waits_for_the_whole_reduction():
    base = _run("1f1b", steps=3).makespan
    linked = _run("1f1b", steps=3, communication=_uniform(4, 0.0, reduce=0.5)).makespan
    # every stage's step waits 0.5 after its last backward; the steps are in series
    assert linked == pytest.approx(base + 3 * 0.5)


def test_overlap_hides_at_most_the_last_backward():
    base = _run("1f1b", steps=3).makespan
    hidden = _run("1f1b", steps=3, communication=_uniform(4, 0.0, 1.5, overlap=True))
    assert hidden.makespan == pytest.approx(base)  # 1.5 < B = 2: all hidden
    longer = _run("1f1b", steps=3, communication=_uniform(4, 0.0, 5.0, overlap=True))
    assert longer.makespan == pytest.approx(base + 3 * (5.0 - 2.0))


def test_deferred_step_hides_what_the_passes_before_the_landing_cover():
    plain = _run("paci", m=8, steps=8, deferred_step=True)
    hidden = _run("paci", m=8, steps=8, deferred_step=True,
                  communication=_uniform(4, 0.0, reduce=10.0))  # fmt: skip
    # a = 8 backwards and forwards (24 time units) run before the update lands
    assert hidden.makespan == pytest.approx(plain.makespan)
    exposed = _run("paci", m=8, steps=8, communication=_uniform(4, 0.0, reduce=10.0))
    assert exposed.makespan > plain.makespan + 8 * 9.0


def test_expert_all_to_all_is_added_to_forward_and_backward():
    expert = ((0.25, 0.5),) * 4
    linked = _run("1f1b", communication=_uniform(4, 0.0, expert_s=expert))
    assert linked.makespan == pytest.approx(_run("1f1b", forward_cost=1.25,
                                                 backward_cost=2.5).makespan)  # fmt: skip


def _vocab_forward_starts(n: int, hidden_s: float, arity: int):
    """When each rank's VF of microbatch 0 starts, from the end of the last stage's forward."""
    schedule = with_vocab_passes(SIMULATED_SCHEDULES["1f1b"])
    messages = {"hidden": tuple(tuple(hidden_s for _ in range(n)) for _ in range(n))}
    communication = _uniform(n, 0.0, message_s=messages, vocab_tree_arity=arity)
    result = _run("1f1b", n=n, m=1, steps=1, schedule=schedule, vocab_forward_cost=1.0,
                  vocab_backward_cost=1.0, communication=communication)  # fmt: skip
    last_forward = next(e for e in result.timeline
                        if e.stage == n - 1 and e.action.kind is ActionKind.FORWARD)  # fmt: skip
    return {e.stage: e.start_s - last_forward.end_s for e in result.timeline
            if e.action.kind is ActionKind.VOCAB_FORWARD}  # fmt: skip


def test_vocabulary_messages_go_down_the_tree():
    n, hidden_s = 8, 0.5
    starts = _vocab_forward_starts(n, hidden_s, arity=2)
    # the root (7) sends to 6 then 5; 6 to 4 then 3, 5 to 2 then 1; 4 to 0
    expected = {7: 0, 6: 1, 5: 2, 4: 2, 3: 3, 2: 3, 1: 4, 0: 3}
    assert starts == pytest.approx({rank: k * hidden_s for rank, k in expected.items()})
    assert max(starts.values()) == pytest.approx(LINKS_OF(hidden_s).vocab_tree_s(1, n, True))


def test_the_fan_is_the_tree_of_arity_n_minus_1():
    n, hidden_s = 4, 0.5
    starts = _vocab_forward_starts(n, hidden_s, arity=n - 1)
    # the last stage's children in the tree's order: 2, 1, 0, one message after another
    assert starts == pytest.approx({3: 0.0, 2: hidden_s, 1: 2 * hidden_s, 0: 3 * hidden_s})
    assert max(starts.values()) == pytest.approx(LINKS_OF(hidden_s).fan_s(1, n, True))


def LINKS_OF(hidden_s: float) -> LinkModel:
    """A link whose one-byte message takes `hidden_s` seconds."""
    return LinkModel(hidden_s, 1e12, hidden_s, 1e12, 8)


def test_the_communication_must_fit_the_pipeline():
    with pytest.raises(ValueError, match="4 x 4"):
        _run("1f1b", communication=_uniform(3, 0.0))
    with pytest.raises(ValueError, match="not both"):
        _run("1f1b", p2p_latency=1.0, communication=_uniform(4, 0.0))
    assert math.isfinite(_run("1f1b", communication=_uniform(4, 0.0)).makespan)


def test_one_link_per_rank_queues_the_pipeline_hops_too():
    """The emulated links: stage 0's forwards (cost 0.1) each send a 1 s activation; on one
    link the k-th arrives at k s, without it at 0.1 k + 1."""
    from megatron.pipeline.simulation.links import per_rank_link_communication

    one_link = per_rank_link_communication(2, 1.0, 0.0, {"activation": 1e9})
    assert one_link.one_link_per_rank and one_link.hop_s[0][1] == pytest.approx(1.0)
    assert one_link.message_s["stats"][0][1] == 0.0  # a kind not given costs nothing
    starts = {}
    for name, communication in (("one", one_link), ("free", _uniform(2, 1.0))):
        result = simulate(SIMULATED_SCHEDULES["gpipe"], num_stages=2, microbatches_per_step=3,
                          steps=1, forward_cost=[0.1, 0.0], backward_cost=0.0,
                          communication=communication, record_timeline=True)  # fmt: skip
        starts[name] = sorted(e.start_s for e in result.timeline
                              if e.stage == 1 and e.action.kind is ActionKind.FORWARD)  # fmt: skip
    assert starts["one"] == pytest.approx([1.1, 2.1, 3.1])
    assert starts["free"] == pytest.approx([1.1, 1.2, 1.3])
