"""The stall check (--stall-timeout, issue 28 item 1), black-box on loopback, both relays.

Two real TLS upstreams answering HTTP/1.1 and /readyz (up0 and up1); clients are real
TLS connections through the proxy to up0. The health interval is far longer than any
test, so every check after the first round is one the stall check (or the confirming
recheck) brought forward, and up0's own request log says when each /readyz arrived.

up0 can go silent (it keeps accepting TCP and finishing TLS, reads every request and
answers none, /readyz included: an API server cut off from etcd), or answer ``/slow``
only after a delay while everything else, /readyz included, answers at once (a slow
LIST on a healthy server).

Every bound is derived from the flags the test passes: a stall is found between the
stall timeout and one sample period (stall timeout / 8) after it; SLACK covers thread
scheduling on a shared 2-core machine.
"""

from __future__ import annotations

import itertools
import json
import socket
import ssl
import threading
import time
from typing import Any

import pytest
import trustme

from extractedprism.upstreams.activity import SECOND_LOOK
from extractedprism.upstreams.sampler import stall_sample_period
from tests.fakes.upstream import FakeUpstream
from tests.util import http, wait_until

SERVER_NAME = "kubernetes.default.svc"
STALL, TIMEOUT, RECHECK = 0.8, 0.25, 0.3
# No scheduled check during a test: only stalls bring checks forward. The round after
# the first falls at a random phase within one interval (checks/ticker.next_gap), so the
# interval is an hour: a scheduled round lands in a test's ~10 s with odds under 0.3%.
INTERVAL = 3600.0
PERIOD = stall_sample_period(STALL)
SLACK = 0.6
RELAYS = pytest.mark.parametrize("relay", ["native", "python"])


class StallingUpstream(FakeUpstream):
    """A FakeUpstream that can stop answering (``silence``), answers ``/slow`` after
    ``slow_delay`` seconds and /readyz after ``readyz_delay``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.answering = threading.Event()
        self.answering.set()
        self.slow_delay = 0.0
        self.silenced_at = 0.0
        self.readyz_lag: float | None = None
        self.readyz_delay = 0.0

    def silence(self, readyz_lag: float | None = None) -> None:
        """Stop answering. ``readyz_lag``: /readyz still answers, 200 for that many
        seconds and 500 after (a kube-apiserver just cut off from etcd); None: /readyz
        goes silent too (a frozen one)."""
        self.silenced_at = time.monotonic()
        self.readyz_lag = readyz_lag
        self.answering.clear()

    def _route(self, conn: socket.socket, method: str, route: str, body: bytes,
               keep_alive: bool) -> bool:
        if route == "/readyz" and self.readyz_delay and self.closing.wait(self.readyz_delay):
            return False  # an overloaded server's late /readyz (test_failed_check_close)
        if route == "/readyz" and not self.answering.is_set() and self.readyz_lag is not None:
            self.ready_status = (200 if time.monotonic() - self.silenced_at < self.readyz_lag
                                 else 500)
            return super()._route(conn, method, route, body, keep_alive)
        while not self.answering.wait(0.05):
            if self.closing.is_set():
                return False
        if route == "/slow":
            if self.closing.wait(self.slow_delay):
                return False
            self._respond(conn, 200, b"slow", keep_alive=keep_alive)
            return True
        return super()._route(conn, method, route, body, keep_alive)

    def readyz_after(self, t: float) -> list[float]:
        return [r.when for r in self.requests_for("/readyz") if r.when >= t]


@pytest.fixture
def ups(ca: trustme.CA):  # type: ignore[no-untyped-def]
    made = [StallingUpstream(ca=ca, name=f"up{i}").start() for i in range(2)]
    yield made
    for u in made:
        u.answering.set()
        u.stop()


class Client:
    """One keep-alive HTTP/1.1 connection over TLS through the proxy."""

    def __init__(self, app: Any, ca: trustme.CA) -> None:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        raw = socket.create_connection(app.proxy_address, timeout=5)
        self.s = ctx.wrap_socket(raw, server_hostname=SERVER_NAME)
        self._buf = b""

    def send(self, path: str) -> None:
        self.s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())

    def answer(self, timeout: float) -> bytes:
        """The body of the next response (TimeoutError when none comes in time)."""
        self.s.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            head, sep, rest = self._buf.partition(b"\r\n\r\n")
            if sep:
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                if len(rest) >= length:
                    self._buf = rest[length:]
                    return rest[:length]
            if time.monotonic() > deadline:
                raise TimeoutError("no answer")
            chunk = self.s.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the proxy")
            self._buf += chunk

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        self.send(path)
        return self.answer(timeout)

    def closed_within(self, timeout: float) -> bool:
        """True once the proxy closes the connection within ``timeout`` (bytes that
        still come are read and dropped)."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.s.settimeout(left)
                if not self.s.recv(65536):
                    return True
        except TimeoutError:
            return False
        except (OSError, ssl.SSLError):
            return True
        return False

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def clients():  # type: ignore[no-untyped-def]
    made: list[Client] = []

    def on(app: Any, ca: trustme.CA, name: str) -> Client:
        """A connection that landed on upstream ``name`` (one answered exchange)."""
        for _ in range(100):
            c = Client(app, ca)
            made.append(c)
            if c.get("/whoami") == name.encode():
                return c
            c.close()
        raise AssertionError(f"no connection landed on {name}")

    yield on
    for c in made:
        c.close()


def start(make_app, ups, ca, tmp_path, **flags):  # type: ignore[no-untyped-def]
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    base: dict[str, Any] = dict(health_check="readyz", health_check_ca_file=str(ca_file),
                                health_interval=INTERVAL, health_timeout=TIMEOUT,
                                health_recheck=RECHECK, stall_timeout=STALL,
                                drain_timeout=20.0, unready_drain_timeout=20.0)
    base.update(flags)
    app = make_app([u.endpoint for u in ups], **base)
    wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)
    return app


def view(app: Any, up: FakeUpstream) -> dict[str, Any]:
    doc = json.loads(http(app.health_address, "/upstreams")[2])
    return next(u for u in doc["upstreams"] if u["address"] == up.address)


def metric(app: Any, up: FakeUpstream, result: str) -> float | None:
    text = http(app.health_address, "/metrics")[2].decode()
    want = f'extractedprism_stall_checks_total{{result="{result}",upstream="{up.address}"}} '
    want2 = f'extractedprism_stall_checks_total{{upstream="{up.address}",result="{result}"}} '
    for line in text.splitlines():
        if line.startswith((want, want2)):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(60)
@RELAYS
def test_a_silent_upstream_is_checked_on_the_stall_and_excluded_by_the_confirming_check(
        make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, relay=relay)
    assert app.relay == relay
    bad = ups[0]
    stalled = clients(app, ca, "up0")
    for _ in range(3):  # N answered exchanges on the connection that will stall
        assert stalled.get("/whoami") == b"up0"
    quiet = clients(app, ca, "up0")  # answered, then idle: waits on nothing
    bad.silence()
    t0 = time.monotonic()
    stalled.send("/whoami")
    # The check comes once the request has gone unanswered for the stall timeout, at
    # most a sample period (and scheduling) later, never earlier.
    first = wait_until(lambda: bad.readyz_after(t0), STALL + PERIOD + SLACK,
                       message="a stall-triggered check")[0]
    assert STALL - 0.02 <= first - t0 <= STALL + PERIOD + SLACK, first - t0
    # It fails (the request hangs past --health-timeout); the confirming one follows
    # --health-recheck after it started, and the second failure excludes.
    bound = STALL + PERIOD + RECHECK + 2 * TIMEOUT + SLACK
    wait_until(lambda: app.registry.snapshot().get(bad.address).readiness == "unready",
               bound, message="up0 excluded")
    excluded = time.monotonic()
    hits = bad.readyz_after(t0)
    assert len(hits) >= 2
    assert RECHECK - 0.05 <= hits[1] - hits[0] <= RECHECK + SLACK, hits
    # At the exclusion the stalled connection is closed (it waits on an answer that is
    # not coming); the quiet one keeps --unready-drain-timeout (20 s).
    assert stalled.closed_within(SLACK), "the stalled connection was not closed"
    assert time.monotonic() - t0 <= bound + SLACK
    assert not quiet.closed_within(0.3)
    assert time.monotonic() - excluded < 20.0
    # Visible: /upstreams, the metric, the status fields.
    entry = view(app, bad)
    assert entry["stalls"] >= 1
    assert entry["stall_checks"]["failed"] >= 1
    assert entry["stall_checks"]["passed"] == 0
    assert view(app, ups[1])["stalls"] == 0
    assert metric(app, bad, "failed") >= 1
    assert metric(app, bad, "passed") == 0
    assert metric(app, ups[1], "failed") == 0


@pytest.mark.timeout(60)
@RELAYS
def test_a_stall_still_unanswered_gets_a_second_look_that_catches_a_lagging_readyz(
        make_app, ups, ca, tmp_path, clients, relay):
    # Cut off from etcd, a kube-apiserver hangs requests at once but its /readyz says
    # 200 for a few seconds more: the stall's first check passes, its second look two
    # stall timeouts later fails, and the confirming check excludes.
    app = start(make_app, ups, ca, tmp_path, relay=relay)
    bad = ups[0]
    stalled = clients(app, ca, "up0")
    lag = 1.5 * STALL  # past the first look, before the second
    bad.silence(readyz_lag=lag)
    t0 = time.monotonic()
    stalled.send("/whoami")
    bound = (1 + SECOND_LOOK) * STALL + PERIOD + RECHECK + 2 * TIMEOUT + SLACK
    wait_until(lambda: app.registry.snapshot().get(bad.address).readiness == "unready",
               bound, message="up0 excluded")
    hits = bad.readyz_after(t0)
    assert len(hits) >= 3, hits  # first look, second look, the confirming check
    assert STALL - 0.02 <= hits[0] - t0 <= STALL + PERIOD + SLACK, hits[0] - t0
    assert SECOND_LOOK * STALL - 0.05 <= hits[1] - hits[0] <= (
        SECOND_LOOK * STALL + PERIOD + SLACK), hits
    assert stalled.closed_within(SLACK), "the stalled connection was not closed"
    checks = dict(app.registry.snapshot().get(bad.address).stall_checks)
    assert checks.get("passed") == 1 and checks.get("failed", 0) >= 1, checks


@pytest.mark.timeout(60)
@RELAYS
def test_a_slow_answer_on_a_healthy_upstream_costs_one_check_and_nothing_else(
        make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, relay=relay)
    bad = ups[0]
    bad.slow_delay = 2 * STALL
    c = clients(app, ca, "up0")  # a new connection, its first request answered just now
    t0 = time.monotonic()
    c.send("/slow")
    deadline = t0 + 2 * STALL + SLACK
    # Polled while it waits: never unready, never unhealthy.
    while time.monotonic() < deadline:
        u = app.registry.snapshot().get(bad.address)
        assert u.ready and u.healthy, u
        if bad.readyz_after(t0) and app.registry.snapshot().get(
                bad.address).stall_checks:
            break
        time.sleep(0.02)
    assert c.answer(2 * STALL + SLACK) == b"slow"  # the same connection, answered
    assert c.get("/whoami") == b"up0"
    hits = bad.readyz_after(t0)
    assert len(hits) == 1, hits  # one stall, one check
    assert STALL - 0.02 <= hits[0] - t0 <= STALL + PERIOD + SLACK
    wait_until(lambda: dict(app.registry.snapshot().get(bad.address).stall_checks)
               .get("passed") == 1, SLACK)
    u = app.registry.snapshot().get(bad.address)
    assert u.ready and u.stalls == 1 and dict(u.stall_checks).get("failed", 0) == 0
    assert u.active_connections == 1  # nothing was closed
    assert metric(app, bad, "passed") == 1
    assert not c.closed_within(0.2)


@pytest.mark.timeout(60)
@RELAYS
def test_no_stall_check_without_client_bytes(make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, relay=relay)
    bad = ups[0]
    clients(app, ca, "up0")  # answered, then idle
    watch = clients(app, ca, "up0")
    watch.send("/watch")  # the upstream keeps sending; the client sends nothing more
    watch.s.recv(4096)
    bad.silence()  # new requests would hang, but no one sends any
    t0 = time.monotonic()
    end = t0 + 3 * STALL + PERIOD
    while time.monotonic() < end:
        assert not bad.readyz_after(t0)
        time.sleep(0.05)
    u = app.registry.snapshot().get(bad.address)
    assert u.stalls == 0 and u.stall_checks == () and u.ready


@pytest.mark.timeout(60)
@RELAYS
def test_stall_checks_are_rate_limited_per_upstream(make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, relay=relay)
    assert app.relay == relay
    bad = ups[0]
    bad.slow_delay = 4 * STALL
    conns = [clients(app, ca, "up0") for _ in range(6)]
    t0 = time.monotonic()
    for c in conns:  # each stalls a quarter of a stall timeout after the one before
        c.send("/slow")
        time.sleep(STALL / 4)
    for c in conns:
        assert c.answer(4 * STALL + SLACK) == b"slow"
    u = wait_until(lambda: (v := app.registry.snapshot().get(bad.address)).stalls == 6 and v,
                   SLACK)
    hits = bad.readyz_after(t0)
    # Six stalls within 1.25 stall timeouts: at most one check per stall timeout.
    assert 1 <= len(hits) < 6, hits
    gaps = [b - a for a, b in itertools.pairwise(hits)]
    assert all(g >= STALL - 0.1 for g in gaps), gaps
    assert dict(u.stall_checks).get("passed") == len(hits)
    assert u.ready


@pytest.mark.timeout(60)
@RELAYS
def test_off_changes_nothing(make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, stall_timeout=0.0, relay=relay)
    assert app.relay == relay
    assert app.config.stall_timeout == 0.0
    bad = ups[0]
    c = clients(app, ca, "up0")
    bad.silence()
    t0 = time.monotonic()
    c.send("/whoami")
    end = t0 + 3 * STALL
    while time.monotonic() < end:
        assert not bad.readyz_after(t0)  # no check before the interval
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "conn-sampler"]
    entry = view(app, bad)
    assert entry["stalls"] is None and entry["stall_checks"] is None
    assert entry["ready"] is True
    assert "stall_checks_total" not in http(app.health_address, "/metrics")[2].decode()
    assert not c.closed_within(0.2)


@pytest.mark.timeout(60)
@RELAYS
def test_new_connections_go_elsewhere_while_a_connection_is_stalled(
        make_app, ups, ca, tmp_path, clients, relay):
    """The server's /readyz keeps saying 200 (checks pass, nothing is excluded); only the
    stalled request says new requests would hang there too: new connections go elsewhere
    until both looks of the stall have passed. Then (issue 37) the stall counts as a
    quiet stream (a watch's WINDOW_UPDATE looks the same) and the mark ends."""
    app = start(make_app, ups, ca, tmp_path, relay=relay)  # random: up0 half the time
    bad = ups[0]
    stalled = clients(app, ca, "up0")
    bad.silence(readyz_lag=60.0)
    stalled.send("/whoami")
    wait_until(lambda: view(app, bad)["suspect"], STALL + PERIOD + SLACK,
               message="suspect by the stall")

    def passed() -> int:
        return int(view(app, bad)["stall_checks"]["passed"])

    elsewhere = 0
    for _ in range(20):
        looks = passed()
        if looks >= 2:
            break  # the second look passed: the mark may end now
        c = Client(app, ca)
        try:
            got = c.get("/whoami", timeout=2.0)
        except TimeoutError:
            got = None  # on up0, after the mark ended during this connection
        finally:
            c.close()
        if got != b"up1":
            assert passed() >= 2, f"{got!r} while up0 was suspect"
            break
        elsewhere += 1
    assert elsewhere >= 3, elsewhere
    # Both looks pass: the mark ends within (1 + SECOND_LOOK) stall timeouts plus a check.
    wait_until(lambda: not view(app, bad)["suspect"],
               SECOND_LOOK * STALL + PERIOD + TIMEOUT + SLACK, message="the mark ended")
    u = app.registry.snapshot().get(bad.address)
    assert u.ready and u.healthy and u.stalled_connections == 1
    bad.answering.set()
    assert stalled.answer(SLACK + 1) == b"up0"

    def lands_on_up0() -> bool:
        c = Client(app, ca)
        try:
            return c.get("/whoami", timeout=2.0) == b"up0"
        finally:
            c.close()
    wait_until(lands_on_up0, 5, message="a new connection on up0 again")
