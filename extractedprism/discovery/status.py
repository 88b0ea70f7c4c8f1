"""What the EndpointSlice watcher last saw, for /upstreams and the discovery gauges.

The ``watcher`` thread writes it (:meth:`DiscoveryStatus.watch_opened`, ...); health
server threads and the metrics collector read :meth:`DiscoveryStatus.view`. It is
status only: nothing decides anything from it, so it has its own small lock instead
of the registry's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DiscoveryView:
    provider: str
    connected: bool  # a watch is open
    last_event: float | None  # wall time of the last successful list or watch event
    last_error: str


class DiscoveryStatus:
    def __init__(self, provider: str = "kubernetes",
                 clock: Callable[[], float] = time.time) -> None:
        self.provider = provider
        self._clock = clock
        self._lock = threading.Lock()
        self._connected = False
        self._last_event: float | None = None
        self._last_error = ""

    def watch_opened(self) -> None:
        with self._lock:
            self._connected = True

    def watch_closed(self) -> None:
        with self._lock:
            self._connected = False

    def event(self) -> None:
        """A list succeeded or a watch event arrived."""
        with self._lock:
            self._last_event = self._clock()

    def error(self, message: str) -> None:
        with self._lock:
            self._last_error = message

    def view(self) -> DiscoveryView:
        with self._lock:
            return DiscoveryView(self.provider, self._connected, self._last_event,
                                 self._last_error)
