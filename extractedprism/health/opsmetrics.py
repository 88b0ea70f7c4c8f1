"""The metrics operators look for beside the spec's: process, platform, build, discovery.

* ``process_*`` (resident memory, open fds, start time, CPU, ...), ``python_info`` and
  ``python_gc_*``: the client library's standard collectors, registered on the App's
  private registry (the library's global one is never used, so tests and embedded
  Apps stay apart);
* ``extractedprism_build_info{version,python,relay} 1``;
* ``extractedprism_discovery_connected{provider}`` (1 while a watch is open) and
  ``extractedprism_discovery_last_event_timestamp_seconds{provider}`` (after the first
  successful list or watch event), read from
  :class:`~extractedprism.discovery.status.DiscoveryStatus`
  at scrape time.

The per-upstream series of issue 15 (dial durations, bytes) come from registry
snapshots, in :mod:`extractedprism.health.metrics`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extractedprism import __version__
from extractedprism.discovery.status import DiscoveryView
from extractedprism.health.metrics import PREFIX


def register_runtime_collectors(registry: CollectorRegistry) -> None:
    """process_*, python_info and python_gc_* on ``registry``."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class BuildInfoCollector(Collector):
    """``extractedprism_build_info``; ``relay`` is asked at scrape time (the data path
    in use, "native" or "python")."""

    def __init__(self, relay: Callable[[], str]) -> None:
        self._relay = relay

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(PREFIX + "build_info",
                              "Always 1; the labels say which build runs and its data path",
                              labels=["version", "python", "relay"])
        g.add_metric([__version__, platform.python_version(), self._relay()], 1)
        yield g


class DiscoveryCollector(Collector):
    """The discovery gauges from the watcher's status (absent when discovery is off)."""

    def __init__(self, view: Callable[[], DiscoveryView | None]) -> None:
        self._view = view

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        v = self._view()
        connected = GaugeMetricFamily(
            PREFIX + "discovery_connected",
            "1 while an EndpointSlice watch is open, 0 otherwise", labels=["provider"])
        last = GaugeMetricFamily(
            PREFIX + "discovery_last_event_timestamp_seconds",
            "Unix time of the last successful EndpointSlice list or watch event",
            labels=["provider"])
        if v is not None:
            connected.add_metric([v.provider], 1 if v.connected else 0)
            if v.last_event is not None:
                last.add_metric([v.provider], v.last_event)
        yield connected
        yield last
