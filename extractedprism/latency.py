"""Latency tiers for ``--upstream-selection=latency`` (pure).

Owns the smoothed connect time (EWMA) of every upstream that has had a successful
health check, and the grouping of those upstreams into latency tiers. It imports no
socket or threading code and has no clock: the registry feeds it samples under its
lock, and selection reads :meth:`LatencyTiers.tiers` from the registry's snapshot. It
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

Tiers and hysteresis: the interpretation written down
-----------------------------------------------------
The spec defines ``limit(best) = max(best + 2 ms, 2 * best)``; tier 0 is every upstream
whose average is at most ``limit(best of all)``; tier 1 applies the rule to the rest,
and so on. An upstream leaves its tier only when its average exceeds the tier's limit
by a further 25%, and membership follows the group rather than the tier number.

This module keeps the *groups* between rebuilds (a list of sets, best first) and
rebuilds them after every sample and every removal:

1. **Base and limit of a group.** A group's base is the lowest current average among
   its current members, and its limit is ``limit(base)``. The limit therefore moves
   with its members: if the fastest member gets slower the limit rises with the new
   lowest member; if a member gets faster the limit tightens.
2. **Leaving (hysteresis).** A member stays in its group while
   ``avg <= 1.25 * limit(base)`` and is released when its average is above that. The
   base is the group minimum, so releasing members never changes the base and one pass
   is enough. A released upstream is "free", like an upstream with its first sample.
3. **Rebuilding in order.** Repeatedly take the lowest average among everything not yet
   placed (the bases of the remaining groups and the averages of free upstreams); ties
   go to an existing group. If it is a group's base, that group becomes the next tier;
   if it is a free upstream, it starts a new tier. With ``L = limit(that lowest avg)``:

   * every free upstream with ``avg <= L`` joins the tier (entry uses the strict
     limit, not the +25%);
   * every remaining group whose base is ``<= L`` joins the tier **as a whole**, but
     only if all of its members are within the tier's hysteresis band
     (``avg <= 1.25 * L``). Otherwise it stays a group of its own and becomes a later
     tier, so a tier appearing above never splits a group.
4. **Tier numbers** are positions in this order; they shift when a tier appears or
   disappears above, but group membership does not.

Consequences, each covered by a unit test: a new upstream much faster than everyone
forms tier 0 and the old tier 0 becomes tier 1 intact; a member whose average falls
inside a better tier's limit becomes its group's base, which tightens its group's limit
and releases far-away members, and the group then moves up whole if all that remain fit
the better tier's band (otherwise it stays one tier below, together); removing the only
tier-0 upstream turns tier 1 into tier 0 with the same
members (then re-checked against their own base as in rule 2); upstreams within 2 ms of
the best are all tier 0. Removed upstreams are forgotten and the tiers are rebuilt
without them; the registry calls :meth:`LatencyTiers.remove` once their drain completes,
so unhealthy and draining upstreams keep their tier until then.
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

    __slots__ = ("_alpha", "_avg", "_groups", "_tier")

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._avg: dict[str, float] = {}
        self._groups: list[set[str]] = []  # best first; index = tier
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

    def tiers(self) -> dict[str, int]:
        return dict(self._tier)

    def groups(self) -> list[frozenset[str]]:
        """The tiers as sets, tier 0 first (for tests and debugging)."""
        return [frozenset(g) for g in self._groups]

    def __contains__(self, key: object) -> bool:
        return key in self._avg

    def __len__(self) -> int:
        return len(self._avg)

    # --- the rebuild (see the module docstring, rules 1-4) ------------------

    def _rebuild(self) -> None:
        avg = self._avg
        groups: list[tuple[float, set[str]]] = []
        placed: set[str] = set()
        for old in self._groups:
            members = {k for k in old if k in avg}
            if not members:
                continue
            base = min(avg[k] for k in members)
            band = HYSTERESIS * tier_limit(base)
            members = {k for k in members if avg[k] <= band}  # rule 2
            groups.append((base, members))
            placed |= members
        # Stable sort keeps the previous order between groups with equal bases.
        groups.sort(key=_base_of)
        free = sorted((k for k in avg if k not in placed), key=lambda k: (avg[k], k))

        new_groups: list[set[str]] = []
        gi = 0  # next unconsumed entry of `groups` (entries set to None when merged)
        pending: list[tuple[float, set[str]] | None] = list(groups)
        while gi < len(pending) or free:
            while gi < len(pending) and pending[gi] is None:
                gi += 1
            head = pending[gi] if gi < len(pending) else None
            if head is None and not free:
                break
            if head is not None and (not free or head[0] <= avg[free[0]]):
                base, tier = head[0], set(head[1])
                pending[gi] = None
                gi += 1
            else:
                first = free.pop(0)
                base, tier = avg[first], {first}
            limit = tier_limit(base)
            band = HYSTERESIS * limit
            while free and avg[free[0]] <= limit:
                tier.add(free.pop(0))
            for j in range(gi, len(pending)):
                cand = pending[j]
                if cand is None:
                    continue
                if cand[0] > limit:
                    break  # sorted by base: no later group can enter either
                if all(avg[k] <= band for k in cand[1]):
                    tier |= cand[1]
                    pending[j] = None
            new_groups.append(tier)

        self._groups = new_groups
        self._tier = {k: i for i, g in enumerate(new_groups) for k in g}


def _base_of(group: tuple[float, set[str]]) -> float:
    return group[0]
