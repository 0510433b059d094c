"""Megatron's --fim-data on a real run: the corpus's GPT-2 BPE with the four sentinels added
offline (tools/train_gpt2_bpe.py --special-tokens), two pipeline stages under PACI, half of
the documents rearranged as PSM or SPM (data/fim.py)."""

import math
import os
import socket
import subprocess
import sys

from megatron.training.data.datasets import build_data_iterators
from megatron.training.data.fim import FimSettings, resolve_token_ids
from megatron.training.tokenizer.tokenizer import build_tokenizer

CASE = "gpt_fim_pp2_paci"


def test_a_fim_run_trains(case_results):
    losses = case_results[CASE]["loss"]
    assert len(losses) == 16
    # 1,028 ids (1,024 BPE, then the 4 sentinels) padded to 1,152 logits: a random model's
    # loss is about ln(1152)
    assert abs(losses[0] - math.log(1152)) < 0.3
    assert losses[-1] < losses[0] - 0.5
    cache = os.path.join(case_results[CASE]["metrics_dir"], "cache")
    built = [name for name in os.listdir(cache) if name.endswith("description.txt")]
    assert built and all("GPTFIMDataset" in name for name in built)


def test_the_runs_samples_hold_the_sentinels(case_results):
    """The run's training samples, built again as the run built them: a share of them
    rearranged, each as long as a plain one."""
    gpt2 = os.path.join(os.path.dirname(case_results[CASE]["metrics_dir"]), "gpt2")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=f"{gpt2}/fim/vocab.json",
                                merge_file=f"{gpt2}/fim/merges.txt")  # fmt: skip
    sentinels = resolve_token_ids(FimSettings(), tokenizer)

    def train_samples(fim):
        train, _, _ = build_data_iterators(
            data_path=[f"{gpt2}/fim/stdlib_text_document"], mock_data=False, split="90,10,0",
            seq_length=64, seed=1234, tokenizer=tokenizer, data_cache_path=None,
            micro_batch_size=8, data_parallel_rank=0, data_parallel_size=1, train_samples=128,
            valid_samples=0, test_samples=0, sample_options={"fim": fim},
        )  # fmt: skip
        return [train.dataset[i]["tokens"].tolist() for i in range(128)]

    plain, rearranged = train_samples(None), train_samples(FimSettings(rate=0.5, spm_rate=0.5))
    assert all(len(sample) == 64 for sample in rearranged)
    changed = [i for i in range(128) if rearranged[i] != plain[i]]
    assert 0.3 * 128 < len(changed) < 0.9 * 128
    assert all(sentinels.prefix in rearranged[i] for i in changed)
    assert all(sentinels.middle not in plain[i] for i in range(128))


def test_a_tokenizer_without_the_sentinels_stops_the_run_in_one_line():
    """The corpus's SentencePiece model has no <fim_prefix>: one line naming it, no traceback,
    before the model is built."""
    from test_bad_input import REPO, assert_clean_error

    with socket.socket() as probe:  # a free port for the one-process group
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    environment = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip

    args = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3",
        "--data-path", os.path.join(REPO, "data", "stdlib_text_document"),
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", os.path.join(REPO, "data", "tokenizer", "stdlib.model"),
        "--fim-data", "--fim-eod-token", "</s>",
    ]  # fmt: skip
    command = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args]
    completed = subprocess.run(command, capture_output=True, text=True, env=environment,
                               timeout=300)  # fmt: skip
    assert_clean_error(completed,
                       "error: --fim-prefix-token '<fim_prefix>' is not a token of the tokenizer "
                       "(SentencePieceTokenizer)")  # fmt: skip
