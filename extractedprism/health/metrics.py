"""Prometheus metrics: discovery counters fed by events, the rest read from snapshots.

Upstream state and its counters (connections, dial errors, bytes) are plain integers
in the registry's records; :class:`StateCollector` turns one ``snapshot()`` into every
gauge and those counters at scrape time, so a removed upstream's series vanish with
its record, can never disagree with ``/upstreams``, and no metric call happens under
the registry lock. The discovery counters belong to no upstream and are incremented
by merge.py and watch.py where the event happens. Metric objects live on an injected
``CollectorRegistry`` so each test (and each App) gets a fresh set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from extractedprism.upstreams.activity import STALL_CHECK_RESULTS

if TYPE_CHECKING:
    from extractedprism.upstreams.snapshot import Snapshot, UpstreamView

PREFIX = "extractedprism_"

# `_created` timestamps double the counter series and help nobody reading this proxy.
disable_created_metrics()


class Metrics:
    """Every metric of extractedprism, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.discovery_updates_total = Counter(
            PREFIX + "discovery_updates_total",
            "Endpoint list updates received, by provider (static, kubernetes)",
            ["provider"],
            registry=r,
        )
        self.discovery_errors_total = Counter(
            PREFIX + "discovery_errors_total",
            "Discovery errors: provider failures, failed Watch calls, watch error events and "
            "failed re-lists (not stream ends, not 410 Gone)",
            ["provider"],
            registry=r,
        )
        self._collector: StateCollector | None = None

    def attach_state(self, snapshot: Callable[[], Snapshot]) -> None:
        """Serve the gauges from ``snapshot()`` at every scrape."""
        self._collector = StateCollector(snapshot)
        self.registry.register(self._collector)

    def attach_probe_connections(self, opened: Callable[[], Mapping[str, int]]) -> None:
        """Serve ``extractedprism_readyz_connections_total`` from ``opened()`` (new TLS
        connections the readyz probes opened, per upstream) at every scrape."""
        self.registry.register(ProbeConnectionsCollector(opened))


PerUpstream = Callable[["Snapshot", "UpstreamView"], "float | None"]

# Gauges of the whole proxy: (name, help, value).
GAUGES: tuple[tuple[str, str, Callable[[Snapshot], float]], ...] = (
    ("upstreams_active", "Upstreams eligible for new connections (healthy, not draining)",
     lambda s: sum(1 for u in s.upstreams if u.pickable)),
    ("upstreams_total", "Total known upstreams, including unhealthy and draining (not the "
     "static endpoints --static-endpoints=fallback keeps as a last resort)",
     lambda s: sum(1 for u in s.upstreams if not u.fallback)),
    ("connections_active", "TCP connections currently passing through the proxy",
     lambda s: s.connections_active),
    ("connections_max", "Maximum concurrent connections (--max-connections)",
     lambda s: s.max_connections),
    ("panic", "1 while no upstream is pickable and new connections try every known upstream",
     lambda s: 1 if s.panic else 0),
)

# Per-upstream gauges, label "upstream": (name, help, value or None for no series).
UPSTREAM_GAUGES: tuple[tuple[str, str, PerUpstream], ...] = (
    ("health_check_status", "Upstream health state after the consecutive-failure threshold, "
     "fed by health checks and client dials (1 healthy, 0 unhealthy)",
     lambda s, u: 1 if u.healthy else 0),
    ("upstream_connections_active", "Live proxied connections per upstream",
     lambda s, u: u.active_connections),
    ("upstream_rtt_seconds", "Smoothed health check connect time (latency selection only)",
     lambda s, u: u.rtt_seconds if s.latency_mode else None),
    ("upstream_latency_tier",
     "Latency tier of the upstream, 0 being the closest group (latency selection only)",
     lambda s, u: u.tier if s.latency_mode else None),
    ("upstream_ready",
     "/readyz probe state after the consecutive-failure threshold (1 ready, 0 not ready)",
     lambda s, u: (1 if u.ready else 0) if s.readyz_mode and u.probed_ready else None),
    ("upstream_suspect",
     "1 while the stall check marks the upstream (a stalled connection its checks have not "
     "settled): new connections avoid it while an unmarked one is eligible "
     "(--stall-timeout only)",
     lambda s, u: None if u.suspect is None else (1 if u.suspect else 0)),
    ("upstream_dial_stalled",
     "1 while a dial to the upstream has been in flight past --dial-hedge-delay with no "
     "success there since: new connections avoid it while an unmarked one is eligible",
     lambda s, u: 1 if u.dial_stalled else 0),
    ("upstream_weight",
     "Slow start's weight of the upstream, 0.1 to 1 while it ramps up after becoming "
     "pickable (--slow-start only)",
     lambda s, u: u.weight),
    # For the alerts and the dashboard (docs/operations.md): a healthy upstream with a
    # streak is a suspect, one failure from exclusion.
    ("upstream_failure_streak",
     "Consecutive failed health checks and client dials of the upstream, 0 after a success",
     lambda s, u: u.failures),
    ("upstream_stalled_connections",
     "Live connections to the upstream stalled at the last sample: the client sent bytes "
     "and got nothing back for --stall-timeout (--stall-timeout only)",
     lambda s, u: u.stalled_connections),
)


class StateCollector(Collector):
    """Yields the metric families computed from one registry snapshot."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        # Without describe(), registering would call collect() once, at start-up, before
        # the registry has upstreams; an empty list is the documented way to skip that.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily
                                  | HistogramMetricFamily]:
        snap = self._snapshot()
        yield CounterMetricFamily(
            PREFIX + "connections_total",
            "Connections established to upstreams since start",
            value=snap.connections_total,
        )
        errors = CounterMetricFamily(
            PREFIX + "connection_errors_total",
            "Failed connection attempts to an upstream; upstream=\"none\" counts clients "
            "closed because no upstream was available. Failures caused by proxy shutdown "
            "are not counted",
            labels=["upstream"],
        )
        # Every client dial, successful or failed, by upstream; health checks are not
        # client dials and are not observed.
        dials = HistogramMetricFamily(
            PREFIX + "dial_duration_seconds",
            "Time to connect to an upstream for a client connection, successful or failed",
            labels=["upstream"],
        )
        sent = CounterMetricFamily(
            PREFIX + "upstream_bytes_total",
            "Bytes proxied per upstream and direction (up: client to upstream)",
            labels=["upstream", "direction"],
        )
        hedges = CounterMetricFamily(
            PREFIX + "answer_hedges_total",
            "Connections whose first answer was hedged (no answer to the client's TLS "
            "ClientHello within --answer-hedge-delay), by upstream and its outcome: won "
            "(carried the connection), lost (answered after the other), silent (never "
            "answered within --health-timeout)",
            labels=["upstream", "outcome"],
        )
        errors.add_metric(["none"], snap.turned_away)
        for u in snap.upstreams:
            errors.add_metric([u.address], u.connection_errors)
            sent.add_metric([u.address, "up"], u.bytes_up)
            sent.add_metric([u.address, "down"], u.bytes_down)
            dials.add_metric([u.address], [(floatToGoString(b), n)
                                           for b, n in u.dials.cumulative()],
                             u.dials.total)
            for outcome, n in u.answer_hedges:
                hedges.add_metric([u.address, outcome], n)
        yield errors
        yield hedges
        yield sent
        if snap.rebalance is not None:
            closes = CounterMetricFamily(
                PREFIX + "rebalance_closes_total",
                "Connections closed by rebalancing (a FIN both ways) to move them off an "
                "upstream holding more than its share (--rebalance-interval only)",
                labels=["upstream"],
            )
            for u in snap.upstreams:
                closes.add_metric([u.address], u.rebalance_closes)
            yield closes
        if snap.stall_timeout > 0:
            stalls = CounterMetricFamily(
                PREFIX + "stall_checks_total",
                "Health checks a stalled connection asked for (its client sent bytes and "
                "the upstream sent nothing back for --stall-timeout), by upstream and "
                "result: failed or passed (--stall-timeout only)",
                labels=["upstream", "result"],
            )
            for u in snap.upstreams:
                done = dict(u.stall_checks)
                for result in STALL_CHECK_RESULTS:
                    stalls.add_metric([u.address, result], done.get(result, 0))
            yield stalls
        if snap.overload_guard:
            not_counted = CounterMetricFamily(
                PREFIX + "slow_not_counted_total",
                "Slow answers (readyz probe or a client's first answer past "
                "--health-timeout) not counted against an upstream because no faster one "
                "served (--overload-guard only)",
                labels=["upstream"],
            )
            for u in snap.upstreams:
                not_counted.add_metric([u.address], u.slow_not_counted or 0)
            yield not_counted
        yield dials
        for name, doc, value in GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value(snap))
        for name, doc, per in UPSTREAM_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["upstream"])
            for u in snap.upstreams:
                v = per(snap, u)
                if v is not None:
                    family.add_metric([u.address], v)
            yield family


class ProbeConnectionsCollector(Collector):
    """``extractedprism_readyz_connections_total{upstream}``: with keep-alive, a count
    that grows much slower than the number of probes; the series of an upstream goes
    with its kept connection when the upstream is removed."""

    def __init__(self, opened: Callable[[], Mapping[str, int]]) -> None:
        self._opened = opened

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            PREFIX + "readyz_connections_total",
            "New TLS connections opened by the readyz probes, per upstream (each probe "
            "reuses the upstream's kept-alive connection while it stays open; --health-check="
            "readyz only)",
            labels=["upstream"],
        )
        for addr, n in sorted(self._opened().items()):
            family.add_metric([addr], n)
        yield family
