"""/upstreams tells each upstream's whole story (issue 15 item 1), state by state.

A real App on loopback, real upstreams; where a test needs probes and dials to
disagree (a dial-marked failure) or readiness to flip on cue, the App's injected
prober stands in for the health checks, and the data path stays real.
"""

from __future__ import annotations

import json
import re
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from extractedprism import __version__
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.state import ProbeResult
from tests.net.test_drain import open_to
from tests.util import connect, first_checks_recorded, http, read_line, wait_until, whoami

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")
UPSTREAM_KEYS = {
    "address", "source", "state", "since", "healthy", "draining", "draining_reason",
    "close_deadline", "ready", "readiness", "ready_reason", "failures", "last_check_at",
    "last_check_error", "last_error_source", "tier", "rtt_seconds", "active_connections",
    "total_connections", "dials_in_flight", "dial_stalled", "bytes_up", "bytes_down",
    "answer_hedges", "admin", "connection_share", "fair_share", "weight",
    "rebalance_closes", "stalls", "stalled_connections", "suspect", "stall_checks",
    "slow_not_counted",
}


def doc(app: Any) -> dict[str, Any]:
    status, headers, body = http(app.health_address, "/upstreams")
    assert status == 200 and headers["content-type"] == "application/json"
    return json.loads(body)


def entry(app: Any, address: str) -> dict[str, Any]:
    found = [u for u in doc(app)["upstreams"] if u["address"] == address]
    assert len(found) == 1, doc(app)
    return found[0]


def when(text: str) -> float:
    assert RFC3339_MS.match(text), text
    return datetime.fromisoformat(text).timestamp()


def ok_prober(ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
    return ProbeResult(ok=True, rtt=0.001, reason="")


def readyz_by_hand(ready: dict[str, bool], tmp_path: Path) -> dict[str, Any]:
    """make_app settings for --health-check=readyz whose prober passes the TCP check and
    answers /readyz with ``ready[address]``, which the test flips (the CA file is unused)."""
    def prober(ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
        r = ready[str(ep)]
        return ProbeResult(ok=True, rtt=0.001, reason="", ready=r,
                           ready_reason="" if r else "readyz: HTTP 503")

    ca = tmp_path / "ca.pem"
    ca.write_text("unused: the prober stands in for the TLS probe\n")
    return {"prober": prober, "health_check": "readyz", "health_check_ca_file": str(ca)}


def test_top_level_keys_and_a_healthy_upstream(make_app, servers) -> None:
    ups = servers(2)
    before = time.time()
    app = make_app([u.endpoint for u in ups])
    wait_until(lambda: first_checks_recorded(ups), 5)
    d = doc(app)
    assert d["version"] == __version__
    assert before - 1 <= when(d["started"]) <= time.time() + 1
    assert d["relay"] == app.relay == "native"  # --relay=auto, the extension built
    assert d["discovery"] == {"enabled": False}
    assert d["rebalance"] == {"enabled": False}
    assert d["stall_check"] == {"enabled": False}
    assert d["panic"] is False and d["connections_active"] == 0
    assert d["max_connections"] == app.config.max_connections

    with connect(app) as s:
        name = read_line(s)
        s.sendall(b"hello\n")
        assert read_line(s) == "hello"
        addr = next(str(u.endpoint) for u in ups if u.name == name)
        wait_until(lambda: entry(app, addr)["bytes_down"] == len(name) + 1 + 6, 5)
        u = entry(app, addr)
        assert set(u) == UPSTREAM_KEYS
        assert u["source"] == ["static"]
        assert u["state"] == "healthy" and u["healthy"] is True
        assert before - 1 <= when(u["since"]) <= time.time() + 1
        assert before - 1 <= when(u["last_check_at"]) <= time.time() + 1
        assert u["last_check_error"] == "" and u["last_error_source"] is None
        assert u["failures"] == 0
        assert u["draining"] is False and u["draining_reason"] is None
        assert u["close_deadline"] is None
        assert u["ready"] is None and u["readiness"] == "n/a" and u["ready_reason"]
        assert u["active_connections"] == 1 and u["total_connections"] == 1
        assert u["dials_in_flight"] == 0  # attached: its reservation ended
        assert u["bytes_up"] == 6
        assert u["admin"] is None
        assert u["connection_share"] == 1.0 and u["rebalance_closes"] == 0
        assert u["fair_share"] is None and u["weight"] is None  # both features off
    wait_until(lambda: entry(app, addr)["active_connections"] == 0, 5)
    u = entry(app, addr)
    assert (u["bytes_up"], u["bytes_down"]) == (6, len(name) + 1 + 6)  # kept after close


def test_a_dial_marked_failure_says_why_and_where(make_app, servers) -> None:
    (live,) = servers(1)
    # Bound but never listening: every connect to it is refused at once.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        gone = Endpoint("127.0.0.1", dead.getsockname()[1])
        # Health checks say "fine" and run rarely: only client dials can mark it down.
        app = make_app([live.endpoint, gone], prober=ok_prober, health_interval=60.0,
                       health_timeout=1.0)
        wait_until(lambda: entry(app, str(gone))["last_check_at"] is not None, 5)
        since_healthy = when(entry(app, str(gone))["since"])

        def marked() -> bool:
            whoami(app)  # a dial to the dead one fails and moves on to the live one
            return entry(app, str(gone))["state"] == "unhealthy"

        wait_until(marked, 10, interval=0, message="dials mark it unhealthy")
        u = entry(app, str(gone))
        assert u["healthy"] is False
        assert u["last_error_source"] == "dial"
        assert "refused" in u["last_check_error"], u
        assert u["failures"] >= 2
        assert when(u["since"]) >= since_healthy
        assert when(u["last_check_at"]) >= when(u["since"]) - 0.001
        live_entry = entry(app, str(live.endpoint))
        assert live_entry["state"] == "healthy" and live_entry["last_error_source"] is None
    finally:
        dead.close()


def test_a_probe_failure_says_probe(make_app, servers) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups])
    wait_until(lambda: first_checks_recorded(ups), 5)
    ups[0].close_listener()
    addr = str(ups[0].endpoint)
    wait_until(lambda: entry(app, addr)["state"] == "unhealthy", 5)
    u = entry(app, addr)
    assert u["last_error_source"] in ("probe", "dial")
    wait_until(lambda: entry(app, addr)["last_error_source"] == "probe", 5)
    assert "refused" in entry(app, addr)["last_check_error"]


def test_a_removed_endpoint_shows_its_drain_deadline(make_app, servers) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], drain_timeout=5.0)
    (conn,) = open_to(app, "up0")
    with conn:
        t0 = time.time()
        app.registry.membership.set_endpoints([ups[1].endpoint])
        u = entry(app, str(ups[0].endpoint))
        assert u["state"] == "draining" and u["draining"] is True
        assert u["draining_reason"] == "removed"
        assert t0 + 4 <= when(u["close_deadline"]) <= time.time() + 5.5
        assert t0 - 0.5 <= when(u["since"]) <= time.time() + 0.5


def test_a_readiness_drain_is_visible_with_its_deadline(make_app, servers, tmp_path: Path
                                                        ) -> None:
    ups = servers(2)
    ready = {str(u.endpoint): True for u in ups}
    app = make_app([u.endpoint for u in ups], **readyz_by_hand(ready, tmp_path),
                   drain_timeout=5.0)
    addr = str(ups[0].endpoint)
    wait_until(lambda: all(u["ready"] for u in doc(app)["upstreams"]), 5)
    assert entry(app, addr)["ready_reason"]
    (conn,) = open_to(app, "up0")
    with conn:
        t0 = time.time()
        ready[addr] = False
        wait_until(lambda: entry(app, addr)["state"] == "closing-unready", 5)
        u = entry(app, addr)
        # `draining` keeps its meaning (removed endpoints); the readiness close shows here.
        assert u["draining"] is False
        assert u["draining_reason"] == "unready"
        assert t0 + 4 <= when(u["close_deadline"]) <= time.time() + 5.5
        assert u["ready"] is False and u["readiness"] == "unready"
        assert "HTTP 503" in u["ready_reason"]
        assert u["healthy"] is True
        ready[addr] = True
        wait_until(lambda: entry(app, addr)["state"] == "healthy", 5)
        u = entry(app, addr)
        assert u["close_deadline"] is None and u["draining_reason"] is None
