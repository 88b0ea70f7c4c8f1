"""Latency tiers for ``--upstream-selection=latency`` (pure).

Owns the smoothed connect time (EWMA) of every upstream that has had a successful
health check, and the grouping of those upstreams into latency tiers. It imports no
socket or threading code and has no clock: the registry feeds it samples under its
lock, and reads :meth:`LatencyTiers.tier` for each pick and snapshot under it. It
is therefore not thread-safe on its own.

Smoothing (spec, "Latency-aware selection")
-------------------------------------------
* The first sample of an upstream is its average.
* ``ALPHA = 0.3``: ``avg += ALPHA * (sample - avg)``. With the 4x cap below, a lasting
  increase grows the average by up to 1.9x per check (``1 + 3 * ALPHA``), so a jump from
  1 ms to 100 ms shows within about seven checks, while one retransmitted SYN (1 s on a
  1 ms path) only moves the average to 1.9 ms and decays by 30% per normal check.
* Each sample is capped at ``max(4 * avg, 2 ms)`` before smoothing.
* A sample below ``avg / 4`` replaces the average outright (the replacement test uses
  the raw sample; the cap only ever lowers large samples, so the two never interact).
* Failed checks never call :meth:`LatencyTiers.observe`.

Tiers and hysteresis, as the spec words them
--------------------------------------------
``limit(best) = max(best + 2 ms, 2 * best)``. Each rebuild (after every sample and
every removal) takes the upstreams not yet placed, lowest average first:

1. **The literal rule.** The next tier holds every remaining upstream whose average is
   at most ``limit(best)``, ``best`` being the lowest remaining average. Tier 0 is
   therefore exactly what the spec says, whatever the history: a new upstream much
   faster than the rest takes with it every upstream within its limit.
2. **Hysteresis.** An upstream that was in the same group as the tier also stays
   while its average is at most ``1.25 * limit(best)``; above that it leaves, and a
   non-member between the two limits stays out. A first sample is judged by the
   strict limit.
3. **Membership follows the group.** A tier continues the group of its fastest
   member that had one (the first such group not claimed by a tier above). So when
   a tier appears or disappears above, the members of a group are judged against
   their own group's tier and are not split by the renumbering, while two groups
   merging into one tier do not pull in each other's hysteresis members.
4. **Tier numbers** are positions in this order; they shift when a tier appears or
   disappears above, but group membership does not.

The replace-below-a-quarter rule and rule 1 together let two upstreams whose first
samples were far apart share a tier as soon as their averages are within the limit.
Removed upstreams are forgotten and the tiers are rebuilt without them; the registry
calls :meth:`LatencyTiers.remove` once their drain completes, so unhealthy and
draining upstreams keep their tier until then.
"""

from __future__ import annotations

import math

ALPHA = 0.3
CAP_FACTOR = 4.0
CAP_FLOOR = 0.002  # seconds: a sample is never capped below 2 ms
REPLACE_FACTOR = 0.25  # a sample below avg * 0.25 replaces the average
TIER_SLACK = 0.002  # seconds: tier limit is at least best + 2 ms ...
TIER_FACTOR = 2.0  # ... and at least 2 x best
HYSTERESIS = 1.25  # a member leaves when its avg exceeds the limit by a further 25%


def tier_limit(base: float) -> float:
    """Highest average that enters a tier whose best average is ``base``."""
    return max(base + TIER_SLACK, TIER_FACTOR * base)


def smooth(avg: float | None, sample: float, alpha: float = ALPHA) -> float:
    """One EWMA step with the spec's cap and replace-below-a-quarter rules."""
    if not sample >= 0.0:  # negative or NaN: a clock oddity, treat as instantaneous
        sample = 0.0
    if avg is None:
        # The first sample is taken as is; an infinite one cannot be averaged.
        return sample if math.isfinite(sample) else CAP_FLOOR
    if sample < avg * REPLACE_FACTOR:
        return sample
    capped = min(sample, max(CAP_FACTOR * avg, CAP_FLOOR))
    return avg + alpha * (capped - avg)


class LatencyTiers:
    """EWMA per upstream + tier groups with 25% hysteresis. Not thread-safe (the registry's
    lock guards it)."""

    __slots__ = ("_alpha", "_avg", "_group", "_next_group", "_tier")

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._avg: dict[str, float] = {}
        self._group: dict[str, int] = {}  # key -> id of the group (tier) it was placed in
        self._next_group = 0
        self._tier: dict[str, int] = {}

    # --- inputs -------------------------------------------------------------

    def observe(self, key: str, rtt: float) -> None:
        """Feed one successful health-check connect time in seconds."""
        self._avg[key] = smooth(self._avg.get(key), rtt, self._alpha)
        self._rebuild()

    def remove(self, key: str) -> None:
        """Forget an upstream (its drain completed); the tiers are rebuilt without it."""
        if self._avg.pop(key, None) is not None:
            self._rebuild()

    # --- outputs ------------------------------------------------------------

    def average(self, key: str) -> float | None:
        return self._avg.get(key)

    def tier(self, key: str) -> int | None:
        return self._tier.get(key)

    @property
    def tier_map(self) -> dict[str, int]:
        """The tiers, read-only: a new dict after every change that may move one (a
        cache of picks keys on it)."""
        return self._tier

    # --- the rebuild (see the module docstring, rules 1-4) ------------------

    def _rebuild(self) -> None:
        avg, old = self._avg, self._group
        remaining = sorted(avg, key=lambda k: (avg[k], k))
        group: dict[str, int] = {}
        tier: dict[str, int] = {}
        claimed: set[int] = set()
        n = 0
        while remaining:
            limit = tier_limit(avg[remaining[0]])
            strict = [k for k in remaining if avg[k] <= limit]  # rule 1
            gid = next((old[k] for k in strict if k in old and old[k] not in claimed), None)
            if gid is None:
                gid = self._next_group
                self._next_group += 1
            claimed.add(gid)
            band = HYSTERESIS * limit
            members = set(strict)
            members.update(k for k in remaining  # rule 2, for this group only (rule 3)
                           if old.get(k) == gid and avg[k] <= band)
            for k in members:
                group[k], tier[k] = gid, n
            remaining = [k for k in remaining if k not in members]
            n += 1
        self._group, self._tier = group, tier
