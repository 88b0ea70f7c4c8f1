"""Connections: attach (the dial's success recorded in the same lock round trip),
detach, counting each connection once on the upstream that carries it, and shutdown."""

from __future__ import annotations

import logging

from extractedprism.upstreams import state as sm
from extractedprism.upstreams.effects import Effects
from extractedprism.upstreams.records import Tracked
from extractedprism.upstreams.reservation import Reservation
from extractedprism.upstreams.table import Table
from extractedprism.upstreams.verdicts import Verdicts

log = logging.getLogger("extractedprism.upstreams.registry")


class Connections:
    """Live connections: where each one is, and its counts."""

    def __init__(self, table: Table, verdicts: Verdicts) -> None:
        self._t = table
        self._verdicts = verdicts

    def attach(self, target: Reservation | str, conn: Tracked) -> bool:
        """Track a connection whose carrier is known (the reservation ends here, attached
        or not) and count it; False if the upstream drains or left meanwhile.

        The reservation's dial succeeded: recorded here, in the same lock round trip. A
        plain address attaches without a reservation and records nothing (the first
        upstream after a hedge, tests, tools)."""
        t = self._t
        with t.lock:
            ok, fx = self._attach_locked(target, conn, judging=False)
        if fx is not None:
            t.run(fx)
        return ok

    def attach_judging(self, res: Reservation, conn: Tracked) -> bool | None:
        """attach() before the silent-upstream check has judged the dial, so the check
        and the relay can run as one native call (Pipe.run_judged). The connection is
        live but not counted until it carries (Table.settle_locked): a silent or left
        verdict detaches it uncounted.

        Only where the dial's success changes nothing about the upstream (the common
        case). None: it would change something; nothing was done, and the caller judges
        first and then calls attach()."""
        t = self._t
        with t.lock:
            rec = t.ups.get(res.address)
            if rec is not None and not rec.state.draining and sm.dial_success_changes(
                    rec.state):
                return None
            ok, fx = self._attach_locked(res, conn, judging=True)
        assert fx is None  # a success that changes nothing has no effects
        return ok

    def _attach_locked(self, target: Reservation | str, conn: Tracked, *, judging: bool
                       ) -> tuple[bool, Effects | None]:
        t = self._t
        fx = None
        if isinstance(target, Reservation):
            target.take_locked()
            addr = target.address
            fx = self._verdicts.record_dial_locked(addr, True, "", True, target.dial_seconds,
                                                   False)
        else:
            addr = target
        rec = t.ups.get(addr)
        ok = not (rec is None or rec.state.draining or rec.state.admin_drained or t.closing)
        if ok:
            assert rec is not None
            key = id(conn)
            rec.conns[key] = conn
            t.conn_count += 1
            if judging:
                rec.judging.add(key)
            else:
                t.count_locked(rec)
        return ok, fx

    def detach(self, addr: str, conn: Tracked, *, carried: bool = True) -> None:
        """The connection ended. ``carried``: False when its relay found the upstream
        silent or the client gone before it answered (a judging connection is then never
        counted)."""
        t = self._t
        with t.lock:
            rec = t.ups.get(addr)
            key = id(conn)
            if rec is None or rec.conns.pop(key, None) is None:
                return
            if rec.judging and key in rec.judging:
                rec.judging.discard(key)
                if carried:
                    t.count_locked(rec)
            if rec.activity:
                rec.activity.pop(key, None)
            t.conn_count -= 1
            if rec.close_plan:  # it ended before its admin close came
                rec.close_plan = [(w, i) for w, i in rec.close_plan if i != key]
            rec.bytes_up += conn.bytes_up
            rec.bytes_down += conn.bytes_down
            if not (rec.state.draining and not rec.conns):
                return
            t.remove_locked(addr)
        log.info("upstream drained upstream=%s", addr)

    def close_all(self) -> int:
        """Shutdown: refuse new attaches and force-close every live connection."""
        t = self._t
        fx = Effects()
        with t.lock:
            t.set_closing_locked()
            fx.close = [c for r in t.ups.values() for c in r.conns.values()]
        t.run(fx)
        return len(fx.close)
