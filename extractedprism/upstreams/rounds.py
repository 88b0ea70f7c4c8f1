"""Rounds: one rebalance round (``--rebalance-interval``; the ``Rebalancer`` thread runs
them, :mod:`~extractedprism.upstreams.balance` is the rule). Fair shares are computed over
exactly what new picks may take (the eligibility rule, marks included), so a suspect
upstream that new connections avoid is not counted as room to move connections to."""

from __future__ import annotations

import dataclasses
import logging

from extractedprism.upstreams import balance
from extractedprism.upstreams.effects import Effects
from extractedprism.upstreams.snapshot import RebalanceView
from extractedprism.upstreams.stalls import Stalls
from extractedprism.upstreams.table import Table


class Rounds:
    """The rebalancer's rounds."""

    def __init__(self, table: Table, stalls: Stalls) -> None:
        self._t = table
        self._stalls = stalls

    def rebalance(self, trigger: str = "interval") -> RebalanceView:
        """One round: close at most one quiet connection of the most loaded upstream,
        with a FIN both ways, after the lock is released. A no-op view when rebalancing
        is off."""
        t = self._t
        fx = Effects()
        with t.lock:
            view = t.rebalance
            if view is None:
                return RebalanceView(0.0, t.rebalance_quiet, last_reason="off")
            now = t.clock()
            self._stalls.sample_locked(now, fx)
            reason, detail, acted = self._round_locked(now, trigger, fx)
            view = t.rebalance = dataclasses.replace(
                view, rounds=view.rounds + 1, closes=view.closes + acted,
                last_round_at=now, last_reason=reason, last_detail=detail,
                last_acted_at=now if acted else view.last_acted_at)
        t.run(fx)
        return view

    def _blocker_locked(self) -> tuple[str, str] | None:
        """(reason, upstream) when another mechanism is moving connections right now."""
        t = self._t
        if t.panic:
            return balance.PANIC, ""
        for addr, rec in t.ups.items():
            if rec.state.draining:
                return balance.DRAINING, addr
            if rec.unready_deadline is not None:
                return balance.CLOSING_UNREADY, addr
            if rec.close_plan:
                return balance.ADMIN_CLOSE, addr
        return None

    def _round_locked(self, now: float, trigger: str, fx: Effects) -> tuple[str, str, bool]:
        t = self._t
        blocked = self._blocker_locked()
        if blocked is not None:
            return blocked[0], blocked[1], False
        loads = t.loads_locked()
        verdict = balance.judge(loads)
        if verdict.over is None:
            return verdict.reason, "", False
        rec = t.ups[verdict.over]
        acts = rec.activity
        victim = balance.choose_quiet(
            (balance.Quiet(k, now - a.attached, now - a.active) for k, a in acts.items()),
            quiet=t.rebalance_quiet, min_age=t.rebalance_interval)
        if victim is None:
            return balance.NOTHING_QUIET, verdict.over, False
        conn = rec.conns[victim.key]
        del acts[victim.key]  # closing: never chosen again while its pipe winds down
        rec.rebalance_closes += 1
        counts = ",".join(f"{x.address}={x.connections}" for x in loads)
        assert verdict.shares is not None and verdict.least is not None
        fx.finish.append(conn)  # type: ignore[arg-type]
        fx.log(logging.INFO, "rebalance close upstream=%s connections=%d share=%.1f "
               "least=%s counts=%s age=%.1fs quiet=%.1fs client=%s trigger=%s",
               verdict.over, len(rec.conns), verdict.shares[verdict.over], verdict.least,
               counts, victim.age, victim.quiet, conn.client, trigger)
        return balance.ACTED, f"closed a connection of {verdict.over} ({counts})", True
