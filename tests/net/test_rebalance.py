"""Rebalancing and slow start, black-box on loopback: a real App in-process, identity
echo upstreams, real client sockets (upstreams/balance.py, upstreams/rebalancer.py).

Bounds come from the flags each test passes: rounds every INTERVAL x [0.9, 1.1], a
connection is closable once QUIET without a byte and one INTERVAL old."""

from __future__ import annotations

import itertools
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time

import pytest

from extractedprism.ops import admin
from extractedprism.upstreams import balance
from tests.fakes.upstream import IdentityServer
from tests.util import connect, connection_count, read_line, sample, wait_until

INTERVAL = 0.6
QUIET = 0.3
TCP_CLOSE_WAIT, TCP_CLOSE = 8, 7


def tcp_state(s: socket.socket) -> int:
    return struct.unpack("B", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]


class Fleet:
    """Long-lived quiet clients that reconnect when the proxy closes them (as kubelets
    do), noting when each close came."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        self.socks: dict[socket.socket, str] = {}
        self.closes: list[tuple[float, str]] = []

    def open(self, n: int) -> None:
        for _ in range(n):
            s = connect(self.app)
            self.socks[s] = read_line(s)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.socks.values():
            out[name] = out.get(name, 0) + 1
        return out

    def pump(self, seconds: float) -> None:
        """Wait up to ``seconds`` for closes; reconnect each closed client at once."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select(list(self.socks), [], [], left)
            for s in readable:
                assert s.recv(1) == b"", "an upstream sent a byte nobody asked for"
                self.closes.append((time.monotonic(), self.socks.pop(s)))
                s.close()
                self.open(1)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()


@pytest.fixture
def fleet():  # type: ignore[no-untyped-def]
    made: list[Fleet] = []

    def factory(app):  # type: ignore[no-untyped-def]
        made.append(Fleet(app))
        return made[-1]

    yield factory
    for f in made:
        f.close()


class EndingServer(IdentityServer):
    """An identity echo server that notes how each connection ended, and how long it
    lived (health checks live a moment; proxied clients much longer)."""

    def __init__(self, name: str = "ident", host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 128) -> None:
        super().__init__(name, host, port, backlog)
        self.ends: list[tuple[float, str]] = []

    def handle(self, conn: socket.socket, peer: object) -> None:
        born = time.monotonic()
        conn.sendall(f"{self.name}\n".encode())
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except ConnectionResetError:
            self.ends.append((time.monotonic() - born, "reset"))
            raise
        self.ends.append((time.monotonic() - born, "eof"))


def skewed(make_app, servers, **flags):  # type: ignore[no-untyped-def]
    """An App over three upstreams whose connections all sit on the first two: up2 was
    drained by an operator while they connected, then put back."""
    ups = servers(3, kind=EndingServer)
    flags.setdefault("upstream_selection", "least-conn")
    app = make_app([u.endpoint for u in ups], **flags)
    app.registry.membership.set_admin(ups[2].address, "drain", 0)
    return app, ups


def test_rounds_close_one_quiet_connection_per_interval_until_balanced(make_app, servers,
                                                                      fleet, caplog):
    caplog.set_level(logging.INFO, logger="extractedprism.upstreams.registry")
    app, ups = skewed(make_app, servers, rebalance_interval=INTERVAL, rebalance_quiet=QUIET)
    clients = fleet(app)
    clients.open(9)
    assert clients.counts().get("up2", 0) == 0
    app.registry.membership.set_admin(ups[2].address, "", 0)
    # 5/4/0 -> 3/3/3 takes three closes; each is one round, one interval apart, and a
    # round may find the oldest connections not yet one interval old: six rounds' room.
    deadline = time.monotonic() + 6 * INTERVAL * 1.1 + 2
    while clients.counts() != {"up0": 3, "up1": 3, "up2": 3}:
        assert time.monotonic() < deadline, f"not balanced: {clients.counts()}"
        clients.pump(0.1)
    assert len(clients.closes) == 3
    # When each close was made (its log line, written as the round ends; the clients'
    # side may notice late on a busy machine): one per round at most.
    made = [r.created for r in caplog.records if r.getMessage().startswith("rebalance close")]
    assert len(made) == 3
    gaps = [b - a for a, b in itertools.pairwise(made)]
    assert min(gaps) >= 0.9 * INTERVAL - 0.05, gaps
    # Balanced: the rounds go on and close nothing more.
    clients.pump(3 * INTERVAL * 1.1)
    assert len(clients.closes) == 3
    snap = app.registry.snapshot()
    assert snap.rebalance.closes == 3 and snap.rebalance.last_reason == balance.NO_SKEW
    assert sum(u.rebalance_closes for u in snap.upstreams) == 3
    assert sum(sample(app.metrics, "extractedprism_rebalance_closes_total",
                      {"upstream": u.address}) or 0 for u in ups) == 3


@pytest.mark.parametrize("relay", ["native", "python"])
def test_the_close_is_a_fin_both_ways(make_app, servers, relay):
    app, ups = skewed(make_app, servers, rebalance_interval=INTERVAL,
                      rebalance_quiet=QUIET, relay=relay)
    socks = [connect(app) for _ in range(4)]
    try:
        names = [read_line(s) for s in socks]
        app.registry.membership.set_admin(ups[2].address, "", 0)
        readable, _, _ = select.select(socks, [], [], 4 * INTERVAL * 1.1 + 2)
        assert len(readable) == 1
        (s,) = readable
        assert s.recv(10) == b""  # a clean EOF
        wait_until(lambda: connection_count(app.registry) == 3, 5,
                   message="the pipe thread closed both sockets")
        # A reset after the FIN would have moved the client's socket to CLOSE; a FIN
        # alone leaves it in CLOSE_WAIT, waiting for our own close.
        assert tcp_state(s) == TCP_CLOSE_WAIT
        # The upstream read a clean EOF too (no reset), and the others still echo.
        wait_until(lambda: any(d >= INTERVAL for u in ups for d, _ in u.ends), 5,
                   message="the upstream saw its client leave")
        assert [how for u in ups for d, how in u.ends if d >= INTERVAL] == ["eof"]
        for other in socks:
            if other is not s:
                other.sendall(b"ping\n")
                assert read_line(other) == "ping"
        assert names.count(names[socks.index(s)]) == 2  # it came off a loaded one
    finally:
        for s in socks:
            s.close()


def test_a_busy_connection_is_never_closed(make_app, servers):
    quiet = 1.0  # long beside the traffic's pace, so a stalled test thread is no false quiet
    app, ups = skewed(make_app, servers, rebalance_interval=INTERVAL, rebalance_quiet=quiet)
    socks = [connect(app) for _ in range(4)]  # 2 on up0, 2 on up1
    try:
        for s in socks:
            read_line(s)
        app.registry.membership.set_admin(ups[2].address, "", 0)
        # Every connection moves a byte well within the quiet time, for four rounds.
        end = time.monotonic() + 4 * INTERVAL * 1.1
        while time.monotonic() < end:
            for s in socks:
                s.sendall(b"x\n")
                assert read_line(s) == "x", "a busy connection was closed"
            time.sleep(0.05)  # pacing the traffic, not waiting for a result
        snap = app.registry.snapshot()
        assert snap.rebalance.closes == 0
        assert snap.rebalance.rounds >= 2
        assert snap.rebalance.last_reason == balance.NOTHING_QUIET
        # Quiet from now on: one of them goes within a few rounds.
        readable, _, _ = select.select(socks, [], [], 4 * INTERVAL * 1.1 + quiet + 2)
        assert len(readable) == 1 and readable[0].recv(1) == b""
    finally:
        for s in socks:
            s.close()


def test_never_while_an_upstream_drains(make_app, servers, fleet):
    ups = servers(4)
    app = make_app([u.endpoint for u in ups[:3]], upstream_selection="least-conn",
                   rebalance_interval=INTERVAL, rebalance_quiet=QUIET, drain_timeout=60.0)
    clients = fleet(app)
    clients.open(9)  # 3/3/3
    # up2 leaves the list (it drains its 3 connections for up to 60 s) as up3 joins: the
    # pickable ones hold 3/3/0, a skew no round may touch while up2 drains.
    app.registry.membership.set_endpoints([u.endpoint for u in (ups[0], ups[1], ups[3])])
    clients.pump(4 * INTERVAL * 1.1)
    snap = app.registry.snapshot()
    assert clients.closes == [] and snap.rebalance.closes == 0
    assert snap.rebalance.last_reason == balance.DRAINING
    assert snap.rebalance.last_detail == ups[2].address
    # up2's clients leave by themselves: the drain completes and the rounds act again.
    for s in [s for s, name in clients.socks.items() if name == "up2"]:
        clients.socks.pop(s)
        s.close()
    wait_until(lambda: app.registry.snapshot().get(ups[2].address) is None, 5,
               message="the drain completed")
    clients.pump(4 * INTERVAL * 1.1 + 1)
    assert clients.closes, "rebalancing stayed off after the drain ended"
    assert clients.counts().get("up3", 0) >= 1


def test_off_by_default_changes_nothing(make_app, servers, fleet):
    app, ups = skewed(make_app, servers)
    clients = fleet(app)
    clients.open(9)
    app.registry.membership.set_admin(ups[2].address, "", 0)
    assert not [t for t in threading.enumerate() if t.name == "conn-sampler"]
    # Several health intervals (the only clock left running): nothing moves.
    clients.pump(4 * app.config.health_interval)
    assert clients.closes == []
    snap = app.registry.snapshot()
    assert snap.rebalance is None
    assert all(u.weight is None and u.fair_share is None for u in snap.upstreams)
    assert sample(app.metrics, "extractedprism_rebalance_closes_total",
                  {"upstream": ups[0].address}) is None


def test_slow_start_gives_a_recovered_upstream_its_ramped_share_of_a_burst(make_app,
                                                                           servers):
    window = 20.0
    ups = servers(3)
    app = make_app([u.endpoint for u in ups], upstream_selection="random", slow_start=window)
    app.registry.membership.set_admin(ups[2].address, "drain", 0)
    app.registry.membership.set_admin(ups[2].address, "", 0)  # undrained: ramps from 0.1
    t0 = time.monotonic()
    got = {"up0": 0, "up1": 0, "up2": 0}
    for _ in range(300):
        with connect(app) as s:
            got[read_line(s)] += 1
    elapsed = time.monotonic() - t0
    assert elapsed < window / 2, "the burst took too long to say anything"
    top = balance.ramp_weight(elapsed, window)
    bound = top / (2 + top)  # its share at the end of the burst, the highest it had
    # Binomial slack: 4 standard deviations of 300 picks at that share.
    slack = 4 * (bound * (1 - bound) / 300) ** 0.5
    assert got["up2"] / 300 <= bound + slack, (got, bound)
    assert got["up2"] > 0  # ramping, not excluded
    weight = app.registry.snapshot().get(ups[2].address).weight
    assert balance.MIN_WEIGHT <= weight < 1.0


@pytest.fixture
def sock_path():  # type: ignore[no-untyped-def]
    d = tempfile.mkdtemp(prefix="ep-reb-", dir="/tmp")  # short: unix paths max 107 bytes
    yield os.path.join(d, "admin.sock")
    shutil.rmtree(d, ignore_errors=True)


def test_admin_rebalance_runs_one_round_now_and_it_shows(make_app, servers, sock_path,
                                                        capsys, caplog):
    # A long interval: only the operator's round can act within this test.
    app, ups = skewed(make_app, servers, rebalance_interval=300.0, rebalance_quiet=0.0,
                      admin_socket=sock_path)
    socks = [connect(app) for _ in range(6)]
    try:
        for s in socks:
            read_line(s)
        app.registry.membership.set_admin(ups[2].address, "", 0)
        caplog.set_level(logging.INFO)
        # Every connection is younger than one interval (300 s): the same rules say no.
        assert admin.main(["--socket", sock_path, "rebalance"]) == 0
        assert "no connection closed: nothing quiet" in capsys.readouterr().out
        doc = app.upstreams_document()
        assert doc["rebalance"]["last_result"] == balance.NOTHING_QUIET
        assert doc["rebalance"]["last_acted_at"] is None
        # Old enough once the interval is short: one close, one log line, and it shows.
        app.registry.rebalance_interval = 0.0  # the test's stand-in for "an hour later"
        assert admin.main(["--socket", sock_path, "rebalance"]) == 0
        assert capsys.readouterr().out.startswith("rebalanced: closed a connection of ")
        readable, _, _ = select.select(socks, [], [], 5)
        assert len(readable) == 1 and readable[0].recv(1) == b""
        lines = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("rebalance close ")]
        assert len(lines) == 1
        assert "counts=" in lines[0] and "age=" in lines[0] and "quiet=" in lines[0]
        doc = app.upstreams_document()
        r = doc["rebalance"]
        assert r["enabled"] and r["closes"] == 1 and r["last_result"] == balance.ACTED
        assert r["last_acted_at"] is not None and r["interval_seconds"] == 300.0
        by = {u["address"]: u for u in doc["upstreams"]}
        assert sum(u["rebalance_closes"] for u in by.values()) == 1
        wait_until(lambda: app.registry.snapshot().connections_active == 5, 5)
        doc = app.upstreams_document()
        shares = [u["connection_share"] for u in doc["upstreams"]]
        assert sum(shares) == pytest.approx(1.0)
        assert [u["fair_share"] for u in doc["upstreams"]] == [pytest.approx(5 / 3, abs=0.01)] * 3
        assert all(u["weight"] is None for u in doc["upstreams"])  # slow start is off
    finally:
        for s in socks:
            s.close()


def test_admin_rebalance_is_refused_while_rebalancing_is_off(make_app, servers, sock_path,
                                                            capsys):
    ups = servers(2)
    make_app([u.endpoint for u in ups], admin_socket=sock_path)
    assert admin.main(["--socket", sock_path, "rebalance"]) == 1
    assert "rebalancing is off (--rebalance-interval 0)" in capsys.readouterr().err


def test_slow_start_weight_is_a_metric_and_in_the_document(make_app, servers):
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], slow_start=30.0)
    app.registry.membership.set_admin(ups[1].address, "drain", 0)
    app.registry.membership.set_admin(ups[1].address, "", 0)
    weight = sample(app.metrics, "extractedprism_upstream_weight",
                    {"upstream": ups[1].address})
    assert weight is not None and balance.MIN_WEIGHT <= weight < 0.5
    assert sample(app.metrics, "extractedprism_upstream_weight",
                  {"upstream": ups[0].address}) == 1.0
    by = {u["address"]: u for u in app.upstreams_document()["upstreams"]}
    assert balance.MIN_WEIGHT <= by[ups[1].address]["weight"] < 0.5
    assert app.upstreams_document()["rebalance"] == {"enabled": False}
