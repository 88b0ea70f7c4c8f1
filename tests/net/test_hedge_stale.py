"""The hedge of a stalled dial avoids upstreams whose dials stall, and reaches a static
fallback (issue 29, "membership that cannot go stale").

Measured on the real control plane (tests/controlplane/test_stale_membership.py): when
every discovered API server is black-holed while the static endpoint lives, a
connection's first dial and its hedge both went to dead servers, stalled for the whole
dial timeout (15 s with the spec's defaults), and the live static endpoint carried
traffic only once failures excluded the dead ones: 32 s of failed requests. The rule:
an upstream whose dial stalled past the hedge delay (no success since) takes no new
connection while another pickable one can, a hedge skips it too, and with nothing else
left the hedge goes to the healthy upstream without the mark, a static fallback
(``--static-endpoints=fallback``) included. Probes are kept out of the way (always up),
so only the dials' stalls can tell."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable

import pytest

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from tests.conftest import fast_config
from tests.net.test_hedge import always_up, black_hole
from tests.util import read_line, wait_until

pytestmark = pytest.mark.timeout(60)

HEDGE = 0.1
DIAL_TIMEOUT = 6.0  # --health-timeout: a black hole's dial stalls this long
# A client reaches the live upstream within the hedge delay plus a loopback dial and a
# 2-core machine's scheduling; far below the dial timeout a stalled hedge costs.
BOUND = HEDGE + 1.0
# --health-interval: an hour, so no scheduled check lands in a test (the ticker starts
# at a random phase of the interval); an always-up check would clear a stall mark.
CHECKS_OFF = 3600.0


def _client(address: tuple[str, int], out: list[tuple[float, str | None]]) -> None:
    t0 = time.monotonic()
    try:
        with socket.create_connection(address, timeout=DIAL_TIMEOUT * 3) as s:
            name: str | None = read_line(s)
    except OSError:
        name = None
    out.append((time.monotonic() - t0, name))


def _stall_both(app: App, holes: list[Endpoint], clients: list[threading.Thread],
                results: list[tuple[float, str | None]]) -> None:
    """Clients in the background until every black hole has a dial in flight, and then
    the hedge delay twice over: every one of those dials has stalled (the public
    dials_in_flight, so the same wait runs on code without the rule)."""

    def in_flight() -> bool:
        snap = app.registry.snapshot()
        return all(snap.get(str(h)).dials_in_flight > 0 for h in holes)

    for _ in range(12):  # a client whose first pick is the live upstream dials no hole
        t = threading.Thread(target=_client, args=(app.proxy_address, results),
                             name="test-stall-client", daemon=True)
        t.start()
        clients.append(t)
        with contextlib.suppress(AssertionError):
            wait_until(in_flight, 3 * HEDGE, interval=0.01)
        if in_flight():
            break
    wait_until(in_flight, DIAL_TIMEOUT / 2, message="every black hole with a dial in flight")
    seen = time.monotonic()
    wait_until(lambda: time.monotonic() - seen > 2 * HEDGE and in_flight(), DIAL_TIMEOUT / 2,
               interval=0.01, message="the dials in flight past the hedge delay")


def _first_checks_done(app: App, endpoints: list[Endpoint]) -> None:
    """Each upstream's first check recorded. Checks here are always up, and a success
    clears a stall mark: one that landed after a client's dial stalled would clear it
    (a real check of a black hole fails). The next come after --health-interval (or
    --health-recheck after a failed dial): an hour here."""
    wait_until(lambda: all(app.registry.snapshot().get(str(e)).last_check_at is not None
                           for e in endpoints), 5, message="the first checks recorded")


def _timed(address: tuple[str, int]) -> tuple[float, str]:
    t0 = time.monotonic()
    with socket.create_connection(address, timeout=DIAL_TIMEOUT * 3) as s:
        name = read_line(s)
    return time.monotonic() - t0, name


def _measure(address: tuple[str, int], n: int) -> list[tuple[float, str]]:
    """``n`` clients one after another, up to the first that misses the bound."""
    out: list[tuple[float, str]] = []
    for _ in range(n):
        out.append(_timed(address))
        if out[-1][0] >= BOUND:
            break
    return out


def test_a_hedge_reaches_the_static_fallback_when_every_discovered_dial_stalls(
        make_app: Callable[..., App], servers) -> None:
    (static,) = servers(1)
    with black_hole() as h1, black_hole() as h2:
        app = make_app([static.endpoint], static_endpoints="fallback",
                       dial_hedge_delay=HEDGE, health_timeout=DIAL_TIMEOUT,
                       health_interval=CHECKS_OFF, prober=always_up)
        app._on_discovered([h1, h2])  # what the watcher hands over
        assert app.registry.snapshot().get(str(static.endpoint)).fallback
        _first_checks_done(app, [h1, h2, static.endpoint])
        background: list[threading.Thread] = []
        results: list[tuple[float, str | None]] = []
        t0 = time.monotonic()
        _stall_both(app, [h1, h2], background, results)
        # Before the first stalled dials time out (nothing has excluded the holes yet:
        # both still pickable, no panic), every new client reaches the fallback.
        measured = _measure(app.proxy_address, 6)
        for elapsed, name in measured:
            assert name == "up0" and elapsed < BOUND, (measured, BOUND)
        assert time.monotonic() - t0 < DIAL_TIMEOUT, "measured after the stalls ended"
        assert all(app.registry.snapshot().get(str(h)).healthy for h in (h1, h2))
        for t in background:
            t.join(DIAL_TIMEOUT * 3)
        # The first clients too, once their first dial timed out (the hedge after a
        # failure goes to the fallback, not to a wait for the other stalled dial).
        assert all(name == "up0" for _, name in results), results


def test_a_hedge_avoids_stalled_upstreams_with_the_static_endpoints_always(
        servers) -> None:
    (static,) = servers(1)
    with black_hole() as h1, black_hole() as h2:
        # A seeded pick, so the same sequence of first picks runs on every code.
        app = App(fast_config([h1, h2, static.endpoint], dial_hedge_delay=HEDGE,
                              health_timeout=DIAL_TIMEOUT, health_interval=CHECKS_OFF),
                  prober=always_up, rng=random.Random(29))
        app.start()
        try:
            _first_checks_done(app, [h1, h2, static.endpoint])
            background: list[threading.Thread] = []
            results: list[tuple[float, str | None]] = []
            t0 = time.monotonic()
            _stall_both(app, [h1, h2], background, results)
            measured = _measure(app.proxy_address, 12)
            for elapsed, name in measured:
                assert name == "up0" and elapsed < BOUND, (measured, BOUND)
            assert time.monotonic() - t0 < DIAL_TIMEOUT, "measured after the stalls ended"
            for t in background:
                t.join(DIAL_TIMEOUT * 3)
        finally:
            app.stop()


def test_without_stalls_the_hedge_is_an_ordinary_pick_and_never_the_fallback(
        make_app: Callable[..., App], servers) -> None:
    """One black hole among two live discovered servers: the hedge of a dial to the
    hole goes to a live discovered server, never to the static fallback."""
    up = servers(3)
    static, live = up[0], up[1:]
    with black_hole() as hole:
        app = make_app([static.endpoint], static_endpoints="fallback",
                       dial_hedge_delay=HEDGE, health_timeout=DIAL_TIMEOUT,
                       health_interval=CHECKS_OFF, prober=always_up)
        app._on_discovered([hole, *(u.endpoint for u in live)])
        names = [_timed(app.proxy_address)[1] for _ in range(20)]
        assert set(names) <= {"up1", "up2"}, names


def test_a_stall_is_remembered_after_the_stalled_dial_timed_out(
        make_app: Callable[..., App], servers) -> None:
    """Found on the real control plane: a kubelet retries every 10 s, a black hole's dial
    lasts the dial timeout; a mark that ended with the dial let the next client's hedge
    go to another dead server. The mark stays until something succeeds there."""
    (static,) = servers(1)
    timeout = 2.0  # well above BOUND: a hedge into a black hole cannot pass
    with black_hole() as h1, black_hole() as h2:
        app = make_app([static.endpoint], static_endpoints="fallback",
                       dial_hedge_delay=HEDGE, health_timeout=timeout,
                       health_interval=CHECKS_OFF, prober=always_up)
        app._on_discovered([h1, h2])
        _first_checks_done(app, [h1, h2, static.endpoint])
        # The first client: a hole, the other hole as the hedge, both stall; when the
        # first times out, the fallback carries it.
        first = _timed(app.proxy_address)
        assert first[1] == "up0", first

        def ended() -> bool:
            snap = app.registry.snapshot()
            return all(snap.get(str(h)).dials_in_flight == 0 for h in (h1, h2))

        wait_until(ended, timeout + 2, message="both stalled dials timed out")
        snap = app.registry.snapshot()
        # One failure each: both still pickable, nothing in panic.
        assert all(snap.get(str(h)).healthy for h in (h1, h2)) and not snap.panic
        second = _timed(app.proxy_address)
        assert second[1] == "up0" and second[0] < BOUND, (second, BOUND)
        # Both holes marked (what /upstreams shows as dial_stalled), the fallback not.
        assert [snap.get(str(e)).dial_stalled for e in (h1, h2, static.endpoint)] == [
            True, True, False]
