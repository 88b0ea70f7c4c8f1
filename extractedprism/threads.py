"""Joining threads against one shutdown deadline: the rule every stopping part shares.

Each part of the shutdown (ticker and its probes, the health server's threads, the
watcher) waits for its threads until the one deadline the App computed; a thread still
running then is logged once by name and abandoned. They are daemons, and one blocked in
getaddrinfo or on a socket can outlive any timeout of ours, so it is never waited for
twice. Runs on the thread that shuts down (the main thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


def join_until(threads: Iterable[threading.Thread | None], deadline: float) -> bool:
    """Join each thread until ``deadline`` (``time.monotonic()``); True when all ended."""
    stuck: list[threading.Thread] = []
    for t in threads:
        if t is None:
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            stuck.append(t)
    for t in stuck:
        log.warning("thread outlived its shutdown deadline; abandoned thread=%s", t.name)
    return not stuck


def start_daemon(name: str, target: Callable[..., object], *args: object) -> threading.Thread:
    """Start a daemon thread named for what it does, running a named method (house rule:
    ``py-spy dump`` and ``%(threadName)s`` read like a map)."""
    t = threading.Thread(name=name, target=target, args=args, daemon=True)
    t.start()
    return t
