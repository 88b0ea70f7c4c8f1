"""The per-upstream gauges the alerts and the dashboard read (docs/operations.md, "Metrics
the alerts and the dashboard read"), from a real App over real loopback upstreams.

A stopped upstream's first failed check makes it a suspect (streak 1, still healthy) for
--health-recheck; the confirming failure takes it out (streak 2, status 0). Bounds come
from the flags the test passes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extractedprism.app import App
from extractedprism.upstreams.state import FAILURE_THRESHOLD
from tests.fakes.upstream import IdentityServer
from tests.util import http, wait_until

INTERVAL, TIMEOUT, RECHECK = 0.3, 0.2, 3.0
SLACK = 1.0  # thread start-up and scheduling on a shared machine


def gauges(app: App, name: str) -> dict[str, float]:
    _, _, body = http(app.health_address, "/metrics")
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name == name:
            return {s.labels["upstream"]: s.value for s in fam.samples}
    return {}


@pytest.mark.timeout(30)
def test_failure_streak_shows_a_suspect_before_its_exclusion(
        make_app: Callable[..., App], servers: Callable[..., list[IdentityServer]]) -> None:
    up0, up1 = servers(2)
    app = make_app([up0.endpoint, up1.endpoint], health_interval=INTERVAL,
                   health_timeout=TIMEOUT, health_recheck=RECHECK)
    a0, a1 = (f"{u.endpoint.host}:{u.endpoint.port}" for u in (up0, up1))
    wait_until(lambda: gauges(app, "extractedprism_upstream_failure_streak") == {a0: 0, a1: 0},
               INTERVAL + TIMEOUT + SLACK, message="both upstreams checked, no streak")
    up1.stop()
    # Its next check fails within an interval (and a timeout): a suspect, still healthy.
    wait_until(lambda: gauges(app, "extractedprism_upstream_failure_streak").get(a1) == 1,
               INTERVAL + TIMEOUT + SLACK, message="streak 1 after the first failed check")
    assert gauges(app, "extractedprism_health_check_status")[a1] == 1
    # The confirming check runs --health-recheck after the first: excluded.
    wait_until(lambda: gauges(app, "extractedprism_health_check_status").get(a1) == 0,
               RECHECK + TIMEOUT + SLACK, message="excluded by the confirming check")
    streak = gauges(app, "extractedprism_upstream_failure_streak")
    assert streak[a1] >= FAILURE_THRESHOLD and streak[a0] == 0


@pytest.mark.timeout(30)
def test_stalled_connections_series_only_with_the_stall_check(
        make_app: Callable[..., App], servers: Callable[..., list[IdentityServer]]) -> None:
    (up,) = servers(1)
    addr = f"{up.endpoint.host}:{up.endpoint.port}"
    off = make_app([up.endpoint])
    on = make_app([up.endpoint], stall_timeout=2.0)
    assert gauges(on, "extractedprism_upstream_stalled_connections") == {addr: 0}
    assert gauges(off, "extractedprism_upstream_stalled_connections") == {}
