"""Sampler: the ``conn-sampler`` thread, which reads every live connection's byte
counters and runs the rebalance rounds.

One thread for the two features that read the relays' counters: rebalancing
(``--rebalance-interval``: quiet time, and the rounds of
:class:`~extractedprism.upstreams.rebalancer.Rebalancer`) and the stall check
(``--stall-timeout``: :mod:`extractedprism.upstreams.activity`). It exists only when one
of them is on, so with both off no counter is read and no thread wakes. Why not the
ticker: it would wake the ticker several times a second, and the ticker's turns are what
the heartbeat (/healthz) watches.

Each turn is one :meth:`Stalls.sample_activity` (one lock round trip that reads two
integers per connection; stall-triggered checks are asked of the ticker after the lock
is released) or, when one is due, a rebalance round (which samples first). The period is
the shorter of rebalancing's (:func:`~extractedprism.upstreams.rebalancer.sample_period`)
and the stall check's (:func:`stall_sample_period`): a stall is found at most one period
after the stall timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from extractedprism.threads import join_until, start_daemon
from extractedprism.upstreams.rebalancer import MIN_SAMPLE_S, Rebalancer
from extractedprism.upstreams.registry import Registry

log = logging.getLogger(__name__)

STALL_SAMPLES = 8  # samples per --stall-timeout: a stall is found at most T/8 late


def stall_sample_period(stall_timeout: float) -> float:
    """How often the stall check samples: a stall is found within the stall timeout
    plus this (--stall-timeout 2s: 250 ms)."""
    return max(MIN_SAMPLE_S, stall_timeout / STALL_SAMPLES)


class Sampler:
    def __init__(self, registry: Registry, *, stall_timeout: float,
                 rebalancer: Rebalancer | None, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        periods = [stall_sample_period(stall_timeout)] if stall_timeout > 0 else []
        if rebalancer is not None:
            periods.append(rebalancer.sample)
        assert periods, "a sampler with nothing to sample"
        self._registry = registry
        self._rebalancer = rebalancer
        self.period = min(periods)
        self._stop = stop
        self._clock = clock
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_daemon("conn-sampler", self._loop)

    def join(self, timeout: float) -> bool:
        self._wake.set()
        return join_until([self._thread], time.monotonic() + timeout)

    def _loop(self) -> None:
        rb = self._rebalancer
        while not self._stop.is_set():
            if rb is not None and self._clock() >= rb.next:
                try:
                    rb.run_round()
                except Exception:  # a round must never end the thread
                    log.exception("rebalance round failed")
                    rb.skip_round()
            else:
                try:
                    self._registry.stalls.sample_activity()
                except Exception:  # nor a sample
                    log.exception("connection sample failed")
            wait = self.period
            if rb is not None:
                wait = min(wait, max(0.0, rb.next - self._clock()))
            self._wake.wait(wait)
        log.debug("conn-sampler stopped")
