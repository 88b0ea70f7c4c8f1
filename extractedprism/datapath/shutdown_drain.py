"""The shutdown drain (``--shutdown-drain-timeout``): closing live connections spread
evenly over a window instead of all at once, so the node's clients (and their watches)
reconnect a few at a time, to a successor that took the listener over or to the next
instance. Runs on the main thread during shutdown; closes happen outside every lock
(``Tracked.close`` only shuts sockets down; the pipe thread does the rest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


def close_offsets(n: int, window: float) -> list[float]:
    """When each of ``n`` connections closes, in seconds after the start: connection
    *i* at the middle of its 1/n-th of the window, so they are evenly spaced, none at
    the very start or end, and no tenth of the window holds more than a quarter of them
    (for n >= 4)."""
    return [window * (i + 0.5) / n for i in range(n)]


def spread_close(conns: Sequence[Closable], window: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """Close ``conns`` (oldest first) on :func:`close_offsets`; returns how many."""
    start = clock()
    closed = 0
    for conn, offset in zip(conns, close_offsets(len(conns), window), strict=True):
        delay = start + offset - clock()
        if delay > 0:
            sleep(delay)
        try:
            conn.close()  # a no-op for one that ended meanwhile
        except Exception:  # one bad close must not stop the drain
            log.exception("shutdown drain: closing a connection failed")
        closed += 1
    return closed
