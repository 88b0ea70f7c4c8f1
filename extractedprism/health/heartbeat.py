"""Liveness: the ``heartbeat`` thread behind /healthz.

Every --liveness-interval it confirms what a restart of the process would fix: the
registry lock can be taken, and the acceptor and the ticker make progress, checked by
their loop counter and clock, not only ``is_alive()``. /healthz fails when the last
confirmation is older than --liveness-threshold. Discovery is not part of it: provider
failures are isolated (the watcher restarts itself) and the static endpoints keep
serving, so a kubelet restart would only cut every connection of the node.

It asks narrow questions of what app.py hands it (a lock probe, the acceptor's and the
ticker's progress), and knows nothing of the App.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class AcceptorProgress(Protocol):
    """What the heartbeat asks of the acceptor (the proxy)."""

    @property
    def handed_over(self) -> bool:
        """A successor accepts on the listener now (this acceptor is not needed)."""
        ...

    def acceptor_alive(self) -> bool: ...

    def backlog_waiting(self) -> bool:
        """A client waits in the listen backlog."""
        ...


class LoopProgress(Protocol):
    """What the heartbeat asks of the ticker: is its thread there, and when did its loop
    last turn (monotonic)."""

    last_loop: float

    def alive(self) -> bool: ...


class Acquirable(Protocol):
    """A lock, as far as the heartbeat uses one."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


def lock_free(lock: Acquirable, timeout: float) -> bool:
    """Whether ``lock`` can be taken within ``timeout``; given back at once."""
    if not lock.acquire(timeout=timeout):
        return False
    lock.release()
    return True


class Heartbeat:
    """``lock_free(timeout)``: whether the registry lock can be taken within
    ``timeout``; ``acceptor`` and ``ticker``: the threads whose progress is checked."""

    def __init__(self, *, lock_free: Callable[[float], bool], acceptor: AcceptorProgress,
                 ticker: LoopProgress, interval: float, threshold: float,
                 stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock_free = lock_free
        self._acceptor = acceptor
        self._ticker = ticker
        self._interval = interval
        self._threshold = threshold
        self._stop = stop
        self._clock = clock
        self.last_beat = clock()
        self.last_problem = ""
        self._thread: threading.Thread | None = None
        # The acceptor's progress: its loop counter (one writer, the acceptor thread;
        # read here: a plain int is enough), and what the last check saw of it.
        self._accept_loops = 0
        self._accept_seen = 0
        self._accept_suspect: int | None = None

    def start(self) -> None:
        self._thread = threading.Thread(name="heartbeat", target=self._loop, daemon=True)
        self._thread.start()

    def accept_turned(self) -> None:
        """The acceptor's loop turned (Proxy's on_accept_loop hook, acceptor thread)."""
        self._accept_loops += 1

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.check()

    def check(self) -> bool:
        problem = self.problem()
        if problem:
            if problem != self.last_problem:
                log.error("liveness check failed reason=%r", problem)
            self.last_problem = problem
            return False
        if self.last_problem:
            log.info("liveness check passes again")
            self.last_problem = ""
        self.last_beat = self._clock()
        return True

    def problem(self) -> str:
        """Empty when alive, else what is wrong."""
        if not self._lock_free(self._interval):
            return "registry lock not acquired"
        if not self._acceptor.handed_over:  # a successor accepts on our listener now
            if not self._acceptor.acceptor_alive():
                return "acceptor thread exited"
            if self._acceptor_stuck():
                return "acceptor not accepting: a client waits in the backlog"
        if not self._ticker.alive():
            return "ticker thread exited"
        age = time.monotonic() - self._ticker.last_loop
        if age > self._threshold:
            return f"ticker loop stalled for {age:.1f}s"
        return ""

    def _acceptor_stuck(self) -> bool:
        # Idle, the acceptor blocks in accept() and its counter stands still; stuck, it
        # also leaves clients in the backlog. Only a client that has waited since the
        # previous check without the loop turning means stuck: one check alone could
        # race a client arriving just now.
        loops, seen = self._accept_loops, self._accept_seen
        self._accept_seen = loops
        if not (self._acceptor.backlog_waiting() and loops == seen):
            self._accept_suspect = None
            return False
        if self._accept_suspect == loops:
            return True
        self._accept_suspect = loops
        return False

    def alive(self) -> bool:
        return (self._clock() - self.last_beat <= self._threshold
                and self._thread is not None and self._thread.is_alive())

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
