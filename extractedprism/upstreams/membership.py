"""Membership: the endpoint list (discovery), operator marks (the admin socket) and the
deadlines they start (drain, readiness closes, an operator's planned closes)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.records import Record
from extractedprism.upstreams.roles import Roles
from extractedprism.upstreams.snapshot import AdminMark, AdminOutcome
from extractedprism.upstreams.table import Table


class Membership:
    """Which upstreams exist, and what operators and deadlines do to them."""

    def __init__(self, table: Table) -> None:
        self._t = table

    def set_endpoints(self, endpoints: Sequence[Endpoint], roles: Roles | None = None
                      ) -> None:
        """Make ``endpoints`` the upstream list: add new ones, drain removed ones.

        ``roles`` (from the merger): each address's providers, and the static ones kept
        only as a last resort (lifecycle FALLBACK: checked, tried in panic mode, never
        picked normally)."""
        t = self._t
        wanted = {str(ep): ep for ep in endpoints}
        sources = roles.sources if roles is not None else {}
        fallback = roles.fallback if roles is not None else frozenset()
        fx = Effects()
        with t.lock:
            now = t.clock()
            for addr, ep in wanted.items():
                rec = t.ups.get(addr)
                demoted = addr in fallback
                if rec is None:
                    rec = t.ups[addr] = Record(endpoint=ep, since=now, passed_at=now)
                    # Slow start: added to a list that already serves, it ramps up; the
                    # first list (and a start with readyz, ready one by one) does not.
                    rec.ramp_new = any(r.served for r in t.ups.values())
                    rec.state = sm.listed(rec.state, fallback=demoted)
                    fx.log(logging.INFO, "upstream added upstream=%s%s", addr,
                           " fallback=true" if demoted else "")
                elif rec.state.draining:
                    rec.state = sm.listed(rec.state, fallback=demoted)
                    rec.drain_deadline = None
                    fx.log(logging.INFO, "upstream drain aborted upstream=%s reason=%r", addr,
                           "re-added")
                else:
                    rec.set_role(addr, demoted, fx)
                rec.sources = tuple(sources.get(addr, ()))
            for addr, rec in list(t.ups.items()):
                if addr in wanted or rec.state.draining:
                    continue
                rec.state = sm.drain(rec.state)
                rec.unready_deadline = None
                if t.drain_timeout <= 0 or not rec.conns:
                    fx.log(logging.INFO, "upstream removed upstream=%s connections_closed=%d",
                           addr, len(rec.conns))
                    fx.close.extend(t.remove_locked(addr))
                else:
                    rec.drain_deadline = now + t.drain_timeout
                    fx.log(logging.INFO, "upstream draining upstream=%s connections=%d "
                           "drain_timeout=%gs", addr, len(rec.conns), t.drain_timeout)
            t.refresh_locked(now, fx)
            fx.changes.append(Change("endpoints"))
        t.run(fx)

    def set_roles(self, roles: Roles) -> None:
        """The same endpoint list with other roles (sources, fallback demotions)."""
        t = self._t
        fx = Effects()
        with t.lock:
            for addr, rec in t.ups.items():
                if rec.state.draining:
                    continue
                rec.set_role(addr, addr in roles.fallback, fx)
                rec.sources = tuple(roles.sources.get(addr, rec.sources))
            t.refresh_locked(t.clock(), fx)
        t.run(fx)

    def tick(self) -> float | None:
        """Expire drain and readiness deadlines; return the next deadline, if any."""
        t = self._t
        fx = Effects()
        with t.lock:
            now = t.clock()
            for addr, rec in list(t.ups.items()):
                if (rec.state.draining and rec.drain_deadline is not None
                        and now >= rec.drain_deadline):
                    fx.log(logging.INFO, "upstream drain timeout; force-closing upstream=%s "
                           "connections=%d", addr, len(rec.conns))
                    fx.close.extend(t.remove_locked(addr))
            t.refresh_locked(now, fx)
            for rec in t.ups.values():
                rec.close_due(now, fx)
            deadlines = [d for r in t.ups.values()
                         for d in (r.drain_deadline, r.unready_deadline,
                                   r.close_plan[0][0] if r.close_plan else None)
                         if d is not None]
        t.run(fx)
        return min(deadlines) if deadlines else None

    # -- operator marks (upstreams.actions.AdminActions) ------------------------------

    def set_admin(self, addr: str, action: str, uid: int, *, unless_closed: bool = False,
                  unless_alone: bool = False) -> AdminOutcome | None:
        """Set the operator's mark on ``addr`` ("drain" or "close"; "" clears it); None
        when the address is unknown.

        Checked in the same lock round trip as the change, which is skipped (``done``
        False) when ``unless_closed`` and an operator has closed it, or when
        ``unless_alone`` and no other pickable (and, with readyz, ready) upstream is
        left. A close plans the closes of its connections spread over --drain-timeout."""
        t = self._t
        fx = Effects()
        with t.lock:
            rec = t.ups.get(addr)
            if rec is None:
                return None
            before = rec.state.admin
            others = t.another_serves_locked(addr)
            done = not (unless_closed and before == "close") and not (unless_alone
                                                                        and not others)
            if done:
                self._set_admin_locked(addr, rec, action, uid, fx)
            outcome = AdminOutcome(before=before, state=rec.state, connections=len(rec.conns),
                                   others=others, done=done)
        t.run(fx)
        return outcome

    def _set_admin_locked(self, addr: str, rec: Record, action: str, uid: int,
                          fx: Effects) -> None:
        t = self._t
        now = t.clock()
        rec.state = sm.admin_set(rec.state, action)
        rec.admin_mark = AdminMark(action, uid, now) if action else None
        rec.close_plan = []
        if action == "close":
            rec.plan_close(now, t.drain_timeout)
            if rec.close_plan:
                fx.log(logging.INFO, "closing connections upstream=%s connections=%d "
                       "reason=%r over=%gs", addr, len(rec.close_plan), "admin close",
                       max(0.0, t.drain_timeout))
            rec.close_due(now, fx)
        # The set of pickable (and ready) upstreams changed: readiness closes elsewhere
        # may start or be called off, panic may begin or end.
        t.refresh_locked(now, fx)
        fx.changes.append(Change("health", addr))  # wakes the ticker for new deadlines
