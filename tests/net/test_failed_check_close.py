"""Two rules the 100-node freeze asked for, black-box on loopback with real TLS upstreams:

* with ``--stall-timeout``, a failed check closes its upstream's stalled connections at
  once (already the first failed check, not only the confirming one that excludes), and
  the reconnect avoids that upstream until its next check decides;
* ``--overload-guard``: a readyz probe that runs out of ``--health-timeout`` counts only
  against a faster peer: the last upstream serving, and upstreams all answering late,
  stay in service (off: they go unready, as the spec says).

Bounds come from the flags each test passes; SLACK covers scheduling on a shared
2-core machine.
"""

from __future__ import annotations

import time

import pytest

from extractedprism.upstreams.sampler import stall_sample_period
from extractedprism.upstreams.verdicts import GUARD_INTERVALS
from tests.fakes.upstream import FakeUpstream
from tests.net.test_stall import (
    RELAYS,
    SLACK,
    Client,
    clients,
    start,
    ups,
    view,
)
from tests.util import http, wait_until

__all__ = ["clients", "ups"]  # the fixtures, shared with test_stall

STALL, TIMEOUT = 0.8, 0.25
# A long recheck: the close at the first failed check and the exclusion by the confirming
# one are seconds apart, so a test can tell them apart without racing.
RECHECK = 3.0
PERIOD = stall_sample_period(STALL)


@pytest.mark.timeout(60)
@RELAYS
def test_the_first_failed_check_closes_the_stalled_connection_and_the_reconnect_goes_elsewhere(
        make_app, ups, ca, tmp_path, clients, relay):
    app = start(make_app, ups, ca, tmp_path, relay=relay, health_timeout=TIMEOUT,
                health_recheck=RECHECK, upstream_selection="least-conn")
    bad = ups[0]
    # least-conn would send the reconnect to up0: up1 carries two connections, up0 none
    # once the stalled one is closed.
    stalled = clients(app, ca, "up0")
    clients(app, ca, "up1")
    clients(app, ca, "up1")
    bad.silence()  # a frozen server: requests and /readyz hang
    t0 = time.monotonic()
    stalled.send("/whoami")
    first = wait_until(lambda: bad.readyz_after(t0), STALL + PERIOD + SLACK,
                       message="a stall-triggered check")[0]
    # Closed when that first check fails (TIMEOUT after it starts), not when the
    # confirming check RECHECK later excludes up0.
    assert stalled.closed_within(TIMEOUT + SLACK), "the stalled connection stayed open"
    closed = time.monotonic()
    assert closed - first < RECHECK, closed - first
    assert app.registry.snapshot().get(bad.address).readiness == "ready"  # one failure
    # The client reconnects: not to up0, though it now has the fewest connections.
    for _ in range(3):
        again = Client(app, ca)
        try:
            assert again.get("/whoami") == b"up1"
        finally:
            again.close()
    wait_until(lambda: app.registry.snapshot().get(bad.address).readiness == "unready",
               RECHECK + TIMEOUT + SLACK, message="up0 excluded by the confirming check")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [True, False], ids=["overload-guard", "off"])
def test_the_last_upstream_answering_readyz_late_stays_in_service(
        make_app, ups, ca, tmp_path, clients, keep):
    interval = 0.5
    app = start(make_app, ups, ca, tmp_path, health_interval=interval,
                health_timeout=TIMEOUT, health_recheck=0.2, stall_timeout=0.0,
                overload_guard=keep)
    slow, gone = ups
    gone.stop()  # refused: excluded by its checks, whatever the flag
    wait_until(lambda: app.registry.snapshot().get(gone.address).readiness == "unready",
               2 * interval + 2 * TIMEOUT + SLACK, message="up1 excluded")
    slow.readyz_delay = 2 * TIMEOUT  # every probe of up0 now runs out of the timeout
    # Three scheduled rounds: enough for two failures in a row (and the recheck).
    window = 3 * interval + 2 * TIMEOUT + SLACK
    if keep:
        entry = wait_until(lambda: (e := view(app, slow))["slow_not_counted"] and e, window,
                           message="a slow answer not counted")
        assert entry["ready"] and entry["last_check_error"] == "timeout"
        text = http(app.health_address, "/metrics")[2].decode()
        assert f'extractedprism_slow_not_counted_total{{upstream="{slow.address}"}}' in text
        # Held back only for GUARD_INTERVALS check periods after its last passed check
        # (issue 37): an upstream answering no check is then excluded whatever the guard
        # says, so a frozen one is never kept for ever.
        bound = GUARD_INTERVALS * (interval + TIMEOUT)
        wait_until(lambda: app.registry.snapshot().get(slow.address).readiness == "unready",
                   bound + window, message="up0 unready once the guard's bound passed")
        # With none ready, readiness does not narrow the picks: new connections still
        # reach it, and it is not panic mode.
        assert clients(app, ca, "up0").get("/whoami") == b"up0"
        assert not app.registry.snapshot().panic
    else:
        wait_until(lambda: app.registry.snapshot().get(slow.address).readiness == "unready",
                   window, message="up0 unready by two slow answers (the spec)")
        assert view(app, slow)["slow_not_counted"] is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("guard", [True, False], ids=["overload-guard", "off"])
def test_upstreams_all_answering_readyz_late_stay_in_service(
        make_app, ups, ca, tmp_path, clients, guard):
    """An overloaded control plane: every upstream answers /readyz past the timeout. With
    the guard a slow answer counts only against a faster peer, so at most the first one
    slow twice before the other's check showed it slow too goes unready (the checks run
    at their own phases), and the other stays in service with its connection open until
    the guard's bound (issue 37); then it is unready too, its connection still open.
    Off, both go unready."""
    interval = 0.5
    app = start(make_app, ups, ca, tmp_path, health_interval=interval,
                health_timeout=TIMEOUT, health_recheck=0.2, stall_timeout=0.0,
                unready_drain_timeout=0.1, overload_guard=guard)
    held = {up.address: clients(app, ca, up.name) for up in ups}
    for up in ups:
        up.readyz_delay = 2 * TIMEOUT
    window = 4 * interval + 3 * TIMEOUT + SLACK
    if guard:
        wait_until(lambda: any(view(app, up)["slow_not_counted"] for up in ups), window,
                   message="a slow answer not counted")
        # Within the guard's bound one stays ready; past it (no check answered in time
        # for GUARD_INTERVALS periods) both are out whatever the guard says (issue 37).
        bound = GUARD_INTERVALS * (interval + TIMEOUT)
        deadline = time.monotonic() + bound + window
        last: list[FakeUpstream] = []  # the ones still ready just before both were out
        while time.monotonic() < deadline:
            snap = app.registry.snapshot()
            ready = [up for up in ups if snap.get(up.address).readiness == "ready"]
            assert not snap.panic
            if not ready:
                break
            last = ready
            time.sleep(0.05)
        else:
            pytest.fail("not both unready within the guard's bound")
        assert last and any(view(app, up)["slow_not_counted"] for up in ups)
        # The connections on the last one kept were never closed: no other was ready
        # when it went, so readiness had nowhere to move them.
        for up in last:
            assert held[up.address].get("/whoami") == up.name.encode()
    else:
        wait_until(lambda: all(app.registry.snapshot().get(up.address).readiness == "unready"
                               for up in ups), window, message="both unready (the spec)")
