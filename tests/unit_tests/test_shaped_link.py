"""tools/shaped_link.py: rate and size parsing, the ip/tc argument lists, the burst floor and
the one-line errors, without root or a namespace; and, as root with iproute2, one measured
run at 200mbit."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import tool_scripts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "shaped_link.py")


def load_shaped_link():
    """tools/shaped_link.py as a module (a script beside the packages, not one of them)."""
    return tool_scripts.load("shaped_link")


shaped_link = load_shaped_link()
ToolError = shaped_link.ToolError


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("200mbit", 200 * 10**6),
        ("25gbit", 25 * 10**9),
        ("500kbit", 500 * 10**3),
        ("1.5gbit", 1_500_000_000),
        ("64bit", 64),
        ("2Tbit", 2 * 10**12),
        (" 200MBIT ", 200 * 10**6),
    ],
)
def test_rates_are_bits_per_second_with_decimal_units(text, bits):
    assert shaped_link.parse_rate(text) == bits


def test_rate_none_is_the_unshaped_baseline():
    assert shaped_link.parse_rate("none") is None
    assert shaped_link.parse_rate("None") is None


@pytest.mark.parametrize("text", ["", "1g", "200", "1gbps", "mbit", "1 gbit", "-5mbit", "fast"])
def test_malformed_rates_are_refused_in_one_line(text):
    with pytest.raises(ToolError, match="malformed rate") as error:
        shaped_link.parse_rate(text)
    assert "\n" not in str(error.value)


def test_a_zero_rate_is_refused():
    with pytest.raises(ToolError, match="zero"):
        shaped_link.parse_rate("0mbit")


@pytest.mark.parametrize(
    "text, nbytes",
    [("256kb", 262144), ("256k", 262144), ("1mb", 2**20), ("70000", 70000), ("65550b", 65550)],
)
def test_sizes_use_binary_units_as_tc_does(text, nbytes):
    assert shaped_link.parse_size(text, "burst") == nbytes


@pytest.mark.parametrize("text", ["", "kb", "12kbit", "1.5mb", "-1", "lots"])
def test_malformed_sizes_are_refused(text):
    with pytest.raises(ToolError, match="malformed burst"):
        shaped_link.parse_size(text, "burst")


def test_burst_floor_is_one_full_loopback_frame():
    assert shaped_link.MIN_BURST == 65536 + 14
    assert shaped_link.parse_burst("256kb") == 262144
    assert shaped_link.parse_burst("65550") == 65550
    for too_small in ("64kb", "65537", "65549", "1kb"):
        with pytest.raises(ToolError, match="too small") as error:
            shaped_link.parse_burst(too_small)
        assert "65550" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["50ms", "1s", "250us", "0.5s"])
def test_latencies_pass_through(text):
    assert shaped_link.check_latency(text) == text


@pytest.mark.parametrize("text", ["50", "ms", "50 ms", "fast", "5min"])
def test_malformed_latencies_are_refused(text):
    with pytest.raises(ToolError, match="malformed latency"):
        shaped_link.check_latency(text)


def test_namespace_names_are_checked_and_default_ones_are_fresh():
    assert shaped_link.check_namespace("bench-1.a_b") == "bench-1.a_b"
    for bad in ("", "a/b", "..", "a b", "x" * 65):
        with pytest.raises(ToolError, match="bad namespace name"):
            shaped_link.check_namespace(bad)
    names = {shaped_link.default_namespace() for _ in range(20)}
    assert len(names) == 20
    for name in names:
        assert shaped_link.check_namespace(name) == name


def test_command_lists():
    name = "ns1"
    assert shaped_link.add_namespace_cmd(name) == ["ip", "netns", "add", "ns1"]
    assert shaped_link.loopback_up_cmd(name) == ["ip", "-n", "ns1", "link", "set", "lo", "up"]
    assert shaped_link.shape_cmd(name, 200 * 10**6, 262144, "50ms") == [
        "tc", "-n", "ns1", "qdisc", "add", "dev", "lo", "root", "tbf",
        "rate", "200000000bit", "burst", "262144", "latency", "50ms",
    ]  # fmt: skip
    assert shaped_link.exec_cmd(name, ["torchrun", "--standalone", "x.py"]) == [
        "ip", "netns", "exec", "ns1", "torchrun", "--standalone", "x.py",
    ]  # fmt: skip
    assert shaped_link.list_pids_cmd(name) == ["ip", "netns", "pids", "ns1"]
    assert shaped_link.delete_namespace_cmd(name) == ["ip", "netns", "delete", "ns1"]


def test_setup_shapes_unless_the_rate_is_none():
    shaped = shaped_link.setup_cmds("ns1", 10**9, 262144, "50ms")
    assert shaped == [
        shaped_link.loopback_up_cmd("ns1"),
        shaped_link.shape_cmd("ns1", 10**9, 262144, "50ms"),
    ]
    assert shaped_link.setup_cmds("ns1", None, 262144, "50ms") == [
        shaped_link.loopback_up_cmd("ns1")
    ]


def test_command_env_puts_gloo_on_the_loopback_and_keeps_the_rest():
    env = shaped_link.command_env({"PATH": "/bin", "MASTER_ADDR": "10.0.0.1", "X": "1"})
    assert env == {"PATH": "/bin", "MASTER_ADDR": "127.0.0.1", "X": "1", "GLOO_SOCKET_IFNAME": "lo"}


def test_privilege_errors_name_root_and_the_missing_tools():
    with pytest.raises(ToolError, match=r"^needs root: ip netns and tc .*uid 1000"):
        shaped_link.check_privileges(1000, which=lambda tool: "/usr/sbin/" + tool)
    with pytest.raises(ToolError, match=r"^needs root: ip netns and tc, and tc is not on PATH"):
        shaped_link.check_privileges(0, which=lambda tool: None if tool == "tc" else "/sbin/ip")
    with pytest.raises(ToolError, match="ip and tc are not on PATH"):
        shaped_link.check_privileges(0, which=lambda tool: None)
    shaped_link.check_privileges(0, which=lambda tool: "/usr/sbin/" + tool)


def test_exit_codes_follow_the_shell():
    assert shaped_link.exit_code(0) == 0
    assert shaped_link.exit_code(3) == 3
    assert shaped_link.exit_code(-signal.SIGTERM) == 128 + signal.SIGTERM


def test_measure_result_reports_the_median():
    result = shaped_link.measure_result("200mbit", 8 * 2**20, [0.5, 0.34, 0.335])
    assert list(result)[:4] == ["rate_requested", "bytes", "seconds", "mbit_per_s"]
    assert result["rate_requested"] == "200mbit" and result["bytes"] == 8 * 2**20
    assert result["seconds"] == 0.34
    assert result["mbit_per_s"] == pytest.approx(8 * 2**20 * 8 / 0.34 / 1e6, rel=1e-4)


def test_options_split_at_the_double_dash():
    args, command = shaped_link.parse_options(
        ["--rate", "200mbit", "--", "torchrun", "--rate", "x", "--", "y"]
    )
    assert args.rate == "200mbit" and args.burst == "256kb" and args.latency == "50ms"
    assert command == ["torchrun", "--rate", "x", "--", "y"]
    args, command = shaped_link.parse_options(["--measure", "8388608"])
    assert args.measure == "8388608" and command == []


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no command"),
        (["--rate", "1gbit"], "no command"),
        (["--rate", "1gbit", "--"], "no command"),
        (["--rate", "fast", "--", "true"], "malformed rate"),
        (["--burst", "64kb", "--", "true"], "too small"),
        (["--latency", "50", "--", "true"], "malformed latency"),
        (["--namespace", "a/b", "--", "true"], "bad namespace name"),
        (["--measure", "1024", "--", "true"], "give no command"),
        (["--measure", "0"], "at least 1 byte"),
        (["--measure", "1024", "--repeats", "0"], "--repeats"),
    ],
)
def test_requests_refused_before_touching_the_system(argv, message):
    with pytest.raises(ToolError, match=message):
        args, command = shaped_link.parse_options(argv)
        shaped_link.check_request(args, command)


def test_a_command_without_double_dash_is_refused():
    with pytest.raises(ToolError, match="without `--`"):
        shaped_link.parse_options(["--rate", "1gbit", "torchrun"])


def test_errors_are_one_line_on_the_command_line():
    """No root needed: the request is refused before any namespace is made."""
    result = subprocess.run(
        [sys.executable, TOOL, "--rate", "1gbps", "--", "true"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: malformed rate '1gbps'")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def _cannot_shape() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not on PATH (iproute2)" if missing else None


@pytest.mark.skipif(_cannot_shape() is not None, reason=str(_cannot_shape()))
def test_measured_rate_at_200mbit():
    """8 MiB between two gloo ranks on a 200mbit loopback: about 0.34 s a send, a few seconds
    with the two torch imports."""
    result = subprocess.run(
        [sys.executable, TOOL, "--measure", "8388608", "--rate", "200mbit"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["rate_requested"] == "200mbit" and measured["bytes"] == 8388608
    assert measured["mbit_per_s"] == pytest.approx(200, rel=0.15), measured
