"""Fast fall (--health-recheck) and unready connections' own grace period
(--unready-drain-timeout), on real threads and real loopback TLS upstreams.

Every bound is derived from the flags the test passes, plus SLACK for a shared 2-core
machine; the defaults (recheck = interval, unready drain = drain) are tested too, since
they are the spec's timing.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from extractedprism.checks.ticker import JITTER, Ticker
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.upstream import FakeUpstream
from tests.net.test_readyz_e2e import is_closed, readiness, watch_on
from tests.util import wait_until

SLACK = 0.5  # thread start-up and scheduling on a shared machine
EP = Endpoint("127.0.0.1", 6443)  # never dialled: the prober is scripted
OK = ProbeResult(True, 0.001, "")
DOWN = ProbeResult(False, None, "connection refused")


class ScriptedProber:
    """Answers OK for the first ``ok_first`` probes, then DOWN; records when each began."""

    def __init__(self, ok_first: int) -> None:
        self.ok_first = ok_first
        self.started: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
        with self._lock:
            self.started.append(time.monotonic())
            n = len(self.started)
        return OK if n <= self.ok_first else DOWN

    def count(self) -> int:
        with self._lock:
            return len(self.started)


class NoSpread(random.Random):
    """A phase of (all but) one whole interval: the second check an interval after the
    first, as without the spread."""

    def random(self) -> float:
        return 1.0 - 1e-9


class Rig:
    """A registry and its ticker wired as app.py wires them, with a scripted prober."""

    def __init__(self, prober: ScriptedProber, *, interval: float, recheck: float | None
                 ) -> None:
        self.stop = threading.Event()
        self.registry = Registry(on_change=self._changed)
        # No spread (phase and jitter have tests of their own, test_probe_schedule.py):
        # these check the recheck against the plain interval.
        self.ticker = Ticker(self.registry, interval=interval, timeout=0.1, readyz=None,
                             stop=self.stop, recheck=recheck, max_wait=0.2, prober=prober,
                             rng=NoSpread(), jitter=0.0)
        self.registry.membership.set_endpoints([EP])
        self.ticker.start()

    def _changed(self, change: Change) -> None:
        self.ticker.registry_changed(change)

    def healthy(self) -> bool:
        return self.registry.snapshot().get(str(EP)).healthy

    def close(self) -> None:
        self.stop.set()
        assert self.ticker.join(5)


@pytest.fixture
def rigs():  # type: ignore[no-untyped-def]
    made: list[Rig] = []

    def make(prober: ScriptedProber, **kw: float | None) -> Rig:
        made.append(Rig(prober, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recheck", [0.2, None], ids=["recheck-0.2s", "default"])
def test_the_check_that_confirms_a_first_failure_comes_after_the_recheck(rigs, recheck):
    interval = 1.0
    expect = interval if recheck is None else recheck  # the default is the spec's timing
    prober = ScriptedProber(ok_first=1)
    rig = rigs(prober, interval=interval, recheck=recheck)
    wait_until(lambda: prober.count() >= 3, interval * 2 + expect + SLACK * 2)
    first_ok, first_failed, confirming = prober.started[:3]
    assert first_failed - first_ok >= interval - 0.05  # a healthy one waits the interval
    gap = confirming - first_failed
    assert expect - 0.05 <= gap <= expect + SLACK, gap
    # Two consecutive failures still exclude; then the interval again (nothing to confirm).
    wait_until(lambda: not rig.healthy(), SLACK)
    wait_until(lambda: prober.count() >= 4, interval + SLACK)
    assert prober.started[3] - confirming >= interval - 0.05


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recheck", [0.2, None], ids=["recheck-0.2s", "default"])
def test_a_failed_dial_brings_the_confirming_check_forward(rigs, recheck):
    interval = 2.0
    prober = ScriptedProber(ok_first=10)  # the probes pass; only the dial fails
    rig = rigs(prober, interval=interval, recheck=recheck)
    wait_until(lambda: prober.count() >= 1, SLACK)
    t_dial = time.monotonic()
    rig.registry.verdicts.record_dial(str(EP), False, "connection refused")
    wait_until(lambda: prober.count() >= 2, interval + SLACK)
    took = prober.started[1] - t_dial
    if recheck is None:  # the spec's schedule: the next probe an interval after the last
        assert prober.started[1] - prober.started[0] >= interval - 0.05
    else:
        assert took <= recheck + SLACK, took
    assert rig.healthy()  # the probe passed: the streak is cleared


# --- end to end: App with TLS upstreams answering /readyz -------------------------------


INTERVAL, TIMEOUT = 1.5, 0.25


def start(make_app, ups, ca, tmp_path, **flags):  # type: ignore[no-untyped-def]
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    app = make_app([u.endpoint for u in ups], health_check="readyz",
                   health_check_ca_file=str(ca_file), health_interval=INTERVAL,
                   health_timeout=TIMEOUT, **flags)
    wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)
    return app


def readyz_hits_after(up: FakeUpstream, t: float) -> list[float]:
    return [r.when for r in up.requests_for("/readyz") if r.when >= t]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recheck", [0.3, None], ids=["recheck-0.3s", "default"])
def test_failing_readyz_is_excluded_within_interval_plus_recheck(make_app, ups, ca, tmp_path,
                                                                 recheck):
    flags = {} if recheck is None else {"health_recheck": recheck}
    app = start(make_app, ups, ca, tmp_path, **flags)
    expect = INTERVAL if recheck is None else recheck
    bad = ups[0]
    t0 = time.monotonic()
    bad.set_ready_status(500)
    wait_until(lambda: readiness(app, bad.address) == "unready",
               INTERVAL + expect + 2 * TIMEOUT + SLACK)
    took = time.monotonic() - t0
    hits = readyz_hits_after(bad, t0)
    assert len(hits) >= 2
    # The second failing probe came one recheck after the first (from the upstream's side);
    # with the default (recheck = interval) it is the next round, up to JITTER sooner.
    low = expect - 0.05 if recheck is not None else expect * (1 - JITTER) - 0.05
    assert low <= hits[1] - hits[0] <= expect + SLACK, hits
    assert took <= INTERVAL + expect + 2 * TIMEOUT + SLACK, took


@pytest.mark.timeout(60)
def test_unready_connections_leave_after_the_unready_drain_timeout(make_app, ups, ca,
                                                                   tmp_path):
    drain, unready = 20.0, 0.6
    app = start(make_app, ups, ca, tmp_path, drain_timeout=drain,
                unready_drain_timeout=unready, health_recheck=0.3)
    bad = ups[0]
    with watch_on(app, ca, "up0") as stream:
        bad.set_ready_status(500)
        wait_until(lambda: readiness(app, bad.address) == "unready",
                   INTERVAL + 0.3 + 2 * TIMEOUT + SLACK)
        t0 = time.monotonic()
        view = app.registry.snapshot().get(bad.address)
        assert view.draining_reason == "unready"
        assert view.close_deadline is not None
        assert view.close_deadline - t0 <= unready + 0.05  # its own period, not --drain-timeout
        assert not is_closed(stream, unready * 0.5)  # the grace period is honoured ...
        assert is_closed(stream, unready + INTERVAL + SLACK)  # ... then it is closed
        assert time.monotonic() - t0 <= unready + INTERVAL + SLACK


@pytest.mark.timeout(60)
def test_unready_drain_timeout_defaults_to_the_drain_timeout(make_app, ups, ca, tmp_path):
    drain = 1.0
    app = start(make_app, ups, ca, tmp_path, drain_timeout=drain)
    assert app.config.unready_drain_timeout == drain
    bad = ups[0]
    with watch_on(app, ca, "up0") as stream:
        bad.set_ready_status(500)
        wait_until(lambda: readiness(app, bad.address) == "unready",
                   2 * INTERVAL + 2 * TIMEOUT + SLACK)
        t0 = time.monotonic()
        assert not is_closed(stream, drain * 0.6)
        assert is_closed(stream, drain + INTERVAL + SLACK)
        assert time.monotonic() - t0 <= drain + INTERVAL + SLACK
