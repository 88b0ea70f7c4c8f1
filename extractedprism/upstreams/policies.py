"""Selection policies (``--upstream-selection``), one class each (pure).

A policy does the rule's last two steps (:mod:`extractedprism.upstreams.eligibility`):
``narrow`` (which of the eligible may be picked at all) and ``pick`` (one of them). A new
policy is one class here plus its spelling in :data:`POLICIES` and in the flag table
(``config.table.SELECTION_MODES``).

* ``random``: uniform among the eligible.
* ``least-conn``: the fewest live connections (dials in flight included), ties broken
  uniformly. Prefer it when clients hold long-lived connections (kubelet HTTP/2 with
  watches): random spreads new connections evenly but not the connections that stay.
* ``latency``: uniform among those of the lowest latency tier that has one, together
  with those that have no sample yet, so a new upstream gets an equal share of that
  tier's picks until the failure threshold excludes it.

Slow start's weights (``--slow-start``) apply to every policy: a ramping upstream's
chance is scaled by its weight (least-conn: its count divided by it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extractedprism.config.table import SELECTION_MODES
from extractedprism.upstreams import balance
from extractedprism.upstreams.eligibility import Candidate


class Policy:
    """Random: the base every policy shares."""

    name = "random"
    wants_tiers = False  # the registry fills Candidate.tier only for a policy that reads it
    counts_active = False  # ... and passes live counts only to one that reads them

    def narrow(self, pool: list[Candidate]) -> list[Candidate]:
        return pool

    def pick(self, addresses: Sequence[str], *, rng: random.Random,
             active: Sequence[int] | None = None,
             weights: Sequence[float] | None = None) -> str | None:
        """One of ``addresses`` (eligible, in order); ``weights``: slow start's, only
        while some upstream ramps."""
        if len(addresses) <= 1:
            return addresses[0] if addresses else None
        if weights is not None:
            return balance.pick_weighted(addresses, weights, rng=rng, active=active)
        if active is not None:
            fewest = min(active)
            addresses = [a for a, n in zip(addresses, active, strict=True) if n == fewest]
            if len(addresses) == 1:
                return addresses[0]
        return addresses[rng.randrange(len(addresses))]


class LeastConn(Policy):
    name = "least-conn"
    counts_active = True


class Latency(Policy):
    name = "latency"
    wants_tiers = True

    def narrow(self, pool: list[Candidate]) -> list[Candidate]:
        best = min((c.tier for c in pool if c.tier is not None), default=None)
        if best is None:
            return pool
        return [c for c in pool if c.tier is None or c.tier == best]


POLICIES: dict[str, type[Policy]] = {"random": Policy, "least-conn": LeastConn,
                                     "latency": Latency}
assert tuple(sorted(POLICIES)) == tuple(sorted(SELECTION_MODES)), "flag table and policies"


def policy_for(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown selection mode {name!r}") from None
