"""Rebalancer: the ``rebalancer`` thread that runs a rebalance round every
``--rebalance-interval`` (±10% jitter) and samples connection activity in between.

Why its own thread rather than the ticker: a round needs activity samples more often
than rounds (quiet time is only as fine as the sampling: every fifth of
``min(--rebalance-quiet, --rebalance-interval)``), which would make the ticker wake
several times a second for a feature that is off by default, and the ticker's turns
are what the heartbeat (/healthz) watches. A separate thread exists only when
rebalancing is on, wakes on its own schedule, and touches the registry only through
:meth:`Registry.sample_activity` and :meth:`Registry.rebalance` (which close the chosen
connection after releasing the lock). The jitter keeps the proxies of many nodes,
started together by a DaemonSet, from closing connections in the same instant.

An operator's ``extractedprism admin rebalance`` runs a round through :meth:`run_round`
from the admin socket's thread; rounds never overlap, and the next timed round comes
one (jittered) interval after the latest one, so at most one close per interval
happens on the timer.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from extractedprism.threads import join_until, start_daemon
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.snapshot import RebalanceView

log = logging.getLogger(__name__)

JITTER = 0.10  # each interval is drawn from [0.9, 1.1] x --rebalance-interval
MIN_SAMPLE_S = 0.05


def sample_period(interval: float, quiet: float) -> float:
    """How often connection activity is sampled: quiet time errs short by at most this."""
    return max(MIN_SAMPLE_S, min(interval, quiet if quiet > 0 else interval) / 5)


class Rebalancer:
    def __init__(self, registry: Registry, *, interval: float, quiet: float,
                 stop: threading.Event, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._interval = interval
        self._sample = sample_period(interval, quiet)
        self._stop = stop
        self._rng = rng or random.Random()
        self._clock = clock
        self._round_lock = threading.Lock()  # an admin round and a timed one never overlap
        self._wake = threading.Event()
        self._next = clock() + self._jittered()
        self._thread: threading.Thread | None = None

    def _jittered(self) -> float:
        return self._interval * self._rng.uniform(1 - JITTER, 1 + JITTER)

    def start(self) -> None:
        self._thread = start_daemon("rebalancer", self._loop)

    def join(self, timeout: float) -> bool:
        self._wake.set()
        return join_until([self._thread], time.monotonic() + timeout)

    def run_round(self, trigger: str = "interval") -> RebalanceView:
        """One round now; the next timed one comes a full (jittered) interval later."""
        with self._round_lock:
            view = self._registry.rebalance(trigger)
            self._next = self._clock() + self._jittered()
        return view

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = self._clock()
            if now >= self._next:
                try:
                    self.run_round()
                except Exception:  # a round must never end the thread
                    log.exception("rebalance round failed")
                    self._next = self._clock() + self._jittered()
            else:
                self._registry.sample_activity()
            wait = min(self._sample, max(0.0, self._next - self._clock()))
            self._wake.wait(wait)
        log.debug("rebalancer stopped")
