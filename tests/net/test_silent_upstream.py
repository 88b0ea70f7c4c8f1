"""A connected but silent upstream (a SIGSTOPped API server: its kernel still completes
handshakes from the backlog) costs a new connection at most one dial timeout."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from extractedprism.config.endpoints import Endpoint
from tests.fakes.upstream import EchoServer

DIAL_TIMEOUT = 0.5  # --health-timeout, the proxy's dial timeout
SLACK = 1.0  # scheduling on a loaded machine


def _errors(app, addr: str) -> float:  # type: ignore[no-untyped-def]
    v = app.metrics.registry.get_sample_value("extractedprism_connection_errors_total",
                                              {"upstream": addr})
    return v or 0.0


def _one_round_trip(app, i: int) -> None:  # type: ignore[no-untyped-def]
    msg = f"hello {i}\n".encode()
    with socket.create_connection(app.proxy_address, timeout=5) as c:
        c.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = c.recv(len(msg) - len(got))
            assert chunk, f"connection {i} closed after {got!r}"
            got += chunk
    assert got == msg


@pytest.mark.parametrize("relay", ["native", "python"])  # the check runs in C or Python
def test_silent_upstream_is_skipped_within_one_dial_timeout(make_app, servers, relay):
    (good,) = servers(1, EchoServer)
    # Listens, never accepts: connects succeed, nothing ever answers.
    with socket.create_server(("127.0.0.1", 0), backlog=128) as frozen:
        silent = Endpoint("127.0.0.1", frozen.getsockname()[1])
        # Health checks far apart: only client connections judge the silent one (a TCP
        # check would pass anyway).
        app = make_app([Endpoint("127.0.0.1", good.port), silent], health_interval=60.0,
                       health_timeout=DIAL_TIMEOUT, relay=relay)
        waits = []
        for i in range(60):
            t0 = time.monotonic()
            _one_round_trip(app, i)
            waits.append(time.monotonic() - t0)
            if _errors(app, str(silent)) >= 2 and i >= 10:
                break
        # The silent upstream was picked (and counted as a failed dial) ...
        assert _errors(app, str(silent)) >= 1
        # ... and no client waited on it longer than one dial timeout.
        assert max(waits) <= DIAL_TIMEOUT + SLACK, waits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay", ["native", "python"])
def test_two_silent_verdicts_exclude_the_upstream(make_app, servers, relay):
    """Silent verdicts count toward the same streak as failed dials (spec: "Failed and
    successful client dials count toward the same streak"; two exclude). On the native
    relay the connection is attached before the relay call judges it, so this checks
    that no success recorded at that attach resets the streak in between."""
    (good,) = servers(1, EchoServer)
    with socket.create_server(("127.0.0.1", 0), backlog=128) as frozen:
        silent = Endpoint("127.0.0.1", frozen.getsockname()[1])
        app = make_app([Endpoint("127.0.0.1", good.port), silent], health_interval=60.0,
                       health_timeout=DIAL_TIMEOUT, relay=relay)
        for i in range(200):  # each pick is random: bounded, ends once excluded
            _one_round_trip(app, i)
            if not app.registry.snapshot().get(str(silent)).healthy:
                break
        view = app.registry.snapshot().get(str(silent))
        assert not view.healthy, "two silent verdicts did not exclude the upstream"
        assert _errors(app, str(silent)) >= 2
        # Excluded: new connections no longer wait on it (probes are a minute apart).
        for i in range(20):
            t0 = time.monotonic()
            _one_round_trip(app, 1000 + i)
            assert time.monotonic() - t0 < DIAL_TIMEOUT


class _Listener:
    """An upstream that never speaks (iperf3's data connections): it only collects what
    each connection sends, and notes when ``want`` has arrived."""

    def __init__(self, want: bytes) -> None:
        self.want = want
        self.got = b""
        self.arrived = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="test-listener", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:  # health checks connect too; one connection at a time is enough
                conn, _ = self.sock.accept()
                with conn:
                    while chunk := conn.recv(4096):
                        self.got += chunk
                        if self.want in self.got:
                            self.arrived.set()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relay", ["native", "python"])
def test_a_single_upstream_is_not_judged(make_app, relay):
    """With no other upstream to move to, the check could only delay the connection: the
    relay starts at once, also for a protocol whose server never speaks first."""
    dial_timeout = 3.0  # long, so waiting for it cannot pass for relaying at once
    up = _Listener(b"world")
    try:
        app = make_app([Endpoint("127.0.0.1", up.port)], health_interval=60.0,
                       health_timeout=dial_timeout, relay=relay)
        with socket.create_connection(app.proxy_address, timeout=5) as c:
            c.sendall(b"hello ")  # the first bytes: the check would send them on, then wait
            deadline = time.monotonic() + dial_timeout + SLACK
            while b"hello " not in up.got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert up.got == b"hello ", up.got
            t0 = time.monotonic()
            c.sendall(b"world")
            assert up.arrived.wait(dial_timeout + SLACK), up.got
            waited = time.monotonic() - t0
        assert up.got == b"hello world"
        assert waited < dial_timeout / 2, f"the bytes waited {waited:.2f}s in the proxy"
        assert _errors(app, f"127.0.0.1:{up.port}") == 0
    finally:
        up.close()
