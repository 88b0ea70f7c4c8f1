"""The command line as an operator runs it: real subprocesses, env vars, signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from typing import IO

import pytest

from extractedprism.config.parser import unknown_env_vars
from extractedprism.config.table import FLAGS
from tests.fakes.upstream import IdentityServer
from tests.logcheck import parse_logfmt
from tests.process.proxyproc import start_proxy as start_proxy_logged
from tests.util import (
    PYTHON,
    ROOT,
    free_ports,
    http,
    run_cli,
    start_on_free_ports,
    wait_until,
)


def test_invalid_config_exits_2_before_opening_ports():
    bind, health = free_ports(2)
    res = run_cli("--endpoints", "10.0.0.1:99999", "--bind-port", str(bind),
                  "--health-port", str(health), "--health-timeout", "20s",
                  "--log-level", "loud")
    assert res.returncode == 2
    assert "--endpoints (10.0.0.1:99999)" in res.stderr
    assert "--health-timeout (20s) must be less than --health-interval (20s)" in res.stderr
    assert "--log-level (loud)" in res.stderr


def test_env_vars_are_read_and_validated():
    res = run_cli(env={"EP_ENDPOINTS": "10.0.0.1:6443", "EP_DRAIN_TIMEOUT": "-3s",
                       "EP_ENABLE_DISCOVERY": "false", "EP_HEALTH_CHECK": "readyz"})
    assert res.returncode == 2
    # Named by the variable the value came from (issue 30).
    assert "EP_DRAIN_TIMEOUT (-3s) must not be negative" in res.stderr
    assert "--health-check=readyz requires --health-check-ca-file" in res.stderr


def test_env_non_finite_durations_and_numeric_hosts_exit_2_naming_flag_and_value():
    res = run_cli(env={"EP_ENDPOINTS": "10.0.0.256:6443", "EP_HEALTH_INTERVAL": "nan",
                       "EP_DRAIN_TIMEOUT": "inf", "EP_BIND_ADDRESS": "bad_host!",
                       "EP_HEALTH_BIND_ADDRESS": "", "EP_ENABLE_DISCOVERY": "false"})
    assert res.returncode == 2, res.stderr
    assert "EP_HEALTH_INTERVAL (nan) is invalid" in res.stderr
    assert "EP_DRAIN_TIMEOUT (inf) is invalid" in res.stderr
    assert "host '10.0.0.256' is not an IP address" in res.stderr
    assert res.stderr.count("must be a valid IP address") == 1  # --bind-address only
    assert "Traceback" not in res.stderr


def test_stall_timeout_from_flag_or_env_is_validated_naming_it():
    res = run_cli("--endpoints", "10.0.0.1:6443", "--enable-discovery=false",
                  "--stall-timeout", "200ms")
    assert res.returncode == 2
    assert "--stall-timeout (200ms) must be 0 (off) or at least 500ms" in res.stderr
    res = run_cli(env={"EP_ENDPOINTS": "10.0.0.1:6443", "EP_ENABLE_DISCOVERY": "false",
                       "EP_STALL_TIMEOUT": "soon"})
    assert res.returncode == 2
    assert "EP_STALL_TIMEOUT (soon) is invalid" in res.stderr  # named as it was given
    assert "Traceback" not in res.stderr


def test_missing_endpoints_is_an_error():
    res = run_cli()
    assert res.returncode == 2
    assert "--endpoints is required" in res.stderr


def test_version_and_help():
    res = run_cli("--version")
    assert res.returncode == 0 and "extractedprism" in res.stdout
    res = run_cli("--help")
    assert res.returncode == 0
    for opt in ("--bind-address", "--drain-timeout", "--health-check-token-file",
                "--max-connections", "--kubeconfig", "--log-format"):
        assert opt in res.stdout


def _help_blocks(text: str) -> dict[str, str]:
    """--help's text per option: the option's line and its indented continuation."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  --"):
            current = stripped.split()[0]
            blocks[current] = stripped
        elif current and line.startswith("    ") and stripped:
            blocks[current] += " " + stripped
        else:
            current = None
    return blocks


def test_help_says_each_default_once_and_endpoints_is_required():
    res = run_cli("--help")
    assert res.returncode == 0
    assert "None" not in res.stdout
    blocks = _help_blocks(res.stdout)
    assert set(blocks) >= {f.option for f in FLAGS}
    for flag in FLAGS:
        block = " ".join(blocks[flag.option].split())
        assert block.count("(default:") <= 1, block
        assert block.count(f"[env var: {flag.env}]") == 1, block
        if flag.name == "endpoints":
            assert "(required)" in block and "(default:" not in block
        else:
            assert block.count("(default:") == 1, block
        if flag.default:
            assert f"(default: {flag.default})" in block, block
    usage = res.stdout.split("\n\n")[0]
    assert " --endpoints HOST:PORT" in usage and "[--endpoints" not in usage


def test_unknown_ep_variable_warns_once_naming_the_closest_flag(upstream, tmp_path):
    p = start_proxy_logged(tmp_path, "--endpoints", upstream.address,
                           env={"EP_HELTH_INTERVAL": "5s", "EP_NOT_A_FLAG_AT_ALL": "1"})
    try:
        wait_until(lambda: len(unknown(p)) == 2, 10, message="two warnings")
    finally:
        assert p.stop() == 0
    warnings = unknown(p)
    assert len(warnings) == 2  # once each, not per interval
    by_var = {r["variable"]: r for r in warnings}
    typo = by_var["EP_HELTH_INTERVAL"]
    assert typo["level"] == "warn" and typo["closest"] == "EP_HEALTH_INTERVAL"
    assert "EP_HEALTH_INTERVAL" in typo["msg"]
    assert "closest" not in by_var["EP_NOT_A_FLAG_AT_ALL"]


def unknown(p):
    return [r for r in parse_logfmt(p.stderr())
            if r["msg"].startswith("unknown environment variable")]


def test_closest_flag_is_within_three_edits():
    found = dict(unknown_env_vars({"EP_HELTH_INTERVAL": "", "EP_BIND_PROT": "",
                                   "EP_ENDPOINTSXXXX": "", "EP_ENDPOINTS": "",
                                   "PATH": "", "EP_LOG_FROMAT": ""}))
    assert found == {"EP_HELTH_INTERVAL": "EP_HEALTH_INTERVAL",
                     "EP_BIND_PROT": "EP_BIND_PORT", "EP_ENDPOINTSXXXX": None,
                     "EP_LOG_FROMAT": "EP_LOG_FORMAT"}


def test_invalid_log_format_exits_2_naming_the_flag():
    res = run_cli("--endpoints", "10.0.0.1:6443", "--log-format", "xml")
    assert res.returncode == 2
    assert "--log-format (xml)" in res.stderr and "logfmt, json" in res.stderr
    res = run_cli("--endpoints", "10.0.0.1:6443", env={"EP_LOG_FORMAT": "text"})
    assert res.returncode == 2 and "EP_LOG_FORMAT (text)" in res.stderr


def start_proxy(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str],
                                                                           int, int]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    full_env.update(env or {})

    def start(ports: list[int]) -> subprocess.Popen[str]:
        bind, health = ports
        return subprocess.Popen(
            [PYTHON, "-m", "extractedprism", "--bind-port", str(bind),
             "--health-port", str(health), "--enable-discovery=false",
             "--health-interval", "2s", "--health-timeout", "1s", *args],
            env=full_env, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    proc, (bind, health) = start_on_free_ports(start, lambda ports: _health_ok(ports[1]))
    if proc.poll() is not None:
        err = proc.stderr.read() if proc.stderr else ""
        reap(proc)
        raise AssertionError(f"the proxy exited with {proc.returncode}: {err}")
    return proc, bind, health


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill the proxy if a test left it running, and close its stderr pipe."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stderr:
        proc.stderr.close()


def _health_ok(port: int) -> bool:
    try:
        return http(("127.0.0.1", port), "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


@pytest.fixture
def upstream():
    up = IdentityServer(name="up").start()
    yield up
    up.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_open_connections_exits_0_within_6s(upstream, sig):
    proc, bind, _ = start_proxy("--endpoints", upstream.address)
    try:
        conns = [socket.create_connection(("127.0.0.1", bind), timeout=5) for _ in range(20)]
        for c in conns:
            assert c.recv(3) == b"up\n"
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
        assert rc == 0
        assert time.monotonic() - t0 < 6
        for c in conns:  # force-closed by the shutdown
            c.settimeout(5)
            try:
                assert c.recv(10) == b""
            except ConnectionResetError:
                pass
            c.close()
    finally:
        reap(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_acted_on_with_a_partial_health_request_in_flight(upstream, sig):
    # Regression: with a health-port request blocked mid-read and connections open, the
    # kernel could hand the signal to a non-main thread and the process ignored it.
    # Several trials, because it happened in about half of them.
    for _ in range(6):
        proc, bind, health = start_proxy("--endpoints", upstream.address)
        try:
            conns = [socket.create_connection(("127.0.0.1", bind), timeout=5)
                     for _ in range(5)]
            for c in conns:
                assert c.recv(3) == b"up\n"
            partial = socket.create_connection(("127.0.0.1", health), timeout=5)
            partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line
            conns.append(partial)
            t0 = time.monotonic()
            proc.send_signal(sig)
            assert proc.wait(timeout=10) == 0
            assert time.monotonic() - t0 < 6
            for c in conns:
                c.close()
        finally:
            reap(proc)


def _collect(stream: IO[str], into: list[str]) -> None:
    for line in stream:
        into.append(line)


def test_env_configuration_runs_and_sigusr1_dumps_threads(upstream):
    proc, bind, _ = start_proxy(env={"EP_ENDPOINTS": upstream.address,
                                          "EP_LOG_LEVEL": "error"})
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=_collect, args=(proc.stderr, lines),
                              name="test-stderr-reader")
    reader.start()
    names = ("acceptor", "ticker", "heartbeat", "health-http", "pipe-idle-")
    conns = 6  # concurrent clients: as many pipe threads, started on demand
    try:
        clients = [socket.create_connection(("127.0.0.1", bind), timeout=5)
                   for _ in range(conns)]
        for c in clients:
            assert c.recv(3) == b"up\n"
            c.close()

        # The dump is on stderr before the process is asked to stop: one record each.
        def dumps() -> list[dict[str, str]]:
            return [r for r in parse_logfmt("".join(lines)) if r["msg"] == "thread dump"]

        def grouped() -> str | None:
            # Parked pipe threads in one place: one group, one stack (all of them, or
            # those past their pipe release when the dump falls on its moment). Asked
            # again until the threads have parked after their clients left.
            done = [r["dump"] for r in dumps()
                    if re.search(r"^--- [2-9] threads: pipe-idle-\* parked in _park ",
                                 r["dump"], re.M)]
            if done:
                return done[0]
            proc.send_signal(signal.SIGUSR1)
            return None

        wait_until(grouped, 10, interval=0.5, message="a thread dump with the pool grouped")
        text = grouped()
        assert text is not None
        for n in names:
            assert f": {n}" in text, f"{n} not in {text}"
        assert text.count("_worker_loop") < 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)  # EOF once the process is gone
        reap(proc)


@pytest.mark.parametrize("busy_flag,other_flag,flags", [
    ("--bind-port", "--health-port", "--bind-address/--bind-port"),
    ("--health-port", "--bind-port", "--health-bind-address/--health-port"),
])
def test_port_in_use_names_the_listener_and_address(upstream, busy_flag, other_flag, flags):
    with socket.create_server(("127.0.0.1", 0)) as busy, socket.socket() as spare:
        port = busy.getsockname()[1]
        spare.bind(("127.0.0.1", 0))
        other = spare.getsockname()[1]
        spare.close()
        res = run_cli("--endpoints", upstream.address, busy_flag, str(port),
                      other_flag, str(other), "--enable-discovery=false")
    if res.returncode == 1 and f"127.0.0.1:{other} " in res.stderr:
        pytest.skip("the spare port was taken meanwhile")  # cannot be held and free
    assert res.returncode == 1
    records = parse_logfmt(res.stderr)  # logging is set up: the error is a record too
    [fatal] = [r for r in records if r["level"] == "fatal"]
    assert fatal["msg"] == (f"cannot listen on 127.0.0.1:{port} ({flags}): "
                            "address already in use")
    assert fatal["address"] == f"127.0.0.1:{port}" and fatal["flags"] == flags


def test_negative_value_after_a_space_reaches_validation():
    # argparse alone would say "expected one argument" without naming the value.
    res = run_cli("--endpoints", "10.0.0.1:6443", "--drain-timeout", "-1s")
    assert res.returncode == 2
    assert "--drain-timeout (-1s) must not be negative" in res.stderr
    # A following option is still an option, not a value.
    res = run_cli("--endpoints", "10.0.0.1:6443", "--drain-timeout", "--log-level", "info")
    assert res.returncode == 2
    assert "--drain-timeout" in res.stderr
