"""Where a stage's resident set peaks: a pretraining run with every runtime action measured.

Before each action (forward, backward, step) the kernel's resident-set high-water mark is reset
(/proc/self/clear_refs); after it the action's peak, the microbatches in flight and glibc's
heap figures (`mallinfo2`: bytes in use, heap size, free bytes in the heap) are recorded, one
JSON file per rank. `--default-malloc` leaves glibc's dynamic mmap threshold in place (the
behaviour before megatron/training/host_memory.py). Linux and glibc only; investigation, not
training (the summary's real peak covers only the last action here).

    torchrun --nproc-per-node 4 tools/memory_probe.py --probe-dir runs/probe/paci \\
        [--default-malloc] -- <pretrain_gpt.py flags>
    python tools/memory_probe.py --analyze runs/probe/flush runs/probe/paci
"""

import argparse
import ctypes
import json
import os
import sys

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _heap_figures() -> dict:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "heap": info.arena, "free": info.fordblks}


def _measured(execute, records: list):
    """`RankRuntime._execute`, recording each action's resident peak and heap figures."""
    from megatron.pipeline.accounting import (
        _reset_rss_high_water_mark,
        _resident_bytes,
        _status_bytes,
    )

    def execute_measured(runtime, action, *args, **kwargs):
        _reset_rss_high_water_mark()
        before = _resident_bytes()
        execute(runtime, action, *args, **kwargs)
        records.append({"action": action.kind.name, "in_flight": runtime.inflight_microbatches,
                        "before": before, "peak": _status_bytes("VmHWM"), **_heap_figures()})  # fmt: skip

    return execute_measured


def probe(probe_dir: str, default_malloc: bool, pretrain_argv: list[str]) -> int:
    from megatron.pipeline import runtime

    records: list = []
    runtime.RankRuntime._execute = _measured(runtime.RankRuntime._execute, records)
    if default_malloc:
        pretrain_argv = [*pretrain_argv, "--cpu-mmap-threshold-kib", "0"]
    from megatron.training.entry import run_pretraining
    from megatron.training.gpt_step import forward_step

    status = run_pretraining(pretrain_argv, forward_step)
    os.makedirs(probe_dir, exist_ok=True)
    with open(os.path.join(probe_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as out:
        json.dump(records, out)
    return status


def _stage_figures(directory: str, rank: int) -> tuple[float, float, float]:
    """(peak resident, most bytes in use, largest heap) in MiB over the run's actions."""
    with open(os.path.join(directory, f"rank{rank}.json")) as handle:
        records = json.load(handle)
    peak = max(max(r["peak"], r["before"]) for r in records)
    return (
        peak / MiB,
        max(r["in_use"] for r in records) / MiB,
        max(r["heap"] for r in records) / MiB,
    )


def analyze(directories: list[str]) -> str:
    """Per stage: peak resident set, most bytes in use, largest heap; change vs the first."""
    ranks = sorted(int(f[4:-5]) for f in os.listdir(directories[0]) if f.startswith("rank"))
    lines = ["| run | rank | peak resident (MiB) | vs first | most in use | largest heap |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for rank in ranks:
        first = _stage_figures(directories[0], rank)[0]
        for directory in directories:
            peak, in_use, heap = _stage_figures(directory, rank)
            lines.append(f"| {os.path.basename(directory.rstrip('/'))} | {rank} | {peak:.1f} | "
                         f"{100 * (peak / first - 1):+.2f}% | {in_use:.1f} | {heap:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pretrain_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe-dir")
    parser.add_argument("--default-malloc", action="store_true")
    parser.add_argument("--analyze", nargs="+", metavar="DIR")
    options = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if options.analyze:
        print(analyze(options.analyze))
        return 0
    if not options.probe_dir or not pretrain_argv:
        parser.error("--probe-dir DIR -- <pretrain flags>, or --analyze DIR ...")
    return probe(options.probe_dir, options.default_malloc, pretrain_argv)
