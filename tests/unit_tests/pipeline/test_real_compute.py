"""The real-compute benchmark's balancing proposal (pure arithmetic; the runs are a benchmark)."""

from megatron.benchmarks.real_compute import balanced_last_layers, even_split


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


def test_every_benchmark_case_is_a_valid_two_stage_command_line():
    """The cases run through pretrain_gpt.py's own parser: a default that changes (e.g. tied
    embeddings, which PACI on two stages refuses) must not break the benchmark unnoticed."""
    from types import SimpleNamespace

    from megatron.benchmarks.real_compute import benchmark_cases
    from megatron.training.arguments import build_parser, validate_args

    options = SimpleNamespace(
        microbatches=[2, 8], pairs=2, num_layers=8, hidden_size=128, num_attention_heads=4,
        seq_length=128, micro_batch_size=2, microbatches_per_run=24,
        data_path="data/stdlib_text_document", tokenizer_model="data/tokenizer/stdlib.model",
    )  # fmt: skip
    cases = benchmark_cases(options, "runs/unused") + benchmark_cases(options, "runs/unused", 3)
    assert {c["schedule"] for c in cases} == {"1f1b", "paci"} and len(cases) == 16
    for case in cases:
        args = build_parser().parse_args(case["args"])
        validate_args(args, world_size=2, check_files=False)
        assert args.pipeline_model_parallel_size == 2
        assert args.global_batch_size == case["m"] * 2
