"""Rebalancing and slow start (pure): the weight ramp, the fair share by weight, who to
close, and the weighted pick.

Long-lived clients (kubelets, controllers: HTTP/2 with watches) stay where an L4 balancer
put them; after a rolling restart the API server restarted last ends with almost none
(apiserver-lb-notes §1, §4.5). Two opt-in answers, both decided here as functions of
their inputs (no lock, clock, socket or logger; the registry calls them under its lock
with its clock, and tests drive them from tables):

* **Slow start** (``--slow-start``): an upstream that becomes pickable again takes a
  weight that grows linearly from :data:`MIN_WEIGHT` to 1 over the window
  (:func:`ramp_weight`, HAProxy's ``slowstart``). Random picks by weight, least-conn
  compares connections / weight (:func:`pick_weighted`).
* **Rebalancing** (``--rebalance-interval``): each round compares each pickable
  upstream's live connections with its fair share by weight (:func:`fair_shares`); when
  the most loaded one (relative to its share) holds more than :data:`OVER_SHARE` times
  its share and at least :data:`MIN_GAP` connections more than the least loaded
  (:func:`judge`), one of its connections is closed: the one quiet longest, at least
  ``--rebalance-quiet`` quiet and at least one interval old (:func:`choose_quiet`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_WEIGHT = 0.1  # where a ramp starts (HAProxy's slowstart never starts at 0 either)
OVER_SHARE = 1.25  # the most loaded must hold more than this times its fair share ...
MIN_GAP = 2  # ... and at least this many connections more than the least loaded

# Why a round did not act (also shown in /upstreams, so kept short and stable).
ACTED = "acted"
NO_SKEW = "no skew"
NOTHING_QUIET = "nothing quiet"
TOO_FEW = "fewer than two pickable upstreams"
PANIC = "panic mode"
DRAINING = "an upstream is draining"
CLOSING_UNREADY = "an upstream is closing for readiness"
ADMIN_CLOSE = "an upstream is being closed by an operator"


def ramp_weight(elapsed: float, window: float) -> float:
    """Slow start's weight ``elapsed`` seconds into a ramp of ``window`` seconds: linear
    from MIN_WEIGHT to 1; 1 when the window is 0 (off) or over."""
    if window <= 0 or elapsed >= window:
        return 1.0
    if elapsed <= 0:
        return MIN_WEIGHT
    return MIN_WEIGHT + (1.0 - MIN_WEIGHT) * elapsed / window


@dataclass(frozen=True, slots=True)
class Load:
    """One pickable upstream as a round sees it."""

    address: str
    connections: int
    weight: float = 1.0


def fair_shares(loads: Sequence[Load]) -> dict[str, float]:
    """Each upstream's fair share of all their live connections, by weight (a count, not
    a fraction)."""
    total = sum(x.connections for x in loads)
    weights = sum(x.weight for x in loads)
    if weights <= 0:
        return {x.address: 0.0 for x in loads}
    return {x.address: total * x.weight / weights for x in loads}


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` found: ``over`` is the upstream to close one connection of (None:
    no close, ``reason`` says why)."""

    reason: str
    over: str | None = None
    least: str | None = None
    shares: dict[str, float] | None = None


def _relative(x: Load, shares: dict[str, float]) -> float:
    share = shares[x.address]
    return x.connections / share if share > 0 else float("inf") if x.connections else 0.0


def judge(loads: Sequence[Load], *, over_share: float = OVER_SHARE,
          min_gap: int = MIN_GAP) -> Verdict:
    """Is one upstream over its share enough to move a connection off it?

    Load is connections relative to the fair share; the least loaded is the lowest
    (where a reconnect should land). The upstream relieved is the most loaded one that
    holds more than ``over_share`` times its share and at least ``min_gap`` connections
    more than the least loaded. With equal weights that is the most loaded one or none
    (a lower one meets both bounds less); with weights, a ramping upstream one
    connection over its small share does not hide a full one far over its own. Ties go
    to the connections, then the address, so a round's choice is reproducible."""
    if len(loads) < 2:
        return Verdict(TOO_FEW)
    shares = fair_shares(loads)
    ordered = sorted(loads, key=lambda x: (_relative(x, shares), x.connections, x.address))
    least = ordered[0]
    for most in reversed(ordered[1:]):
        if (most.connections > over_share * shares[most.address]
                and most.connections - least.connections >= min_gap):
            return Verdict(ACTED, over=most.address, least=least.address, shares=shares)
    return Verdict(NO_SKEW, shares=shares)


@dataclass(frozen=True, slots=True)
class Quiet:
    """One live connection of the upstream to relieve: its key, age and quiet time
    (seconds without a byte either way, as last sampled)."""

    key: int
    age: float
    quiet: float


def choose_quiet(conns: Iterable[Quiet], *, quiet: float, min_age: float) -> Quiet | None:
    """The connection to close: quiet at least ``quiet`` seconds and at least ``min_age``
    old, the longest quiet first (then the oldest); None when none qualifies."""
    best: Quiet | None = None
    for c in conns:
        if c.quiet >= quiet and c.age >= min_age and (
                best is None or (c.quiet, c.age) > (best.quiet, best.age)):
            best = c
    return best


def pick_weighted(addresses: Sequence[str], weights: Sequence[float], *, rng: random.Random,
                  active: Sequence[int] | None = None) -> str | None:
    """Slow start's pick among ``addresses`` (eligible, in order): with ``active``
    (least-conn), the fewest connections per unit of weight, ties uniformly; without,
    at random in proportion to the weights."""
    if len(addresses) <= 1:
        return addresses[0] if addresses else None
    if active is not None:
        scores = [n / w for n, w in zip(active, weights, strict=True)]
        low = min(scores)
        best = [a for a, s in zip(addresses, scores, strict=True) if s == low]
        return best[0] if len(best) == 1 else best[rng.randrange(len(best))]
    point = rng.random() * sum(weights)
    for a, w in zip(addresses, weights, strict=True):
        point -= w
        if point < 0:
            return a
    return addresses[-1]  # rounding at the top end
