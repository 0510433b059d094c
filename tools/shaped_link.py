"""Run a command with all of its ranks' traffic on one shaped link (a benchmark launcher).

    tools/shaped_link.py [--rate 1gbit|200mbit|none] [--burst 256kb] [--latency 50ms]
        [--namespace NAME] -- COMMAND ARGS...
    tools/shaped_link.py --rate 200mbit --measure 8388608

A fresh network namespace is made for the run (`ip netns add`), its loopback is brought up and
shaped with a token bucket (`tc qdisc add dev lo root tbf ...`), and COMMAND runs inside it with
GLOO_SOCKET_IFNAME=lo and MASTER_ADDR=127.0.0.1 (the rest of the environment passes through), so
gloo's TCP between the ranks crosses the shaped loopback: start the ranks with torchrun
--standalone or --master-addr 127.0.0.1. Only loopback addresses exist in the namespace. The
namespace is deleted when the command ends, also on an error, Ctrl-C or SIGTERM; processes
left in it then are killed. `--rate none` keeps the same isolated loopback unshaped: the
baseline. Needs root (ip netns, tc) and iproute2.

The shaped loopback is ONE queue for every rank's traffic, in both directions: a hub that all
ranks share, not a link or NIC per node. Two pairs of ranks talking at once split the rate.

tbf's burst must hold one full loopback frame (MTU 65536 plus a 14-byte header): with less,
every full-size segment is dropped and the job hangs, so a burst below 65550 bytes is refused.

`--measure BYTES` runs a built-in check instead of a command: two gloo processes in the
namespace, rank 0 sends BYTES to rank 1 (after one warm-up send) --repeats times, and one JSON
line is printed with the requested rate and the measured one (median of the repeats).
"""

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TOOL = os.path.abspath(__file__)
# One full loopback frame must fit in the bucket: the MTU, 65536, plus the 14-byte Ethernet
# header tbf counts (measured from 200mbit to 25gbit: 65537-65547 hang, 65549-65550 work).
MIN_BURST = 65536 + 14
DEFAULT_BURST = "256kb"
DEFAULT_LATENCY = "50ms"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Decimal multipliers, as tc reads `kbit`, `mbit`, ...
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
# Binary multipliers, as tc reads sizes (`kb` is 1024 bytes).
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
              "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30}  # fmt: skip


class ToolError(Exception):
    """A problem the user can fix, printed as one `error: ...` line without a traceback."""


class Stopped(Exception):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) arrived; raised by the handler."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --- pure parts: parsing and the argument lists ------------------------------------------


def parse_rate(text: str) -> int | None:
    """Bits per second of a tc-style rate (`1gbit`, `200mbit`, `500kbit`), None for `none`."""
    if text.strip().lower() == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", text.strip().lower())
    if not match:
        raise ToolError(
            f"malformed rate {text!r}: give a number and one of bit, kbit, mbit, gbit, tbit "
            "(e.g. 1gbit, 200mbit), or none"
        )
    bits = round(float(match.group(1)) * RATE_UNITS[match.group(2)])
    if bits < 1:
        raise ToolError(f"rate {text!r} is zero: give a positive rate, or none")
    return bits


def parse_size(text: str, what: str) -> int:
    """Bytes of a tc-style size (`256kb`, `1mb`, `70000`; kb is 1024 bytes)."""
    match = re.fullmatch(r"(\d+)([a-z]*)", text.strip().lower())
    if not match or match.group(2) not in SIZE_UNITS:
        raise ToolError(f"malformed {what} {text!r}: give bytes, or a number with kb, mb or gb")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def parse_burst(text: str) -> int:
    """The tbf bucket in bytes, refused below one full loopback segment."""
    burst = parse_size(text, "burst")
    if burst < MIN_BURST:
        raise ToolError(
            f"burst {text!r} ({burst} bytes) is too small: it must hold one full loopback "
            f"frame (MTU 65536 + 14 header bytes), at least {MIN_BURST} bytes; the default is "
            f"{DEFAULT_BURST}"
        )
    return burst


def check_latency(text: str) -> str:
    """tbf's latency (how long a packet may wait in the queue), as tc spells it."""
    if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", text.strip()):
        raise ToolError(f"malformed latency {text!r}: give a number with us, ms or s (e.g. 50ms)")
    return text.strip()


def check_namespace(name: str) -> str:
    """A namespace name that is safe as a file name under /var/run/netns."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in (".", ".."):
        raise ToolError(f"bad namespace name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return name


def default_namespace() -> str:
    """A fresh name per run, so runs side by side never share (or delete) a namespace."""
    return f"shaped-link-{os.getpid()}-{secrets.token_hex(3)}"


def add_namespace_cmd(name: str) -> list[str]:
    return ["ip", "netns", "add", name]


def loopback_up_cmd(name: str) -> list[str]:
    return ["ip", "-n", name, "link", "set", "lo", "up"]


def shape_cmd(name: str, bits_per_s: int, burst: int, latency: str) -> list[str]:
    """The tbf qdisc on the namespace's loopback; rate in bit/s and burst in bytes, exact."""
    return ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", latency]  # fmt: skip


def exec_cmd(name: str, command: list[str]) -> list[str]:
    return ["ip", "netns", "exec", name, *command]


def list_pids_cmd(name: str) -> list[str]:
    return ["ip", "netns", "pids", name]


def delete_namespace_cmd(name: str) -> list[str]:
    return ["ip", "netns", "delete", name]


def setup_cmds(name: str, bits_per_s: int | None, burst: int, latency: str) -> list[list[str]]:
    """Everything after `ip netns add`: lo up, then the shaping unless the rate is none."""
    cmds = [loopback_up_cmd(name)]
    if bits_per_s is not None:
        cmds.append(shape_cmd(name, bits_per_s, burst, latency))
    return cmds


def command_env(base: dict[str, str]) -> dict[str, str]:
    """The command's environment: gloo on the loopback, the rendezvous at 127.0.0.1."""
    return {**base, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


def check_privileges(euid: int, which=shutil.which) -> None:
    if euid != 0:
        raise ToolError(f"needs root: ip netns and tc must run as root (running as uid {euid})")
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        raise ToolError(
            f"needs root: ip netns and tc, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH (install iproute2)"
        )


def exit_code(returncode: int) -> int:
    """A shell's exit code for the child's: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def measure_result(rate: str, nbytes: int, seconds_each: list[float]) -> dict:
    seconds = statistics.median(seconds_each)
    return {
        "rate_requested": rate,
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "mbit_per_s": round(nbytes * 8 / seconds / 1e6, 3),
        "seconds_each": [round(s, 6) for s in seconds_each],
    }


def parse_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options before `--` and the command after it."""
    parser = argparse.ArgumentParser(
        prog="tools/shaped_link.py",
        usage="%(prog)s [--rate 1gbit|200mbit|none] [--burst 256kb] [--latency 50ms] "
        "[--namespace NAME] [--measure BYTES] -- COMMAND ARGS...",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", default="1gbit",
                        help="link rate: NUMBER bit|kbit|mbit|gbit|tbit (decimal, as tc), or "
                        "none for the unshaped baseline (default 1gbit)")  # fmt: skip
    parser.add_argument("--burst", default=DEFAULT_BURST,
                        help=f"tbf bucket, bytes or kb/mb (default {DEFAULT_BURST}; at least "
                        f"{MIN_BURST} bytes, one full loopback frame)")  # fmt: skip
    parser.add_argument("--latency", default=DEFAULT_LATENCY,
                        help="tbf latency: longest wait in the queue, which sets the queue's "
                        f"length (default {DEFAULT_LATENCY})")  # fmt: skip
    parser.add_argument("--namespace", help="namespace name (default: a fresh one per run); "
                        "must not exist yet")  # fmt: skip
    parser.add_argument("--measure", metavar="BYTES",
                        help="instead of a command: time a BYTES send between two gloo ranks "
                        "in the namespace and print one JSON line")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed sends for --measure")
    # The built-in check re-runs this file inside the namespace; not for users.
    parser.add_argument("--measure-worker", metavar="BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
    else:
        options, command = argv, []
    args, extra = parser.parse_known_args(options)
    if extra:
        raise ToolError(f"unknown option or a command without `--` before it: {' '.join(extra)}")
    return args, command


def check_request(args: argparse.Namespace, command: list[str]) -> None:
    """Everything about the request that can be refused before touching the system."""
    parse_rate(args.rate)
    parse_burst(args.burst)
    check_latency(args.latency)
    if args.namespace is not None:
        check_namespace(args.namespace)
    if args.measure is not None:
        if command:
            raise ToolError("--measure runs its own check: give no command with it")
        if parse_size(args.measure, "--measure size") < 1:
            raise ToolError("--measure needs at least 1 byte")
        if args.repeats < 1:
            raise ToolError("--repeats must be at least 1")
    elif not command:
        raise ToolError("no command: give one after `--` (or use --measure BYTES)")


# --- the system: namespace, child process, cleanup ---------------------------------------


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def run_quiet(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().replace("\n", "; ")
        raise ToolError(f"`{' '.join(cmd)}` failed: {detail}")


def namespace_exists(name: str) -> bool:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return name in (line.split()[0] for line in listed.splitlines() if line.strip())


def create_namespace(name: str) -> None:
    """`ip netns add` with the stop signals held, so a Ctrl-C cannot leave a namespace
    that exists but is not yet known to need deleting."""
    if namespace_exists(name):
        raise ToolError(f"namespace {name!r} exists already: pick another --namespace")
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        run_quiet(add_namespace_cmd(name))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def delete_namespace(name: str) -> None:
    """Kill what is left in the namespace (a deleted namespace would live on, nameless, for as
    long as one process stays in it), then delete it. Stop signals wait until it is done."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pids = subprocess.run(list_pids_cmd(name), capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        result = subprocess.run(delete_namespace_cmd(name), capture_output=True, text=True)
        if result.returncode != 0:
            print(f"warning: could not delete namespace {name}: {result.stderr.strip()}",
                  file=sys.stderr)  # fmt: skip
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def wait_forwarding(proc: subprocess.Popen) -> int:
    """The child's return code. A stop signal is passed on to the child's process group (the
    ranks torchrun started included); a second one kills the group."""
    stops = 0
    while True:
        try:
            return proc.wait()
        except Stopped as stop:
            stops += 1
            try:
                os.killpg(proc.pid, stop.signum if stops == 1 else signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_in_namespace(
    name: str, command: list[str], capture: bool = False, extra_env: dict | None = None
) -> tuple[int, str]:
    """Run `command` in the namespace (output streamed, or its stdout captured when `capture`);
    return its exit code and the captured output. The child has its own process group, so stop
    signals reach it once, through wait_forwarding."""
    # A file, not a pipe, holds captured output: waiting is then the only blocking call.
    with tempfile.TemporaryFile("w+") as captured:
        proc = subprocess.Popen(
            exec_cmd(name, command),
            env={**command_env(dict(os.environ)), **(extra_env or {})},
            stdout=captured if capture else None,
            process_group=0,
        )
        code = exit_code(wait_forwarding(proc))
        captured.seek(0)
        return code, captured.read()


def shaped(args: argparse.Namespace, body) -> int:
    """Make the namespace, run `body(name)` in it, and always delete it."""
    check_privileges(os.geteuid())
    name = args.namespace or default_namespace()
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}
    created = False
    try:
        create_namespace(name)
        created = True
        for cmd in setup_cmds(name, parse_rate(args.rate), parse_burst(args.burst), args.latency):
            run_quiet(cmd)
        return body(name)
    except Stopped as stop:
        return 128 + stop.signum
    finally:
        if created:
            delete_namespace(name)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def measure(args: argparse.Namespace, name: str) -> int:
    nbytes = parse_size(args.measure, "--measure size")
    worker = [sys.executable, TOOL, "--measure-worker", str(nbytes), "--repeats", str(args.repeats)]
    # c10d warns on every connection that 127.0.0.1 has no host name in the namespace: noise here.
    code, output = run_in_namespace(
        name, worker, capture=True, extra_env={"TORCH_CPP_LOG_LEVEL": "ERROR"}
    )
    if code != 0:
        raise ToolError(f"the --measure check failed in namespace {name} (exit code {code})")
    seconds_each = json.loads(output.strip().splitlines()[-1])
    print(json.dumps(measure_result(args.rate, nbytes, seconds_each)), flush=True)
    return 0


# --- the built-in check, run inside the namespace ----------------------------------------


def measure_rank(rank: int, port: int, nbytes: int, repeats: int) -> list[float]:
    """Rank 0 times a send to rank 1 until rank 1's one-element reply: the reply makes the
    time cover the delivery, not only the copy into the socket buffers."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))  # fmt: skip
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    reply = torch.zeros(1, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):  # the first send warms up the connection and TCP's window
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            dist.send(payload, 1)
            dist.recv(reply, 1)
            seconds.append(time.perf_counter() - start)
        else:
            dist.recv(payload, 0)
            dist.send(reply, 0)
    dist.destroy_process_group()
    return seconds[1:]


def measure_worker(args: argparse.Namespace) -> int:
    """Rank 0 in this process, rank 1 in a child; rank 0 prints the times as a JSON list."""
    nbytes = int(args.measure_worker)
    if args.rank == 1:
        measure_rank(1, args.port, nbytes, args.repeats)
        return 0
    with socket.socket() as probe:  # a free port; the namespace is fresh, so nothing races
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    peer = subprocess.Popen(
        [sys.executable, TOOL, "--measure-worker", str(nbytes), "--repeats", str(args.repeats),
         "--rank", "1", "--port", str(port)]
    )  # fmt: skip
    try:
        seconds = measure_rank(0, port, nbytes, args.repeats)
        if peer.wait(timeout=120) != 0:
            return 1
    finally:
        if peer.poll() is None:
            peer.kill()
    print(json.dumps(seconds), flush=True)
    return 0


def main(argv: list[str]) -> int:
    args, command = parse_options(argv)
    if args.measure_worker is not None:
        return measure_worker(args)
    check_request(args, command)
    if args.measure is not None:
        return shaped(args, lambda name: measure(args, name))
    return shaped(args, lambda name: run_in_namespace(name, command)[0])


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ToolError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
