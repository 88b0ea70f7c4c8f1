"""Counters that cannot drift (issue 29): on every path a connection takes, with both
relays, extractedprism_connections_total, each upstream's total (the snapshot and
/upstreams) and the live counts agree with what the upstreams did: a connection counts
once, on the upstream whose answer reached the client, and never anywhere else.

Each upstream marks its answer with its own name, so the client knows who carried it;
that is the truth the counters are held to.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import Counter

import pytest

from extractedprism.upstreams.state import ProbeResult
from tests.fakes.answering import Fake, hello
from tests.net.races import drain_race
from tests.util import http, wait_until

RELAYS = ["native", "python"]
PROBES_OFF = 60.0
HEDGE = 0.15




class Clients:
    """Connects clients, each with its own ClientHello, and tallies who answered each."""

    def __init__(self, app, fakes: list[Fake]) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        self.by_mark = {f.mark: f.address for f in fakes}
        self.carried: Counter[str] = Counter()
        self.n = 0

    def one(self, *, leave_after: float | None = None) -> str | None:
        """One client: its ClientHello, then the answer (or it leaves after
        ``leave_after`` seconds without one). The address that answered it, or None."""
        self.n += 1
        msg = hello(b"cnt%d;" % self.n)
        with socket.create_connection(self.app.proxy_address, timeout=10) as c:
            c.sendall(msg)
            if leave_after is not None:
                time.sleep(leave_after)  # the client's own patience (deliberate)
                return None
            c.settimeout(10)
            got = b""
            while not got.endswith(msg):
                chunk = c.recv(65536)
                assert chunk, f"closed after {got!r}"
                got += chunk
        mark = got[: got.index(b"|") + 1]
        addr = self.by_mark[mark]
        self.carried[addr] += 1
        return addr


def _dialing(app) -> int:  # type: ignore[no-untyped-def]
    with app.registry.lock:
        return sum(r.dialing for r in app.registry.ups.values())


def _check(app, carried: Counter[str], known: list[Fake]) -> None:  # type: ignore[no-untyped-def]
    """Every counter against the truth, once every connection has ended."""
    wait_until(lambda: app.registry.snapshot().connections_active == 0, 10,
               message="every connection detached")
    wait_until(lambda: _dialing(app) == 0, 5, message="no reservation left behind")
    snap = app.registry.snapshot()
    assert snap.connections_total == sum(carried.values()), (snap.connections_total, carried)
    metric = app.metrics.registry.get_sample_value("extractedprism_connections_total")
    assert metric == sum(carried.values())
    status, _, body = http(app.health_address, "/upstreams")
    assert status == 200
    doc = {u["address"]: u for u in json.loads(body)["upstreams"]}
    assert json.loads(body)["connections_active"] == 0
    for f in known:
        view = snap.get(f.address)
        if view is None:  # removed (the drain race): its counters went with it
            assert f.address not in doc
            continue
        assert view.total_connections == carried[f.address], (f.address, carried)
        assert doc[f.address]["total_connections"] == carried[f.address]
        assert view.active_connections == doc[f.address]["active_connections"] == 0


@pytest.fixture
def marked(fakes):  # type: ignore[no-untyped-def]
    made: list[Fake] = []

    def factory(**kw: object) -> Fake:
        f = fakes(mark=b"<%d>|" % len(made), **kw)
        made.append(f)
        return f

    return factory


@pytest.mark.timeout(180)
@pytest.mark.parametrize("relay", RELAYS)
def test_counters_agree_with_the_upstreams_on_every_path(make_app, marked, relay,
                                                        monkeypatch):
    # One upstream: nothing judged.
    (one,) = [marked()]
    app = make_app([one.endpoint], health_interval=PROBES_OFF, answer_hedge_delay=HEDGE,
                   relay=relay)
    clients = Clients(app, [one])
    for _ in range(5):
        assert clients.one() == one.address
    _check(app, clients.carried, [one])
    app.stop()

    # Hedged: won (the other never answers), lost (it answers late), silent (charged
    # within the short --health-timeout). The first attempt lands on either.
    good, frozen, late = marked(), marked(answer_after=None), marked(answer_after=0.5)
    app = make_app([good.endpoint, frozen.endpoint, late.endpoint],
                   health_interval=PROBES_OFF, health_timeout=0.6,
                   answer_hedge_delay=HEDGE, relay=relay)
    clients = Clients(app, [good, frozen, late])
    hedged = Counter[str]()
    for _ in range(60):
        before = (frozen.has(b""), late.has(b""))
        clients.one()
        hedged["frozen"] += frozen.has(b"") > before[0]
        hedged["late"] += late.has(b"") > before[1]
        if hedged["frozen"] >= 2 and hedged["late"] >= 2:
            break
    assert hedged["frozen"] >= 2 and hedged["late"] >= 1, hedged
    assert clients.carried[frozen.address] == 0
    wait_until(lambda: app.registry.snapshot().get(frozen.address).answer_hedges, 5,
               message="the silent one judged")
    _check(app, clients.carried, [good, frozen, late])
    app.stop()

    # The client leaves during the wait (both silent): nobody counts it.
    a, b = marked(answer_after=None), marked(answer_after=None)
    app = make_app([a.endpoint, b.endpoint], health_interval=PROBES_OFF,
                   health_timeout=5.0, answer_hedge_delay=0.5, relay=relay)
    clients = Clients(app, [a, b])
    for _ in range(3):
        assert clients.one(leave_after=0.2) is None
    wait_until(lambda: a.closed + b.closed >= 3, 5, message="every attempt closed")
    _check(app, clients.carried, [a, b])
    app.stop()

    # Panic mode: every upstream excluded; the one that answers carries it.
    p1, p2 = marked(), marked()
    app = make_app([p1.endpoint, p2.endpoint], health_interval=PROBES_OFF,
                   answer_hedge_delay=HEDGE, relay=relay)
    wait_until(lambda: all(u.last_check_at is not None
                           for u in app.registry.snapshot().upstreams), 10,
               message="first probe round")
    for f in (p1, p2):
        for _ in range(2):
            app.registry.verdicts.record_probe(f.address, ProbeResult(False, None, "test: down"))
    assert not app.registry.picks.any_pickable()
    clients = Clients(app, [p1, p2])
    for _ in range(4):
        clients.one()
    _check(app, clients.carried, [p1, p2])
    app.stop()

    # The drain race: the upstream being attached is removed meanwhile; the ClientHello
    # is replayed to the other, which alone counts it.
    d1, d2 = marked(), marked()
    app = make_app([d1.endpoint, d2.endpoint], health_interval=PROBES_OFF,
                   answer_hedge_delay=HEDGE, relay=relay)
    raced = drain_race(monkeypatch, app, lambda addr: app.registry.membership.set_endpoints(
        [d2.endpoint if addr == d1.address else d1.endpoint]))
    clients = Clients(app, [d1, d2])
    with contextlib.suppress(AssertionError):  # a request sent before the refusal: closed
        clients.one()
    for _ in range(3):
        clients.one()
    assert raced and raced[0] not in clients.carried
    _check(app, clients.carried, [d1, d2])
