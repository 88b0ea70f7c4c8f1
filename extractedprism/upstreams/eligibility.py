"""The one eligibility rule: which upstreams may take a connection, in which order (pure).

Every path that chooses an upstream goes through :func:`eligible` (first pick, retry after
a drain race, dial hedge, first-answer hedge, the rebalancer's fair share) or its
ordering twin :func:`ranked` (the dial hedge's last resort, panic mode), so no path can
order the filters its own way. The order, and why (docs/architecture.md, "Who may take
a connection"):

1. **Hard filters**: listed (not draining: removed), not excluded by failed checks or
   dials (healthy), not a demoted static fallback, not drained by an operator, not
   already tried by this client. A hard filter never yields to another; only panic mode
   (nothing pickable at all) and the hedge's last resort relax the first group.
2. **Readiness** (``--health-check=readyz``): ready ones while any is ready. The spec's
   rule: new connections go to ready upstreams only; a server cut from etcd accepts TCP
   and answers /readyz 500, and must not get a request while a ready one exists.
3. **Marks** (a stalled connection, a dial stalled past --dial-hedge-delay): unmarked
   ones while any remains. A mark is a suspicion, not a verdict: it is a preference
   *among the ready*, never a reason to go to an unready one.
4. **The policy's narrowing** (``--upstream-selection=latency``: the fastest tier), after
   the marks, so a marked upstream alone in the fastest tier does not take every
   connection.
5. **The policy's pick** (random, least-conn, latency), weighted by slow start.

Each filter after the first keeps the pool unchanged when it would empty it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from extractedprism.upstreams.state import pickable


# Not frozen: a frozen dataclass's __init__ goes through object.__setattr__ per field,
# and a pick that cannot use the cached pool builds one Candidate per upstream.
@dataclass(slots=True)
class Candidate:
    address: str
    healthy: bool  # TCP health after the consecutive-failure threshold
    draining: bool  # removed from the endpoint list
    ready: bool  # readyz says ready (False when pending or unready); ignored unless readyz
    tier: int | None = None  # latency tier, None = no sample yet (latency policy only)
    active: int = 0  # live connections and dials in flight (least-conn)
    fallback: bool = False  # --static-endpoints=fallback demoted it: panic mode only
    admin_drained: bool = False  # an operator's drain or close: no new connections
    marked: bool = False  # a stalled connection or a stalled dial (see the docstring)
    last_success: float = 0.0  # its latest successful check or dial (registry clock)


class Narrowing(Protocol):
    """What the rule needs of a selection policy (policies.Policy)."""

    def narrow(self, pool: list[Candidate]) -> list[Candidate]: ...


def in_service(c: Candidate) -> bool:
    """The hard filter of every ordinary pick (state.pickable)."""
    return pickable(c)


def hedge_base(c: Candidate) -> bool:
    """The dial hedge's last resort: healthy, listed, not drained by an operator; a
    static fallback included (after a fault that black-holes the discovered servers the
    hedge reaches the one still answering)."""
    return c.healthy and not c.draining and not c.admin_drained


def panic_base(c: Candidate) -> bool:
    """Panic mode (nothing in service): every listed upstream an operator has not
    drained, unhealthy ones included."""
    return not c.draining and not c.admin_drained


def eligible(candidates: Sequence[Candidate], *, readyz: bool, policy: Narrowing | None = None,
             exclude: Collection[str] = (),
             base: Callable[[Candidate], bool] = in_service) -> list[Candidate]:
    """THE rule (module docstring): the upstreams a pick may return, in the candidates'
    order."""
    pool = [c for c in candidates if base(c) and (not exclude or c.address not in exclude)]
    if len(pool) > 1 and readyz:
        ready = [c for c in pool if c.ready]
        if ready:
            pool = ready
    if len(pool) > 1:
        unmarked = [c for c in pool if not c.marked]
        if unmarked:
            pool = unmarked
    if policy is not None and len(pool) > 1:
        pool = policy.narrow(pool)
    return pool


def preference(c: Candidate, readyz: bool) -> tuple[bool, bool, float]:
    """The rule's steps 2 and 3 as a sort key, most recent success breaking ties."""
    return (readyz and not c.ready, c.marked, -c.last_success)


def ranked(candidates: Sequence[Candidate], *, readyz: bool, exclude: Collection[str] = (),
           base: Callable[[Candidate], bool]) -> list[Candidate]:
    """Every candidate ``base`` admits, not excluded, best first by the same preference
    as :func:`eligible` (ready, then unmarked, then most recently successful): the
    hedge's last resort takes the first, panic mode tries them in order."""
    pool = [c for c in candidates if base(c) and c.address not in exclude]
    pool.sort(key=lambda c: preference(c, readyz))
    return pool
