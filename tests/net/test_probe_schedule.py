"""The ticker spreads its schedule (a random phase after the first check, jitter every
round) and owns the probes' kept connections: real threads, real loopback TLS.

Bounds come from the interval, jitter and timeout the test passes, plus SLACK for a shared
2-core machine; the default jitter is checked on the pure rule (next_gap) with an
injected rng.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time

import pytest

from extractedprism.checks.ticker import JITTER, Ticker, next_gap
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.upstream import FakeUpstream
from tests.util import http, wait_until

SLACK = 0.5
EP = Endpoint("127.0.0.1", 6443)  # never dialled: the prober is scripted
OK = ProbeResult(True, 0.001, "")

pytestmark = pytest.mark.timeout(60)


class FixedRng(random.Random):
    """random() answers the given values in turn, then the last one forever."""

    def __init__(self, *values: float) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


class Recorder:
    def __init__(self) -> None:
        self.started: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
        with self._lock:
            self.started.append(time.monotonic())
        return OK

    def count(self) -> int:
        with self._lock:
            return len(self.started)


def run_ticker(prober: Recorder, rng: random.Random, *, interval: float, jitter: float,
               rounds: int) -> list[float]:
    stop = threading.Event()
    ticker: Ticker | None = None

    def changed(change: Change) -> None:
        assert ticker is not None
        ticker.registry_changed(change)

    registry = Registry(on_change=changed)
    ticker = Ticker(registry, interval=interval, timeout=0.1, readyz=None, stop=stop,
                    max_wait=0.2, prober=prober, rng=rng, jitter=jitter)
    registry.membership.set_endpoints([EP])
    ticker.start()
    try:
        wait_until(lambda: prober.count() >= rounds, rounds * interval + 5)
    finally:
        stop.set()
        assert ticker.join(5)
    return prober.started


def test_second_check_comes_after_a_random_phase_then_jittered_rounds() -> None:
    interval, jitter = 2.0, 0.5
    phase_draw, jitter_draw = 0.1, 0.9
    started = run_ticker(Recorder(), FixedRng(phase_draw, jitter_draw), interval=interval,
                         jitter=jitter, rounds=4)
    gaps = [b - a for a, b in itertools.pairwise(started)]
    phase = interval * phase_draw  # 0.2 s: without the phase it would be the interval
    round_gap = interval * (1 - jitter * jitter_draw)  # 1.1 s: without jitter, 2 s
    assert phase - 0.05 <= gaps[0] <= phase + SLACK, gaps
    for g in gaps[1:3]:
        assert round_gap - 0.05 <= g <= round_gap + SLACK, gaps


def test_without_randomness_the_schedule_is_the_interval() -> None:
    # rng draws of 1 - tiny (phase) then 0 (no shortening): the spec's plain interval.
    interval = 0.6
    started = run_ticker(Recorder(), FixedRng(0.999999, 0.0), interval=interval,
                         jitter=JITTER, rounds=3)
    gaps = [b - a for a, b in itertools.pairwise(started)]
    for g in gaps[:2]:
        assert interval - 0.05 <= g <= interval + SLACK, gaps


@pytest.mark.parametrize("interval", [20.0, 5.0, 1.0])
def test_next_gap_bounds_with_the_default_jitter(interval: float) -> None:
    # The extremes of the rng: a phase anywhere in one interval, rounds never longer
    # than the interval and never shorter than JITTER (5 %) less.
    assert next_gap(interval, FixedRng(0.0), first=True) == 0.0
    assert next_gap(interval, FixedRng(0.999999), first=True) < interval
    assert next_gap(interval, FixedRng(0.0), first=False) == interval
    low = next_gap(interval, FixedRng(0.999999), first=False)
    assert interval * (1 - JITTER) <= low < interval
    assert JITTER == 0.05


def test_phases_of_many_nodes_cover_the_interval() -> None:
    # 200 nodes started in the same instant: their second checks spread over the whole
    # interval instead of landing together; later rounds drift apart.
    interval = 5.0
    phases = sorted(next_gap(interval, random.Random(seed), first=True) for seed in range(200))
    assert phases[0] < 0.1 * interval and phases[-1] > 0.9 * interval
    # no tenth of the interval holds more than a quarter of the nodes
    buckets = [0] * 10
    for p in phases:
        buckets[int(p / interval * 10)] += 1
    assert max(buckets) < 50, buckets
    rounds = [next_gap(interval, random.Random(seed), first=False) for seed in range(200)]
    assert min(rounds) >= interval * (1 - JITTER) and max(rounds) <= interval
    assert max(rounds) - min(rounds) > interval * JITTER / 2


def metric(app, name: str, addr: str) -> float | None:  # type: ignore[no-untyped-def]
    status, _, body = http(app.health_address, "/metrics")
    assert status == 200
    m = re.search(rf'^{name}{{upstream="{re.escape(addr)}"}} (\S+)$', body.decode(), re.M)
    return float(m.group(1)) if m else None


def test_app_probes_over_kept_connections_and_closes_them(make_app, ca, tmp_path
                                                          ) -> None:  # type: ignore[no-untyped-def]
    interval, timeout = 0.3, 0.25
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with FakeUpstream(ca=ca, name="a") as a, FakeUpstream(ca=ca, name="b") as b:
        app = make_app([a.endpoint, b.endpoint], health_check="readyz",
                       health_check_ca_file=str(ca_file), health_interval=interval,
                       health_timeout=timeout, drain_timeout=1.0)
        wait_until(lambda: a.hit_count("/readyz") >= 5 and b.hit_count("/readyz") >= 5,
                   5 * interval + 10)
        assert a.handshakes == 1 and b.handshakes == 1
        name = "extractedprism_readyz_connections_total"
        assert metric(app, name, a.address) == 1.0
        assert metric(app, name, b.address) == 1.0
        # a removed upstream's kept connection is closed (its TCP checks stop too)
        app.registry.membership.set_endpoints([b.endpoint])
        wait_until(lambda: a.active_connections() == 0, interval + timeout + 5)
        wait_until(lambda: metric(app, name, a.address) is None, 5)
        assert b.active_connections() == 1
        app.stop()  # shutdown closes the rest
        wait_until(lambda: b.active_connections() == 0, 5)
