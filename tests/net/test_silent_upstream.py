"""A connected but silent upstream (a SIGSTOPped API server: its kernel still completes
handshakes from the backlog) costs a new connection at most one dial timeout."""

from __future__ import annotations

import socket
import time

import pytest

from extractedprism.endpoints import Endpoint
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
