"""Issue 37, the findings visible from outside, on loopback with real sockets and both
relays: a client's ClientHello reaches at most two upstreams after a drain race (8), a
client never has more than two attempts out (3), a retry never reaches an unready
upstream while a ready one exists (1), and a slow-to-accept upstream's dial-stall mark
ends when that dial connects (2)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import dialer as dialer_mod
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.answering import hello
from tests.net.races import drain_race
from tests.net.test_hedge import black_hole
from tests.unit.test_registry import Conn
from tests.util import wait_until

RELAYS = pytest.mark.parametrize("relay", ["native", "python"])
PROBES_OFF = 60.0


def hold(app, addr: str, n: int) -> list[Conn]:  # type: ignore[no-untyped-def]
    """``n`` idle connections counted on ``addr``: least-conn's order, set by the test."""
    conns = [Conn(f"held{i}") for i in range(n)]
    for c in conns:
        assert app.registry.conns.attach(addr, c)
    return conns


def send_hello(app, msg: bytes, wait: float) -> bytes:  # type: ignore[no-untyped-def]
    """One client: its ClientHello, then whatever comes back within ``wait`` seconds."""
    got = b""
    with socket.create_connection(app.proxy_address, timeout=5) as c:
        c.sendall(msg)
        c.settimeout(0.1)
        end = time.monotonic() + wait
        while time.monotonic() < end and not got.endswith(msg):
            try:
                chunk = c.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.timeout(60)
@RELAYS
def test_after_a_drain_race_the_retry_is_not_hedged(make_app, fakes, relay, monkeypatch):
    """Finding 8: the first upstream is removed while its connection attaches; the
    ClientHello goes to one other upstream (its second and last), which stays silent: the
    retry is relayed unanswered, never hedged to a third."""
    first, silent, third = fakes(), fakes(answer_after=None), fakes()
    hedge = 0.2
    app = make_app([first.endpoint, silent.endpoint, third.endpoint], relay=relay,
                   upstream_selection="least-conn", health_interval=PROBES_OFF,
                   health_timeout=1.0, answer_hedge_delay=hedge)
    hold(app, silent.address, 1)  # least-conn: first (0), then silent (1), then third (2)
    hold(app, third.address, 2)
    raced = drain_race(monkeypatch, app, lambda _addr: app.registry.membership.set_endpoints(
        [silent.endpoint, third.endpoint]))
    msg = hello(b"once-or-twice")
    got = send_hello(app, msg, 4 * hedge + 0.5)  # a hedge would have answered by then
    assert raced == [first.address]
    reached = [f for f in (first, silent, third) if f.has(msg)]
    assert len(reached) <= 2, [f.address for f in reached]
    assert silent.has(msg) == 1
    if first.has(msg):  # it got them before the refusal: the retry was their last stop
        assert not third.has(msg) and got == b""
    else:  # the native relay refused before reading them: an ordinary hedged connection
        assert relay == "native" and got.endswith(msg)


@pytest.mark.timeout(60)
@RELAYS
def test_a_client_never_has_more_than_two_attempts_out(make_app, fakes, relay):
    """Finding 3: the first dial stalls (a black hole), its hedge connects to a silent
    upstream, whose first answer's hedge then dials a third: the black hole's dial, still
    running off the client's path, is dropped before that (uncounted), not left beside
    two others until its dial timeout."""
    silent, good = fakes(answer_after=None), fakes()
    dial_hedge, answer_hedge, timeout = 0.1, 0.3, 3.0
    with black_hole() as hole:
        app = make_app([hole, silent.endpoint, good.endpoint], relay=relay,
                       upstream_selection="least-conn", health_interval=PROBES_OFF,
                       health_timeout=timeout, dial_hedge_delay=dial_hedge,
                       answer_hedge_delay=answer_hedge,
                       prober=lambda ep, t, r: ProbeResult(True, 0.001, ""))
        hold(app, silent.address, 1)
        hold(app, good.address, 2)
        msg = hello(b"two-out")
        got = send_hello(app, msg, dial_hedge + answer_hedge + 2.0)
        assert got.endswith(msg), got  # the good one carried it
        snap = app.registry.snapshot()
        # Well before the black hole's dial timeout: its dial is no longer in flight.
        hole_view = snap.get(str(hole))
        assert hole_view.dials_in_flight == 0, "the stalled dial still out beside two others"
        assert silent.has(msg) == 1 and good.has(msg) == 1
        assert hole_view.connection_errors == 0  # dropped uncounted, not timed out


@pytest.mark.timeout(60)
@RELAYS
def test_a_retry_never_reaches_an_unready_upstream_while_a_ready_one_exists(
        make_app, fakes, relay, monkeypatch):
    """Finding 1, as traffic meets it: readyz on; one upstream cut from etcd (TCP accepts,
    /readyz 500), the ready one marked (a dial stalled there). Every drain-race retry
    goes to the ready one."""
    ready_one, unready, first = fakes(), fakes(), fakes()

    def prober(ep, _t, _r):  # type: ignore[no-untyped-def]
        ok = str(ep) != unready.address
        return ProbeResult(True, 0.001, "", ready=ok, ready_reason="" if ok else "HTTP 500")

    app = make_app([ready_one.endpoint, unready.endpoint, first.endpoint], relay=relay,
                   health_check="readyz", health_interval=PROBES_OFF,
                   health_timeout=1.0, answer_hedge_delay=0.2, prober=prober)
    reg = app.registry
    wait_until(lambda: not reg.snapshot().get(unready.address).ready
               and reg.snapshot().get(ready_one.address).ready, 5, message="checked")
    stalled: list[object] = []

    def mark_ready_one() -> None:
        """The ready one's mark: a dial there stalled past --dial-hedge-delay, not yet
        ended (a success there, the retry's own, ends it: marked again each round)."""
        res = reg.picks.reserve(exclude={first.address, unready.address})
        assert res is not None and res.address == ready_one.address
        reg.picks.stall_dial(res)
        stalled.append(res)

    armed: list[bool] = []
    for name in ("attach", "attach_judging"):
        real = getattr(reg.conns, name)

        def racing(target, conn, _real=real):  # type: ignore[no-untyped-def]
            # The drain race: 'first' is removed while its connection attaches.
            if armed and getattr(target, "address", None) == first.address:
                armed.clear()
                reg.membership.set_admin(first.address, "drain", 0)  # attach refused
            return _real(target, conn)

        monkeypatch.setattr(reg.conns, name, racing)
    try:
        retried = 0
        for i in range(10):
            reg.membership.set_admin(first.address, "", 0)
            mark_ready_one()
            armed.append(True)
            msg = hello(b"retry%d" % i)
            # The rule makes the first pick 'first': ready (unlike unready), and unmarked
            # (unlike ready_one).
            got = send_hello(app, msg, 3.0)
            assert not unready.has(msg), f"retry {i} reached the unready upstream"
            if not armed:  # raced: retried
                retried += 1
                assert got.endswith(msg) and ready_one.has(msg) == 1
        assert retried == 10, retried
    finally:
        for res in stalled:
            res.release()  # type: ignore[attr-defined]


@contextlib.contextmanager
def slow_to_accept(every: float) -> Iterator[Endpoint]:
    """A loopback server whose accept queue (backlog 0) is kept full, accepting one
    connection every ``every`` seconds: each dial waits for a SYN retransmit (about 1 s),
    then connects, and the server echoes. Healthy, only slow to accept."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    filler = socket.socket()
    filler.setblocking(False)
    filler.connect_ex(("127.0.0.1", port))
    stop = threading.Event()
    held: list[socket.socket] = [filler]

    def echo(c: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := c.recv(65536):
                c.sendall(data)

    def accept() -> None:
        while not stop.wait(every):
            try:
                c, _ = srv.accept()
            except OSError:
                return
            held.append(c)
            threading.Thread(target=echo, args=(c,), name="test-slow-echo",
                             daemon=True).start()

    t = threading.Thread(target=accept, name="test-slow-accept", daemon=True)
    t.start()
    try:
        yield Endpoint("127.0.0.1", port)
    finally:
        stop.set()
        srv.close()
        t.join(5)
        for c in held:
            c.close()


@pytest.mark.timeout(90)
def test_a_slow_to_accept_upstream_is_not_shunned(make_app, fakes, monkeypatch):
    """Finding 2: every dial to it is slower than --dial-hedge-delay, so each marks it;
    the mark ends when that dial connects (the dial-reaper records the success), so it
    keeps getting its share of new connections' dials, hedged each time."""
    dials: Counter[str] = Counter()
    real_native, real_begin = dialer_mod.native_connect, dialer_mod.begin_connect

    def counting_native(target, *rest):  # type: ignore[no-untyped-def]
        dials[f"{target[1]}:{target[2]}"] += 1
        return real_native(target, *rest)

    def counting_begin(family, addr, *rest):  # type: ignore[no-untyped-def]
        dials[f"{addr[0]}:{addr[1]}"] += 1
        return real_begin(family, addr, *rest)

    monkeypatch.setattr(dialer_mod, "native_connect", counting_native)
    monkeypatch.setattr(dialer_mod, "begin_connect", counting_begin)
    a, b = fakes(), fakes()
    gap, n = 0.2, 40
    with slow_to_accept(every=0.6) as slow:
        app = make_app([slow, a.endpoint, b.endpoint], health_interval=PROBES_OFF,
                       health_timeout=3.0, dial_hedge_delay=0.1, answer_hedge_delay=0.5,
                       prober=lambda ep, t, r: ProbeResult(True, 0.001, ""))
        for i in range(n):
            msg = hello(b"slow%d" % i)
            assert send_hello(app, msg, 5.0).endswith(msg)
            time.sleep(gap)  # clients arriving over time (deliberate pacing)
        # Uniform picks give n/3; a mark kept for good would leave it about 1.
        assert dials[str(slow)] >= n // 6, dials
        wait_until(lambda: not app.registry.snapshot().get(str(slow)).dial_stalled, 5,
                   message="the last stalled dial connected: mark ended")
