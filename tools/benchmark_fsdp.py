"""What fully sharded data parallelism saves per rank, and what it costs in time.

Trains one GPT (8 layers, hidden 256, the standard-library corpus, `--bf16`, Adam) on
`--nproc` processes with each data-parallel configuration in turn: the replicated optimizer,
the distributed optimizer (ZeRO-1), Megatron-FSDP's `optim_grads` (weights gathered from each
forward to its backward) and `optim_grads_params` (ZeRO-3), and prints one row each: this
rank's bytes of weights (FSDP: the fp32 rows), of fp32 main weights (FSDP: the same rows) and
of optimizer state, the real peak (resident set on CPU, CUDA's max allocated on a GPU) of the
stages' first ranks, throughput, and the
last loss (the four runs train the same model on the same data).

    .venv/bin/python tools/benchmark_fsdp.py [--nproc 4] [--iterations 10] [--output DIR] \
        [-- more pretrain_gpt.py flags, e.g. --pipeline-model-parallel-size 2 \
            --pipeline-schedule paci]

A benchmark, not a test: four runs of 10 iterations take about 5 minutes on 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys

from megatron.common.errors import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = (
    "--num-layers 8 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 16 "
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 "
    "--clip-grad 1.0 --adam-beta2 0.95 --attention-dropout 0 --hidden-dropout 0 --bf16 "
    "--data-path data/stdlib_text_document --split 969,30,1 --data-cache-path data/cache "
    "--tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer/stdlib.model "
    "--untie-embeddings-and-output-weights --log-interval 5 --eval-iters 0 --seed 1234"
).split()
CONFIGURATIONS = {
    "replicated": [],
    "distributed optimizer (ZeRO-1)": ["--use-distributed-optimizer"],
    "Megatron-FSDP optim_grads": ["--use-megatron-fsdp",
                                  "--data-parallel-sharding-strategy", "optim_grads"],
    "Megatron-FSDP optim_grads_params (ZeRO-3)": ["--use-megatron-fsdp"],
}  # fmt: skip


def run(name: str, flags: list[str], options) -> dict:
    output = os.path.join(options.output, name.split()[0].lower() + str(len(flags)))
    command = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
        f"--nproc-per-node={options.nproc}", "pretrain_gpt.py", *MODEL,
        "--train-iters", str(options.iterations), "--eval-interval", str(options.iterations),
        "--metrics-dir", output, *flags, *options.extra,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.load(open(os.path.join(output, "summary.json")))


def row(name: str, summary: dict) -> dict:
    mib = 1 / 2**20
    stages = summary["stages"]
    return {
        "configuration": name,
        "weights MiB/rank": round(max(summary["param_bytes_by_rank"]) * mib, 1),
        "main weights MiB/rank": round(max(s["main_param_bytes"] for s in stages) * mib, 1),
        "optimizer state MiB/rank": round(max(summary["optimizer_state_bytes_by_rank"]) * mib, 1),
        "real peak MiB (stage leaders)": round(max(s["real_peak_bytes"] for s in stages) * mib),
        "tokens/s": round(summary["tokens_per_second"]),
        "last loss": round(summary["loss"][-1], 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--output", default=os.path.join(REPO, "runs", "fsdp"))
    parser.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags, after --")
    options = parser.parse_args(argv)
    rows = [row(name, run(name, flags, options)) for name, flags in CONFIGURATIONS.items()]
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for values in rows:
        print("| " + " | ".join(str(values[key]) for key in header) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
