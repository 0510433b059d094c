"""A long run watched from outside: each worker's resident memory and thread count over time.

    python tools/soak_test.py --nproc 4 -- --pipeline-model-parallel-size 4 \
        --pipeline-schedule paci --train-iters 3000 ...   # pretrain_gpt.py's flags

Launches torchrun, samples every worker's VmRSS and thread count from /proc every
`--interval` seconds while training runs (from the run's "> setup done" line to its last
iteration's line: teardown is not training), and prints per rank the figures at the first
sample, halfway, at the last one, and the largest; exit status: torchrun's. Linux only
(/proc).
"""

import argparse
import os
import re
import subprocess
import sys
import time

from megatron.common.errors import run_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.split(":", 1) for line in handle if ":" in line)


def worker_sample(launcher: int) -> dict[int, tuple[float, int]]:
    """rank -> (resident MiB, threads) of the launcher's workers."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = _fields(int(pid))
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(status.get("PPid", "0")) != launcher:
            continue
        ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
        if ranks:
            resident_mib = int(status["VmRSS"].split()[0]) / 1024
            found[ranks[0]] = (resident_mib, int(status["Threads"]))
    return found


def _last_iteration_logged(log_text: str) -> bool:
    """Whether the run logged its last iteration ("iteration N/ N")."""
    return any(done == total for done, total in _ITERATION.findall(log_text))


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--log", default=None, help="write the run's output here")
    parser.add_argument("pretrain_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flags = args.pretrain_args[1:] if args.pretrain_args[:1] == ["--"] else args.pretrain_args
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(args.nproc),
               os.path.join(REPO, "pretrain_gpt.py"), *flags]  # fmt: skip
    log_path = args.log or os.path.join(REPO, "runs", "soak_test.log")
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    started = time.time()
    samples: list[tuple[float, dict]] = []
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            sample = worker_sample(process.pid)
            text = open(log_path).read()
            training = "> setup done" in text and not _last_iteration_logged(text)
            if training and len(sample) == args.nproc:
                samples.append((time.time() - started, sample))
            time.sleep(args.interval)
    if len(samples) < 2:
        print(f"fewer than two samples (exit status {process.returncode})")
        return process.returncode or 1
    (first_t, first), (_, middle), (last_t, last) = (samples[0], samples[len(samples) // 2],
                                                     samples[-1])  # fmt: skip
    print(f"{len(samples)} samples over {last_t - first_t:.0f} s of training; exit status "
          f"{process.returncode}")  # fmt: skip
    print("rank | RSS MiB first, half, last (max) | threads first, half, last (max)")
    for rank in sorted(first):
        peak_rss = max(sample[rank][0] for _, sample in samples if rank in sample)
        peak_threads = max(sample[rank][1] for _, sample in samples if rank in sample)
        rss = ", ".join(f"{s[rank][0]:.1f}" for s in (first, middle, last))
        threads = ", ".join(f"{s[rank][1]}" for s in (first, middle, last))
        print(f"{rank:4d} | {rss} ({peak_rss:.1f}) | {threads} ({peak_threads})")
    return process.returncode


if __name__ == "__main__":
    sys.exit(run_tool(main))
