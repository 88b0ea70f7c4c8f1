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

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from extractedprism.snapshot import Snapshot

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

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of a sample (tests and the demo status line)."""
        return self.registry.get_sample_value(name, labels or {})


class StateCollector(Collector):
    """Yields the gauge families computed from one registry snapshot."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        # Without describe(), registering would call collect() once, at start-up, before
        # the registry has upstreams; an empty list is the documented way to skip that.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        g = GaugeMetricFamily
        yield CounterMetricFamily(
            PREFIX + "connections_total",
            "Connections established to upstreams since start",
            value=snap.connections_total,
        )
        errors = CounterMetricFamily(
            PREFIX + "connection_errors_total",
            "Failed connection attempts to an upstream (not counted when no upstream was "
            "available or when the proxy is shutting down)",
            labels=["upstream"],
        )
        sent = CounterMetricFamily(
            PREFIX + "upstream_bytes_total",
            "Bytes proxied per upstream and direction (up: client to upstream)",
            labels=["upstream", "direction"],
        )
        for u in snap.upstreams:
            errors.add_metric([u.address], u.connection_errors)
            sent.add_metric([u.address, "up"], u.bytes_up)
            sent.add_metric([u.address, "down"], u.bytes_down)
        yield errors
        yield sent
        yield g(
            PREFIX + "upstreams_active",
            "Upstreams eligible for new connections (healthy, not draining)",
            value=sum(1 for u in snap.upstreams if u.pickable),
        )
        yield g(
            PREFIX + "upstreams_total",
            "Total known upstreams, including unhealthy and draining",
            value=len(snap.upstreams),
        )
        yield g(
            PREFIX + "connections_active",
            "TCP connections currently passing through the proxy",
            value=snap.connections_active,
        )
        yield g(
            PREFIX + "connections_max",
            "Maximum concurrent connections (--max-connections)",
            value=snap.max_connections,
        )
        yield g(
            PREFIX + "panic",
            "1 while no upstream is pickable and new connections try every known upstream",
            value=1 if snap.panic else 0,
        )
        status = g(
            PREFIX + "health_check_status",
            "Upstream health state after the consecutive-failure threshold, fed by health "
            "checks and client dials (1 healthy, 0 unhealthy)",
            labels=["upstream"],
        )
        conns = g(
            PREFIX + "upstream_connections_active",
            "Live proxied connections per upstream",
            labels=["upstream"],
        )
        rtt = g(
            PREFIX + "upstream_rtt_seconds",
            "Smoothed health check connect time (latency selection only)",
            labels=["upstream"],
        )
        tier = g(
            PREFIX + "upstream_latency_tier",
            "Latency tier of the upstream, 0 being the closest group (latency selection only)",
            labels=["upstream"],
        )
        ready = g(
            PREFIX + "upstream_ready",
            "/readyz probe state after the consecutive-failure threshold (1 ready, 0 not ready)",
            labels=["upstream"],
        )
        for u in snap.upstreams:
            status.add_metric([u.address], 1 if u.healthy else 0)
            conns.add_metric([u.address], u.active_connections)
            if snap.latency_mode and u.rtt_seconds is not None:
                rtt.add_metric([u.address], u.rtt_seconds)
            if snap.latency_mode and u.tier is not None:
                tier.add_metric([u.address], u.tier)
            if snap.readyz_mode and u.probed_ready:
                ready.add_metric([u.address], 1 if u.ready else 0)
        yield from (status, conns, rtt, tier, ready)
