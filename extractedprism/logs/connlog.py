"""Per-connection log lines: debug lines for each connection's open and close, and the
rate limit for failures that repeat once per client during an outage.

# design
During an outage every client connection fails the same way ("dial failed", "no
upstream available; closing client"); a line per client buries everything else (20
clients made 80 INFO lines). :class:`RateLimited` logs the first occurrence of each
kind (per key: the upstream for a dial), then counts: at most one summary line per
interval (1 s) carries the number in a ``count`` field, emitted by the next occurrence
or by :meth:`RateLimited.flush`, which the ``log-writer`` thread calls every second
(:func:`extractedprism.logs.setup.on_tick`) so the last count of an outage is not lost.
A key quiet for ``reset_after`` starts a new episode, whose first line shows again.

The open/close lines are debug: the pipe thread asks ``isEnabledFor(DEBUG)`` once per
connection, and with debug off nothing here runs (no clock read, no formatting); never
anything per byte.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from extractedprism.logs import setup as logsetup

SUMMARY_INTERVAL_S = 1.0
MAX_KEYS = 1024  # keys are upstream addresses: a few; the cap only bounds a bug


class _Episode:
    __slots__ = ("count", "fields", "last")

    def __init__(self, now: float, fields: dict[str, Any]) -> None:
        self.last = now  # when this key last produced a line
        self.count = 0  # occurrences since that line
        self.fields = fields  # the latest occurrence's fields


class RateLimited:
    """One log event that may repeat per client: the first line, then counted summaries."""

    def __init__(self, logger: logging.Logger, level: int, msg: str, *,
                 interval: float = SUMMARY_INTERVAL_S, reset_after: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._level = level
        self._msg = msg
        self._interval = interval
        self._reset_after = 10 * interval if reset_after is None else reset_after
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[Hashable, _Episode] = {}
        ref = weakref.ref(self)
        logsetup.on_tick(_Flusher(ref))

    def __call__(self, key: Hashable = None, **fields: Any) -> None:
        """One occurrence; ``fields`` become the line's fields."""
        if not self._log.isEnabledFor(self._level):
            return
        now = self._clock()
        summary = 0
        with self._lock:
            ep = self._keys.get(key)
            if ep is None or (not ep.count and now - ep.last >= self._reset_after):
                if ep is None and len(self._keys) >= MAX_KEYS:
                    self._keys.clear()
                self._keys[key] = _Episode(now, fields)
                first = True
            else:
                first = False
                ep.count += 1
                ep.fields = fields
                if now - ep.last >= self._interval:
                    summary, ep.count, ep.last = ep.count, 0, now
        if first:
            self._log.log(self._level, self._msg, extra=fields)
        elif summary:
            self._summary(summary, fields)

    def flush(self) -> None:
        """Summaries for every key whose interval passed with occurrences counted."""
        now = self._clock()
        due: list[tuple[int, dict[str, Any]]] = []
        with self._lock:
            for key, ep in list(self._keys.items()):
                if ep.count and now - ep.last >= self._interval:
                    due.append((ep.count, ep.fields))
                    ep.count, ep.last = 0, now
                elif not ep.count and now - ep.last >= self._reset_after:
                    del self._keys[key]
        for count, fields in due:
            self._summary(count, fields)

    def _summary(self, count: int, fields: dict[str, Any]) -> None:
        if count == 1:
            # One more occurrence is just that line again: "(repeated) count=1" read as a
            # summary of nothing.
            self._log.log(self._level, self._msg, extra=fields)
            return
        self._log.log(self._level, f"{self._msg} (repeated)",
                      extra={**fields, "count": count,
                             "interval": f"{self._interval:g}s"})


class _Flusher:
    """The writer thread's tick; holds the limiter weakly so it can be collected."""

    __slots__ = ("ref",)

    def __init__(self, ref: weakref.ref[RateLimited]) -> None:
        self.ref = ref

    def __call__(self) -> None:
        limiter = self.ref()
        if limiter is not None:
            limiter.flush()


def opened(logger: logging.Logger, client: str, upstream: str, dial_seconds: float) -> None:
    """The connection is piped (call only when debug is enabled)."""
    logger.debug("connection opened", extra={"client": client, "upstream": upstream,
                                             "dial_seconds": round(dial_seconds, 6)})


def closed(logger: logging.Logger, pipe: Any, started: float) -> None:
    """The connection ended: how long it lived, bytes each way, who closed it and why
    (call only when debug is enabled)."""
    logger.debug("connection closed", extra={
        "client": pipe.client, "upstream": pipe.upstream,
        "duration_seconds": round(time.monotonic() - started, 3),
        "bytes_up": pipe.bytes_up, "bytes_down": pipe.bytes_down,
        "closed_by": getattr(pipe, "ended_by", "") or "unknown",
        "reason": getattr(pipe, "end_reason", "") or "-"})
