"""Node lifecycle with real processes: handover of the listeners to a successor, the
shutdown drain, the spec's shutdown with --shutdown-drain-timeout=0, SIGHUP."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import pytest

from tests.fakes.upstream import IdentityServer
from tests.logcheck import parse_logfmt
from tests.process.lifecycle import (
    ClientLoop,
    HeldConnections,
    Proc,
    healthz_ok,
    max_in_any_window,
    proxy_args,
    start_first,
)
from tests.util import run_cli, wait_until

pytestmark = pytest.mark.timeout(120)

GREETING = b"up\n"
# The contract's bound for the spec's shutdown ("exits 0 within the window plus 6 s").
SHUTDOWN_BOUND_S = 6.0


@pytest.fixture
def upstream():
    up = IdentityServer(name="up").start()
    yield up
    up.stop()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def test_handover_without_a_refused_or_reset_connection(upstream, tmp_path: Path):
    sock_path = str(tmp_path / "handover.sock")
    drain = 3.0
    extra = ("--handover-socket", sock_path, "--shutdown-drain-timeout", f"{drain:g}s")
    old, bind, health = start_first(upstream.address, *extra)
    new: Proc | None = None
    held: HeldConnections | None = None
    loop: ClientLoop | None = None
    try:
        wait_until(lambda: os.path.exists(sock_path), 10, message="the old one offers")
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        held = HeldConnections(bind, 12, GREETING)
        loop = ClientLoop(bind, GREETING, every=0.005, max_attempts=4000, max_s=60).start()
        wait_until(lambda: loop.result.ok >= 50, 20, message="the loop runs through the old one")
        # The ports are in use: the successor starts anyway, on the same sockets.
        new = Proc(proxy_args(bind, health, upstream.address, *extra))
        wait_until(lambda: new.saw("handover: took over listeners"), 20,
                   message="the successor took the listeners")
        wait_until(lambda: old.saw("a successor accepts now"), 10,
                   message="the old one stopped accepting")
        assert old.popen.poll() is None and new.popen.poll() is None
        # Keep connecting across the switch and after it.
        before = loop.result.ok
        wait_until(lambda: loop.result.ok >= before + 100, 20, message="connections after")
        # The old one keeps its connections and does not exit on its own.
        assert not held.closed_at and old.popen.poll() is None
        assert healthz_ok(health)
        t_term = time.monotonic()
        old.signal(signal.SIGTERM)
        assert old.wait(drain + SHUTDOWN_BOUND_S + 5) == 0
        exited = time.monotonic() - t_term
        wait_until(held.all_closed, 5, message="every held connection closed")
        result = loop.stop()
        assert result.failed == 0, (result.failures, result.attempts)
        assert result.ok >= 150
        assert exited < drain + SHUTDOWN_BOUND_S
        # Closed spread over the drain window, not at once: never more than a quarter
        # within a tenth of the window, and the first and last at least half a window
        # apart.
        times = [t - t_term for t in held.closed_at.values()]
        assert max_in_any_window(times, drain / 10) <= len(times) // 4, sorted(times)
        assert max(times) - min(times) >= drain / 2, sorted(times)
        assert max(times) <= drain + 1.0, sorted(times)
        # The successor serves on, and offers its listeners for the next upgrade.
        assert new.popen.poll() is None and healthz_ok(health)
        with socket.create_connection(("127.0.0.1", bind), timeout=5) as c:
            assert c.recv(3) == GREETING
        assert os.path.exists(sock_path)
        assert new.saw("handover: offering listeners")
    finally:
        if loop is not None:
            loop.stop()
        if held is not None:
            held.close()
        old.reap()
        if new is not None:
            new.reap()


def test_stale_handover_socket_is_removed_and_the_start_is_normal(upstream, tmp_path: Path):
    path = tmp_path / "handover.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # a socket file nobody answers on (an instance that died)
    proc, bind, _ = start_first(upstream.address, "--handover-socket", str(path))
    try:
        assert proc.saw("nobody answers on the handover socket; removed it")
        with socket.create_connection(("127.0.0.1", bind), timeout=5) as c:
            assert c.recv(3) == GREETING
        wait_until(lambda: proc.saw("handover: offering listeners"), 10,
                   message="offering on the path")
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not path.exists()  # its own socket file goes with it
    finally:
        proc.reap()


def test_shutdown_drain_without_successor_refuses_and_spreads_closes(upstream):
    drain = 4.0
    proc, bind, _ = start_first(upstream.address, "--shutdown-drain-timeout", f"{drain:g}s")
    held = HeldConnections(bind, 20, GREETING)
    try:
        t_term = time.monotonic()
        proc.signal(signal.SIGTERM)
        wait_until(lambda: _refused(bind), 2, message="new connections refused at SIGTERM")
        assert proc.wait(drain + SHUTDOWN_BOUND_S + 5) == 0
        exited = time.monotonic() - t_term
        assert exited < drain + SHUTDOWN_BOUND_S
        wait_until(held.all_closed, 5, message="every held connection closed")
        times = [t - t_term for t in held.closed_at.values()]
        assert max_in_any_window(times, drain / 10) <= len(times) // 4, sorted(times)
        assert max(times) - min(times) >= drain / 2, sorted(times)
        assert "shutdown drain: closing connections spread over the window" in proc.log
    finally:
        held.close()
        proc.reap()


def test_drain_zero_is_the_spec_shutdown(upstream):
    proc, bind, _ = start_first(upstream.address, "--shutdown-drain-timeout=0s")
    held = HeldConnections(bind, 20, GREETING)
    try:
        t_term = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND_S + 4) == 0
        assert time.monotonic() - t_term < SHUTDOWN_BOUND_S
        wait_until(held.all_closed, 5, message="every held connection closed")
        # Force-closed together by the shutdown, not spread.
        times = sorted(held.closed_at.values())
        assert times[-1] - times[0] < 1.0, [t - t_term for t in times]
        assert "shutdown drain" not in proc.log
        closes = [r for r in parse_logfmt(proc.log) if r["msg"] == "shutdown: force-closed connections"]
        assert [r["count"] for r in closes] == ["20"], closes
    finally:
        held.close()
        proc.reap()


def test_sighup_is_logged_and_ignored(upstream):
    proc, bind, health = start_first(upstream.address)
    try:
        for n in (1, 2):
            proc.signal(signal.SIGHUP)
            wait_until(lambda n=n: proc.log.count("SIGHUP: configuration is read at start; "
                                                  "restart to apply changes") == n, 10,
                       message=f"{n} SIGHUP lines")
        assert proc.popen.poll() is None and healthz_ok(health)
        with socket.create_connection(("127.0.0.1", bind), timeout=5) as c:
            assert c.recv(3) == GREETING
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.reap()


@pytest.mark.parametrize("value", ["-1s", "soon", "nan"])
def test_bad_shutdown_drain_timeout_exits_2_naming_the_flag(value):
    res = run_cli("--endpoints", "10.0.0.1:6443", f"--shutdown-drain-timeout={value}")
    assert res.returncode == 2
    assert f"--shutdown-drain-timeout ({value})" in res.stderr
    res = run_cli(env={"EP_ENDPOINTS": "10.0.0.1:6443", "EP_SHUTDOWN_DRAIN_TIMEOUT": value})
    assert res.returncode == 2 and "--shutdown-drain-timeout" in res.stderr


def test_bad_static_endpoints_mode_exits_2():
    res = run_cli("--endpoints", "10.0.0.1:6443", "--static-endpoints=sometimes")
    assert res.returncode == 2
    assert "--static-endpoints (sometimes)" in res.stderr and "always, fallback" in res.stderr
