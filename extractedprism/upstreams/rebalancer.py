"""Rebalancer: a rebalance round every ``--rebalance-interval`` (±10% jitter).

The rounds run on the ``conn-sampler`` thread (:mod:`extractedprism.upstreams.sampler`),
which samples connection activity in between: a round needs activity samples more often
than rounds (quiet time is only as fine as the sampling: every fifth of
``min(--rebalance-quiet, --rebalance-interval)``, :func:`sample_period`). This object
keeps the rounds' schedule and touches the registry only through
:meth:`Rounds.rebalance` (which closes the chosen connection after releasing the
lock). The jitter keeps the proxies of many nodes, started together by a DaemonSet, from
closing connections in the same instant.

An operator's ``extractedprism admin rebalance`` runs a round through :meth:`run_round`
from the admin socket's thread; rounds never overlap, and the next timed round comes
one (jittered) interval after the latest one, so at most one close per interval
happens on the timer.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.snapshot import RebalanceView

JITTER = 0.10  # each interval is drawn from [0.9, 1.1] x --rebalance-interval
MIN_SAMPLE_S = 0.05


def sample_period(interval: float, quiet: float) -> float:
    """How often connection activity is sampled for rebalancing: quiet time errs short
    by at most this."""
    return max(MIN_SAMPLE_S, min(interval, quiet if quiet > 0 else interval) / 5)


class Rebalancer:
    def __init__(self, registry: Registry, *, interval: float, quiet: float,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._interval = interval
        self.sample = sample_period(interval, quiet)
        self._rng = rng or random.Random()
        self._clock = clock
        self._round_lock = threading.Lock()  # an admin round and a timed one never overlap
        self.next = clock() + self._jittered()  # when the next timed round is due

    def _jittered(self) -> float:
        return self._interval * self._rng.uniform(1 - JITTER, 1 + JITTER)

    def run_round(self, trigger: str = "interval") -> RebalanceView:
        """One round now; the next timed one comes a full (jittered) interval later."""
        with self._round_lock:
            view = self._registry.rounds.rebalance(trigger)
            self.next = self._clock() + self._jittered()
        return view

    def skip_round(self) -> None:
        """A round failed: try again one (jittered) interval later."""
        self.next = self._clock() + self._jittered()
