"""Exponential backoff for the EndpointSlice watcher (pure).

Owns only the delay sequence of the spec's reconnect rule: the delay starts at 1 s,
doubles up to 30 s, and each delay gets up to 25% random jitter on top
(``delay * (1 + rng.random() * 0.25)``). *When* to wait, reset or skip a wait is
decided by :mod:`extractedprism.watch`; keeping the arithmetic here lets the unit
tests check it from tables with an injected random source. Runs on whichever thread
calls it (the watcher thread); it holds no lock and is not shared between threads.
"""

from __future__ import annotations

import random

INITIAL_DELAY = 1.0
MAX_DELAY = 30.0
FACTOR = 2.0
JITTER = 0.25


class Backoff:
    """1 s -> doubling -> 30 s cap, each delay plus up to 25% jitter."""

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        initial: float = INITIAL_DELAY,
        maximum: float = MAX_DELAY,
        factor: float = FACTOR,
        jitter: float = JITTER,
    ) -> None:
        self._rng = rng if rng is not None else random.Random()
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self._base = initial
        self.attempts = 0

    @property
    def base(self) -> float:
        """The un-jittered delay that :meth:`next_delay` will use next."""
        return self._base

    def next_delay(self) -> float:
        """Return the next delay (base plus jitter) and advance the base."""
        base = self._base
        self._base = min(self._base * self.factor, self.maximum)
        self.attempts += 1
        return base * (1.0 + self._rng.random() * self.jitter)

    def reset(self) -> None:
        """Start again from the initial delay."""
        self._base = self.initial
        self.attempts = 0
