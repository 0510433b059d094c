"""The real-compute benchmark's balancing proposal (pure arithmetic; the runs are a benchmark)."""

from megatron.pipeline.simulation.real_compute import balanced_last_layers, even_split


def test_balancing_moves_layers_off_the_stage_with_the_output_layer():
    # 4 + 4 layers at 10 ms each; the output layer costs 45 ms more on the last stage.
    proposal = balanced_last_layers([0.040, 0.085], 4, 4)
    assert proposal["per_layer_ms"] == 10.0 and proposal["output_layer_ms"] == 45.0
    # k last layers: max((8 - k) * 10, k * 10 + 45) is 70, 65, 75 for k = 1, 2, 3
    assert proposal["proposed_last_layers"] == 2
    assert proposal["predicted_stage_ms"] == [60.0, 65.0]


def test_balanced_stages_keep_the_even_split():
    assert balanced_last_layers([0.040, 0.040], 4, 4)["proposed_last_layers"] == 4
    assert even_split(8) == (4, 4)
