"""Picks: the upstream for a new connection, a retry, a hedge, the last resort and panic
mode, each through the one rule (:mod:`~extractedprism.upstreams.eligibility`).

* :meth:`Picks.reserve`: a first pick, or a retry / first-answer hedge (``exclude``: the
  upstreams this client tried). Counted as a dial in flight (least-conn sees it).
* :meth:`Picks.reserve_hedge`: the dial hedge. The same rule (a stalled dial marks its
  upstream, so step 3 already avoids it); when nothing is eligible, the rule's ordering
  over the healthy upstreams, a static fallback included (:func:`eligibility.ranked`).
* :meth:`Picks.panic_order` / :meth:`Picks.reserve_endpoint`: panic mode, every listed
  upstream an operator has not drained, in the rule's order.
* :meth:`Picks.stall_dial`: a dial in flight past --dial-hedge-delay marks its upstream
  until that dial, or any other dial or check there, ends (verdicts clear it).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.eligibility import hedge_base, panic_base, ranked
from extractedprism.upstreams.policies import Policy
from extractedprism.upstreams.reservation import Reservation
from extractedprism.upstreams.table import Table

_STATE = operator.attrgetter("state")


class Picks:
    """Every way a connection is given an upstream."""

    def __init__(self, table: Table) -> None:
        self._t = table
        # The eligible addresses of a first pick, and the key they were computed from:
        # kept while the records, their (frozen, so replaced on change) states, the
        # latency tiers and the marks stay the same; the key costs two C-level tuple
        # builds where the list costs a Candidate per upstream.
        self._pool: list[str] = []
        self._pickable = 0
        self._pool_key: tuple[object, ...] | None = None
        # The policy picks uniformly when nothing ramps (it keeps Policy.pick and wants no
        # live counts): that case, every new connection's, is inlined in _choose_locked.
        self._uniform = (type(table.policy).pick is Policy.pick
                         and not table.policy.counts_active)

    def reserve(self, exclude: Iterable[str] = ()) -> Reservation | None:
        """Pick the upstream for a new connection (or, with ``exclude``, a retry or a
        first-answer hedge) and count its dial in flight; None when nothing is
        eligible."""
        t = self._t
        with t.lock:
            if exclude:  # a retry or a hedge: rare, so no cache
                skip = frozenset(exclude)
                addr = self._choose_locked([c.address for c in t.eligible_locked(skip)])
                if addr is None:
                    return None
                alone = not any(r.state.pickable and a != addr and a not in skip
                                for a, r in t.ups.items())
            else:
                # Every new connection: the eligible list is kept while the records, their
                # (frozen, so replaced on change) states, the latency tiers and the marks
                # stay the same; the key costs two C-level tuple builds where the list
                # costs a Candidate per upstream.
                ups = t.ups
                key = (tuple(ups), tuple(map(_STATE, ups.values())),
                       t.latency.tier_map if t.latency_mode else None, t.marks_epoch)
                if key != self._pool_key:
                    self._pool = [c.address for c in t.eligible_locked()]
                    self._pickable = sum(1 for r in ups.values() if r.state.pickable)
                self._pool_key = key  # also when equal: compared by identity next time
                addr = self._choose_locked(self._pool)
                if addr is None:
                    return None
                alone = self._pickable <= 1
            rec = t.ups[addr]
            rec.dialing += 1
            return Reservation(t.lock, rec, addr, alone=alone)

    def _choose_locked(self, pool: list[str]) -> str | None:
        """The policy's pick among the eligible ``pool`` (slow start's weights while some
        upstream ramps)."""
        if len(pool) <= 1:
            return pool[0] if pool else None
        t = self._t
        policy = t.policy
        if self._uniform and not t.ramping:  # random, latency: Policy.pick's plain case
            return pool[t.rng.randrange(len(pool))]
        ups = t.ups
        active = ([len(ups[a].conns) + ups[a].dialing for a in pool]
                  if policy.counts_active else None)
        weights = None
        if t.ramping:
            now = t.clock()
            weights = [t.weight_locked(a, now) for a in pool]
        return policy.pick(pool, rng=t.rng, active=active, weights=weights)

    def reserve_hedge(self, exclude: Iterable[str]) -> Reservation | None:
        """The dial hedge of a connection whose dial in flight has stalled: the rule's
        pick among the upstreams not in ``exclude``; else its last resort (the rule's
        order over the healthy ones, a static fallback included). None when nothing is
        left at all."""
        t = self._t
        skip = frozenset(exclude)
        with t.lock:
            pool = t.eligible_locked(skip)
            addr = None
            if not pool or all(c.marked for c in pool):
                # Nothing eligible, or only marked ones: the last resort, if it holds an
                # unmarked one (a static fallback after a fault black-holed every
                # discovered server), else the rule's best.
                best = ranked(t.candidates_locked(), readyz=t.readyz, exclude=skip,
                              base=hedge_base)
                if best and (not pool or not best[0].marked):
                    addr = best[0].address
            if addr is None:
                addr = self._choose_locked([c.address for c in pool])
            if addr is None:
                return None
            rec = t.ups[addr]
            rec.dialing += 1
            alone = not any(r.state.pickable and a != addr and a not in skip
                            for a, r in t.ups.items())
            return Reservation(t.lock, rec, addr, alone=alone, panic=rec.state.fallback)

    def stall_dial(self, res: Reservation) -> None:
        """``res``'s dial has been in flight past --dial-hedge-delay (the Dialer says so,
        once per dial): its upstream is marked until a check or a dial there succeeds
        (that dial connecting included). A failed one leaves the mark: the failure asks
        for the confirming check after --health-recheck, which excludes the upstream or
        clears the mark, so the mark outlives no check."""
        t = self._t
        with t.lock:
            if res.stalled or not res.held:
                return
            res.stalled = True
            rec = t.ups.get(res.address)
            if rec is not None:
                t.mark_dial_stall_locked(rec)

    def reserve_endpoint(self, endpoint: Endpoint) -> Reservation | None:
        """Count a dial to ``endpoint`` chosen by panic mode; None if no longer known."""
        t = self._t
        addr = str(endpoint)
        with t.lock:
            rec = t.ups.get(addr)
            if rec is None:
                return None
            rec.dialing += 1
            return Reservation(t.lock, rec, addr, panic=True)

    def any_pickable(self, exclude: Iterable[str] = ()) -> bool:
        skip = frozenset(exclude)
        t = self._t
        with t.lock:
            return any(r.state.pickable and a not in skip for a, r in t.ups.items())

    def panic_order(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """Panic mode: every listed upstream an operator has not drained, in the rule's
        order (ready, unmarked, most recently successful first)."""
        t = self._t
        skip = frozenset(exclude)
        with t.lock:
            order = ranked(t.candidates_locked(), readyz=t.readyz, exclude=skip,
                           base=panic_base)
            return [t.ups[c.address].endpoint for c in order]

