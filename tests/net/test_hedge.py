"""Hedged dials: a black-holed upstream (SYNs unanswered) costs a client the hedge delay,
not the dial timeout, and is still excluded by the dials it swallows."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import dialer as dialer_mod
from extractedprism.datapath import offpath
from extractedprism.upstreams.state import ProbeResult
from tests.util import read_line, wait_until

HEDGE = 0.1
DIAL_TIMEOUT = 3.0  # --health-timeout: what a client would wait without hedging


@contextlib.contextmanager
def black_hole() -> Iterator[Endpoint]:
    """A loopback listener that never accepts, its queue full: further SYNs go unanswered."""
    srv = socket.socket()
    fillers: list[socket.socket] = []
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            assert s.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
            fillers.append(s)
        yield Endpoint("127.0.0.1", port)
    finally:
        for s in fillers:
            s.close()
        srv.close()


def always_up(_ep: Endpoint, _timeout: float, _readyz: object) -> ProbeResult:
    # Health checks out of the way: only client dials can find the black hole.
    return ProbeResult(True, 0.001, "")


@pytest.mark.timeout(60)
def test_black_holed_upstream_costs_the_hedge_delay_and_reaches_its_streak(
        make_app, servers, monkeypatch):
    ups = servers(2)
    dials: list[str] = []
    lock = threading.Lock()
    real_begin = dialer_mod.begin_connect

    def counting_begin(family, addr, *rest):  # type: ignore[no-untyped-def]
        with lock:
            dials.append(f"{addr[0]}:{addr[1]}")
        return real_begin(family, addr, *rest)

    real_native = dialer_mod.native_connect

    def counting_native(target, *rest):  # type: ignore[no-untyped-def]
        # The first dial of a numeric endpoint: one extension call (Dialer._fast).
        with lock:
            dials.append(f"{target[1]}:{target[2]}")
        return real_native(target, *rest)

    monkeypatch.setattr(dialer_mod, "begin_connect", counting_begin)
    monkeypatch.setattr(dialer_mod, "native_connect", counting_native)
    with black_hole() as hole:

        def checks(ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
            # The live ones answer; the black hole's checks time out, as they would
            # (an always-up check would clear the hole's stall mark, issue 29).
            return (ProbeResult(False, None, "timeout") if ep == hole
                    else always_up(ep, timeout, readyz))

        app = make_app([hole, *(u.endpoint for u in ups)], dial_hedge_delay=HEDGE,
                       health_timeout=DIAL_TIMEOUT, health_interval=30, prober=checks)
        hedged = 0
        for _ in range(50):
            before = len(dials)
            t0 = time.monotonic()
            with socket.create_connection(app.proxy_address, timeout=10) as s:
                assert read_line(s) in ("up0", "up1")
            elapsed = time.monotonic() - t0
            with lock:
                mine = dials[before:]
            # Never more than two dials per client; the black hole never carries one.
            assert len(mine) <= 2, mine
            if len(mine) == 2:
                hedged += 1
                assert mine[0] == str(hole), mine  # the hedge followed the stalled dial
            # The hedge delay plus a normal loopback dial, far below the dial timeout.
            assert elapsed < HEDGE + 1.0 < DIAL_TIMEOUT, (elapsed, mine)
        assert hedged >= 1
        # The losing dial ran on to its timeout and counted toward the streak. Marked
        # stalled from its hedge delay on, the black hole took no new connection while
        # the others could (issue 29), so the clients' dials give it one failure, and
        # with its check's failure (the check at start, or the one a failed dial asks
        # for) it is excluded.
        wait_until(lambda: not app.registry.snapshot().get(str(hole)).healthy,
                   DIAL_TIMEOUT + 5, message="the black hole excluded")
        # The hedged dial counts once it times out. The exclusion can come first: the
        # hole's second scheduled check falls at a random phase within the interval
        # (checks/ticker.next_gap), in the first seconds of the test about one run in
        # six, and then the losing dial is still running when the hole is excluded.
        wait_until(lambda: (app.metrics.registry.get_sample_value(
            "extractedprism_connection_errors_total", {"upstream": str(hole)}) or 0) >= 1,
            DIAL_TIMEOUT + 2, message="the losing dial counted as a connection error")
        # Excluded: no more dials there.
        before = len(dials)
        for _ in range(10):
            with socket.create_connection(app.proxy_address, timeout=10) as s:
                read_line(s)
        assert str(hole) not in dials[before:]
        # With no losing dial left, the reaper thread goes: threads back to the baseline.
        wait_until(lambda: not any(t.name == "dial-reaper" for t in threading.enumerate()),
                   DIAL_TIMEOUT + offpath.IDLE_S + 5, message="the reaper gone")


def test_hedge_off_waits_for_the_dial_timeout(make_app, servers):
    """--dial-hedge-delay=0: the spec's behaviour, one dial at a time."""
    (up,) = servers(1)
    timeout = 0.5
    with black_hole() as hole:
        app = make_app([hole, up.endpoint], dial_hedge_delay=0.0, health_timeout=timeout,
                       health_interval=30, prober=always_up)
        slow = 0
        for _ in range(12):
            t0 = time.monotonic()
            with socket.create_connection(app.proxy_address, timeout=10) as s:
                assert read_line(s) == "up0"
            slow += time.monotonic() - t0 >= timeout
            if not app.registry.snapshot().get(str(hole)).healthy:
                break
        assert slow >= 1  # a client that picked the black hole waited out the dial


def test_a_refused_dial_moves_on_at_once_without_waiting_for_the_hedge(make_app, servers):
    (up,) = servers(1)
    with socket.socket() as bound:  # bound, not listening: refused at once
        bound.bind(("127.0.0.1", 0))
        dead = Endpoint("127.0.0.1", bound.getsockname()[1])
        app = make_app([dead, up.endpoint], dial_hedge_delay=2.0, health_timeout=3.0,
                       health_interval=30, prober=always_up)
        for _ in range(10):
            t0 = time.monotonic()
            with socket.create_connection(app.proxy_address, timeout=10) as s:
                assert read_line(s) == "up0"
            assert time.monotonic() - t0 < 1.5  # not the 2 s hedge delay
