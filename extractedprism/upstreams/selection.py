"""Upstream selection for new connections (pure).

Owns the rule that turns a list of upstream facts into one pick: pickable (healthy, not
draining, not excluded) -> readiness filter (``--health-check=readyz``: ready ones while
any is ready, else every pickable one) -> mode:

* ``random``: uniform among them.
* ``latency``: uniform among those of the lowest latency tier that has one, together
  with those that have no sample yet (``tier is None``), so a new upstream gets an equal
  share of that tier's picks until the failure threshold excludes it.
* ``least-conn``: the fewest live connections, ties broken uniformly. Prefer it when
  clients hold long-lived connections (kubelet HTTP/2 with watches): random spreads new
  connections evenly but not the connections that stay, least-conn evens out the load
  that is actually there.

The registry keeps :func:`eligible`'s list from one state change to the next and calls
:func:`pick` under its lock for every new connection (:func:`choose` is the two in one);
neither does I/O, and both take what they need as arguments.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from extractedprism.config.table import SELECTION_MODES
from extractedprism.upstreams.state import pickable


# Not frozen: a frozen dataclass's __init__ goes through object.__setattr__ per field,
# and the registry builds one Candidate per upstream for every new connection.
@dataclass(slots=True)
class Candidate:
    address: str
    healthy: bool  # TCP health after the consecutive-failure threshold
    draining: bool
    ready: bool  # readyz says ready (False when pending or unready); ignored unless readyz
    tier: int | None  # latency tier, None = no sample yet
    active: int  # live connections
    fallback: bool = False  # --static-endpoints=fallback demoted it: panic mode only
    admin_drained: bool = False  # an operator's drain or close: no new connections
    # Only the hedge's last resort (:func:`hedge_last_resort`) reads these two.
    stalled: bool = False  # a dial stalled past --dial-hedge-delay, no success since
    last_success: float = 0.0  # its latest successful check or dial (registry clock)


def eligible(candidates: Sequence[Candidate], *, mode: str, readyz: bool,
             exclude: Collection[str] = ()) -> list[Candidate]:
    """Every rule of the pick but least-conn's, which depends on live counts: what a
    pick may return, in the candidates' order. The registry keeps this list between
    state changes instead of building it for every connection."""
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown selection mode {mode!r}")
    pool = [c for c in candidates
            if pickable(c) and (not exclude or c.address not in exclude)]
    if readyz and pool:
        ready = [c for c in pool if c.ready]
        if ready:
            pool = ready
    if mode == "latency" and len(pool) > 1:
        best = None
        for c in pool:
            if c.tier is not None and (best is None or c.tier < best):
                best = c.tier
        if best is not None:
            pool = [c for c in pool if c.tier is None or c.tier == best]
    return pool


def pick(addresses: Sequence[str], *, rng: random.Random,
         active: Sequence[int] | None = None) -> str | None:
    """One of ``addresses`` (eligible, in order), uniformly; with ``active`` (least-conn:
    each one's live connections), one of those with the fewest."""
    if active is not None and len(addresses) > 1:
        fewest = min(active)
        addresses = [a for a, n in zip(addresses, active, strict=True) if n == fewest]
    if len(addresses) <= 1:
        return addresses[0] if addresses else None
    return addresses[rng.randrange(len(addresses))]


def hedge_last_resort(candidates: Sequence[Candidate], *, readyz: bool,
                      exclude: Collection[str] = ()) -> str | None:
    """Where a hedge goes when no pickable upstream without a stalled dial is left (the
    registry tries those first, as an ordinary pick): among the healthy upstreams not
    excluded, not draining and not drained by an operator, a static fallback
    (``--static-endpoints=fallback``) included, those without a stalled dial first, then
    ready ones (readyz), then the most recently successful; None when there is none.

    A black hole's dials stay in flight until the dial timeout, so every dial to it
    stalls and nothing clears the mark: after a fault that black-holes the discovered
    servers, this sends the hedge to the one upstream still answering (the static
    endpoint) instead of to another stalled one, long before the failures or the probes
    exclude them."""
    best: Candidate | None = None
    best_key: tuple[bool, bool, float] | None = None
    for c in candidates:
        if (c.address in exclude or not c.healthy or c.draining or c.admin_drained):
            continue
        key = (c.stalled, readyz and not c.ready, -c.last_success)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return None if best is None else best.address


def choose(candidates: Sequence[Candidate], *, mode: str, readyz: bool, rng: random.Random,
           exclude: Collection[str] = ()) -> str | None:
    """The address for a new connection, or None when nothing is pickable."""
    pool = eligible(candidates, mode=mode, readyz=readyz, exclude=exclude)
    return pick([c.address for c in pool], rng=rng,
                active=[c.active for c in pool] if mode == "least-conn" else None)
