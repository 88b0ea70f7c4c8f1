"""Dial-time histogram buckets kept as plain state (pure).

The registry keeps one :class:`DialHistogram` per upstream and updates it under its
lock when a client dial finishes; the metrics collector turns a snapshot's copy into
``extractedprism_dial_duration_seconds`` at scrape time, so the series of a removed
upstream vanish with it (house rule 8), like every other per-upstream series.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# From a loopback connect (~50 us) to the dial timeout (--health-timeout, 15 s by
# default; a dial that times out lands in the last finite bucket or +Inf).
BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                              0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class DialHistogram:
    """Per-bucket counts (not cumulative; the last slot is +Inf) and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def frozen(self) -> DialCounts:
        return DialCounts(tuple(self.counts), self.total)


@dataclass(frozen=True)
class DialCounts:
    counts: tuple[int, ...] = (0,) * (len(BUCKETS) + 1)
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus' bucket form: (upper bound, observations <= bound), +Inf last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out
