"""tools/benchmark_vocab_links.py's sizes and flags (no run): the messages' bytes the replay
charges, the arity's spelling, and each run's pretrain_gpt.py flags."""

from types import SimpleNamespace

from megatron.benchmarks.vocab_links import arity_of, message_bytes, run_args


def _options(**changes):
    values = dict(stages=8, microbatches=8, steps=5, fwd_ms=20.0, bwd_ms=40.0, vocab_fwd_ms=5.0,
                  vocab_bwd_ms=3.0, hidden_size=256, seq_length=1024, micro_batch_size=1,
                  link_gbs=0.1, link_latency_us=50.0, unpaced_embedding=True)  # fmt: skip
    return SimpleNamespace(**{**values, **changes})


def test_message_bytes_are_the_runs_fp32_messages():
    sizes = message_bytes(_options())
    assert sizes["activation"] == 4 * 1024 * 256
    assert sizes["hidden"] == 4 * 1024 * 257 and sizes["shard"] == 4 * 1024 * (2 * 256 + 3)
    assert "embed" not in sizes
    assert message_bytes(_options(unpaced_embedding=False))["embed"] == 4 * 1024 * 256


def test_the_fan_is_arity_n_minus_1_and_the_flags_carry_it():
    assert arity_of("fan", 8) == 7 and arity_of("2", 8) == 2
    args = run_args("paci", "fan", _options(), "/tmp/run")
    assert args[args.index("--vocab-parallel-tree-arity") + 1] == "fan"
    assert args[args.index("--emulated-link-gbs") + 1] == "0.1"
    assert "--emulated-link-unpaced-embedding" in args
