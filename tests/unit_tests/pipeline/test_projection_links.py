"""The projection with a link model (`projection.run_cluster`, `tools/project_paper_scale.py
--cluster ...`): the flags, the communication it builds, and the figures' invariants."""

import pytest

from megatron.benchmarks import projection
from megatron.benchmarks.projection_report import markdown
from megatron.pipeline.simulation.links import CLUSTERS, RankLayout

SMALL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "4096", "--stages", "4",
         "--micro-batch-sizes", "2", "--microbatches", "8"]  # fmt: skip


def _options(*flags):
    return projection.parse_args([*SMALL, *flags])


def test_no_link_flag_keeps_the_projection_as_it_was():
    options = _options("--schedules", "1f1b,paci")
    assert options.links is None and options.data_parallel == 1
    assert "summary" in projection.run(options)


def test_the_cluster_preset_and_the_flags_over_it():
    assert _options("--cluster", "gpu").links == CLUSTERS["gpu"]
    links = _options("--cluster", "gpu", "--inter-node-gbs", "50",
                     "--inter-node-latency-us", "10", "--ranks-per-node", "4").links  # fmt: skip
    assert (links.inter_bandwidth_gbs, links.inter_latency_s) == (50, pytest.approx(10e-6))
    assert (links.ranks_per_node, links.intra_bandwidth_gbs) == (4, 450)
    assert _options("--intra-node-gbs", "300").links.intra_bandwidth_gbs == 300


@pytest.mark.parametrize(
    "flags, message",
    [(["--dp", "2"], "need a link model"), (["--cluster", "gpu", "--dp", "0"], ">= 1"),
     (["--cluster", "gpu", "--inter-node-gbs", "0"], "inter_bandwidth_gbs"),
     (["--cluster", "gpu", "--overlap-modes", "sometimes"], "overlap-modes")],
)  # fmt: skip
def test_bad_cluster_flags_are_one_line_errors(flags, message):
    with pytest.raises(projection.SettingsError, match=message):
        _options(*flags)


def test_the_llama_preset_sets_tensor_parallel():
    options = projection.parse_args(["--preset", "llama-70b", "--cluster", "gpu"])
    assert (options.tensor_parallel, options.ffn_hidden_size, options.stages) == (8, 28672, 8)


def test_communication_takes_each_hop_and_group_on_its_link():
    options = _options("--cluster", "gpu", "--dp", "4", "--ranks-per-node", "8")
    shape, links = options.shape(), options.links
    comm = projection.cluster_communication(options, shape, 2)
    hop_bytes = 2 * 128 * 256 * 2
    # rank = dp + 4 * stage: stages 0-1 on node 0, 2-3 on node 1
    assert comm.hop_s[0][1] == pytest.approx(links.point_to_point_s(hop_bytes, True))
    assert comm.hop_s[1][2] == pytest.approx(links.point_to_point_s(hop_bytes, False))
    params = 2 * shape.layer_params() + shape.embedding_params()
    assert comm.reduce_s[0] == pytest.approx(links.all_reduce_s(params * 4, 4, True))
    assert RankLayout(1, 4, 4, 8).data_group_in_node(0)


def test_distributed_optimizer_reduce_scatters_and_gathers():
    options = _options("--cluster", "gpu", "--dp", "4", "--use-distributed-optimizer")
    shape, links = options.shape(), options.links
    comm = projection.cluster_communication(options, shape, 2)
    params = 2 * shape.layer_params()  # a middle stage
    assert comm.reduce_s[1] == pytest.approx(links.reduce_scatter_s(params * 4, 4, True))
    assert comm.gather_s[1] == pytest.approx(links.all_gather_s(params * 2, 4, True))


def test_free_links_reach_the_comparisons_pace():
    # no latency and near-infinite bandwidth: PACI with the split at the physical limit
    report = projection.run(_options(
        "--intra-node-gbs", "1e9", "--inter-node-gbs", "1e9", "--intra-node-latency-us", "0",
        "--inter-node-latency-us", "0", "--enable-vocab-parallel", "--schedules", "1f1b,paci",
        "--overlap-modes", "step", "--optimizer-bytes-per-param", "0"))  # fmt: skip
    pace = {r["schedule"]: r["fraction_of_limit"] for r in report["rows"]}
    assert pace["paci"] == pytest.approx(1.0, abs=0.01)
    assert pace["1f1b"] < 0.8


def test_slow_data_parallel_link_orders_the_overlap_modes():
    report = projection.run(_options(
        "--cluster", "gpu", "--dp", "4", "--ranks-per-node", "1", "--inter-node-gbs", "1",
        "--schedules", "1f1b,paci"))  # fmt: skip
    rate = {(r["schedule"], r["mode"]): r["samples_per_s"] for r in report["rows"]}
    assert rate[("1f1b", "overlap-grad-reduce")] >= rate[("1f1b", "step")]
    assert rate[("paci", "deferred-step")] > rate[("paci", "overlap-grad-reduce")]
    assert rate[("paci", "overlap-grad-reduce")] >= rate[("paci", "step")]
    assert ("1f1b", "deferred-step") not in rate
    text = markdown(report)
    assert "physical limit" in text and "deferred step" in text


def test_vocab_tree_arity_reaches_the_communication():
    split = ["--cluster", "gpu", "--enable-vocab-parallel", "--ranks-per-node", "1",
             "--inter-node-gbs", "0.5"]  # fmt: skip
    assert _options(*split).vocab_tree_arity == 2  # the runtime's default: the binary tree
    assert _options(*split, "--vocab-tree-arity", "fan").vocab_tree_arity == 3  # N - 1
    assert _options(*split, "--vocab-parallel-tree-arity", "3").vocab_tree_arity == 3
    options = _options(*split, "--vocab-tree-arity", "1")
    comm = projection.cluster_communication(options, options.shape(), 2)
    assert comm.vocab_tree_arity == 1
    runs = {arity: projection.run(_options(*split, "--vocab-tree-arity", arity, "--schedules",
                                           "1f1b", "--overlap-modes", "step"))
            for arity in ("2", "fan")}  # fmt: skip
    assert runs["fan"]["cluster"]["vocab_tree_arity"] == 3 and "on the fan" in markdown(runs["fan"])
    assert "a tree of arity 2" in markdown(runs["2"])
    # 1F1B waits for the messages: down, the fan's 3 in a row from the root, the tree's 2
    rate = {arity: run["rows"][0]["samples_per_s"] for arity, run in runs.items()}
    assert rate["2"] > rate["fan"]


@pytest.mark.parametrize(
    "flags, message",
    [(["--cluster", "gpu", "--enable-vocab-parallel", "--vocab-tree-arity", "0"], ">= 1 or fan"),
     (["--cluster", "gpu", "--enable-vocab-parallel", "--vocab-tree-arity", "two"], ">= 1 or fan"),
     (["--cluster", "gpu", "--vocab-tree-arity", "2"], "needs --enable-vocab-parallel"),
     (["--enable-vocab-parallel", "--vocab-tree-arity", "fan"], "a link model")],
)  # fmt: skip
def test_bad_vocab_tree_arity_is_a_one_line_error(flags, message):
    with pytest.raises(projection.SettingsError, match=message):
        _options(*flags)
