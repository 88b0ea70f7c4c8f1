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

The registry calls :func:`choose` under its lock on every new connection, so it does no
I/O, keeps allocations to a couple of small lists and takes the rng as an argument.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from extractedprism.upstream import pickable

MODES = ("random", "latency", "least-conn")


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


def choose(candidates: Sequence[Candidate], *, mode: str, readyz: bool, rng: random.Random,
           exclude: Collection[str] = ()) -> str | None:
    """The address for a new connection, or None when nothing is pickable."""
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}")
    pool = [c for c in candidates
            if pickable(c) and (not exclude or c.address not in exclude)]
    if not pool:
        return None
    if readyz:
        ready = [c for c in pool if c.ready]
        if ready:
            pool = ready
    if len(pool) > 1 and mode != "random":
        if mode == "latency":
            best = None
            for c in pool:
                if c.tier is not None and (best is None or c.tier < best):
                    best = c.tier
            if best is not None:
                pool = [c for c in pool if c.tier is None or c.tier == best]
        else:  # least-conn
            fewest = min(c.active for c in pool)
            pool = [c for c in pool if c.active == fewest]
    if len(pool) == 1:
        return pool[0].address
    return pool[rng.randrange(len(pool))].address
