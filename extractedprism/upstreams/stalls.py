"""Stalls: connection sampling and the stall check (``--stall-timeout``), each rule once.

The ``conn-sampler`` thread calls :meth:`Stalls.sample_activity` every sample period
(also run at the start of every rebalance round). It reads each live connection's byte
counters (:mod:`~extractedprism.upstreams.activity` turns them into quiet time and
stalls) and:

* counts a connection's stall once per unanswered stretch;
* asks for a check of its upstream (Change "stall-check"), at most once per stall timeout
  and only of an upstream that takes checks and is not excluded;
* marks the upstream *suspect* (the eligibility rule's step 3) while one of its
  connections is stalled, until the stall is answered, its connection closes, or both
  of the stall's looks (:data:`~extractedprism.upstreams.activity.STALL_LOOKS`: at once,
  and SECOND_LOOK stall timeouts later) have been checked and the last one passed. A
  server that answers both looks while this connection waits is answering: the stall is
  a quiet stream (a watch's WINDOW_UPDATE, a long poll), not the server's, and no longer
  steers new connections away. Why not at the first passed look: a kube-apiserver's own
  /readyz lags an etcd cut by about 3 s, so a cut server passes the first. So a suspect
  mark ends within (1 + SECOND_LOOK) stall timeouts plus a check after the stall began
  (the rate limit may add one stall timeout), or at the overload guard's bound if those
  checks are held back.

When a check fails while connections are stalled (:meth:`Stalls.close_stalled_locked`),
the stalled ones are closed at once while another upstream serves, and the upstream stays
suspect until its next check decides.
"""

from __future__ import annotations

import logging
import operator

from extractedprism.upstreams import state as sm
from extractedprism.upstreams.activity import STALL_FAILED, STALL_LOOKS, STALL_PASSED, Activity
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.records import Record, StallTrigger, Tracked
from extractedprism.upstreams.table import Table

_first = operator.itemgetter(0)


class Stalls:
    """The stall check and the sampling it shares with rebalancing."""

    def __init__(self, table: Table) -> None:
        self._t = table

    def sample_activity(self) -> None:
        """Note which live connections moved bytes since the last sample, and, with
        --stall-timeout, which stalled (see the module docstring)."""
        fx = Effects()
        t = self._t
        with t.lock:
            self.sample_locked(t.clock(), fx)
        t.run(fx)

    def sample_locked(self, now: float, fx: Effects) -> None:
        # A connection's Activity starts at the first sample that sees it, not in attach:
        # a new connection's pick costs nothing more with sampling on.
        t = self._t
        timeout = t.stall_timeout
        suspect = []
        for addr, rec in t.ups.items():
            stalled = sample_record(rec, now, timeout)
            if stalled:
                self._stalls_locked(addr, rec, now, stalled, fx)
            if rec.failed_stalled or any(not harmless(act, rec) for _, _, act in stalled):
                suspect.append(addr)
        t.set_suspect_locked(frozenset(suspect))

    def _stalls_locked(self, addr: str, rec: Record, now: float,
                       stalled: list[tuple[float, Tracked, Activity]], fx: Effects) -> None:
        """Count ``addr``'s newly ``stalled`` connections; a stall that wants a look (its
        first, or a second one while still unanswered) asks for a check now, at most once
        per --stall-timeout, and only of an upstream that takes checks and is not
        excluded (an excluded one is checked anyway, and loses nothing)."""
        t = self._t
        for _, _, act in stalled:
            if not act.stalled:
                act.stalled = True
                rec.stalls += 1
        due = [act for _, _, act in stalled if act.wants_look(now, t.stall_timeout)]
        if not due:
            return
        if rec.state.lifecycle not in sm.TAKES_CHECKS or sm.excluded(rec.state):
            return
        if rec.stall_check_at is not None and now - rec.stall_check_at < t.stall_timeout:
            return  # the rate limit: the next sample after it asks again
        for act in due:
            act.looked_now(now)
        oldest = max(stalled, key=_first)
        rec.stall_check_at = now
        rec.stall_trigger = StallTrigger(now, len(stalled), oldest[0], oldest[1].client)
        fx.changes.append(Change("stall-check", addr))

    def check_passed_locked(self, addr: str, now: float) -> None:
        """A check of ``addr`` passed (Record.passed_at is now): the stalls it settles
        (harmless) no longer mark it."""
        t = self._t
        if addr not in t.suspect:
            return
        rec = t.ups[addr]
        if rec.failed_stalled or any(
                act.is_stalled(now, t.stall_timeout) and not harmless(act, rec)
                for act in rec.activity.values()):
            return
        t.set_suspect_locked(t.suspect - {addr})

    def result_locked(self, addr: str, rec: Record, error: str, now: float, fx: Effects, *,
                      held: bool) -> None:
        """A stall-triggered check's result: counted (extractedprism_stall_checks_total)
        and logged in one line with what asked for it. ``held``: a slow answer the
        overload guard did not count, so neither is it counted here as failed."""
        if not held:
            outcome = STALL_FAILED if error else STALL_PASSED
            rec.stall_checks[outcome] = rec.stall_checks.get(outcome, 0) + 1
        else:
            outcome = "not_counted"
        why, rec.stall_trigger = rec.stall_trigger, None
        if why is None:  # asked for before the upstream was removed and added again
            why = StallTrigger(now, 0, 0.0, "")
        fx.log(logging.WARNING if error and not held else logging.INFO,
               "stall check upstream=%s result=%s reason=%r stalled_connections=%d "
               "stalled_for=%.1fs client=%s took=%.1fs", addr, outcome, error, why.connections,
               why.stalled_for, why.client or "-", now - why.at)

    def close_stalled_locked(self, addr: str, rec: Record, now: float, fx: Effects, *,
                             excluded: bool) -> None:
        """A check of ``addr`` failed (``excluded``: and failed checks just took it out of
        service): its connections stalled right now are closed at once, while another
        upstream serves (the rest keep --unready-drain-timeout once it is excluded). They
        wait on an answer an upstream failing its checks is not giving: the client
        reconnects to a serving one. Until its next check decides, picks avoid it like a
        suspect, so the reconnect does not land where it just left. Only with
        --stall-timeout."""
        t = self._t
        if t.stall_timeout <= 0 or not t.another_serves_locked(addr):
            return
        conns = [c for _, c, _ in sample_record(rec, now, t.stall_timeout)]
        if conns:
            if not excluded:
                rec.failed_stalled = True
                t.set_suspect_locked(t.suspect | {addr})
            fx.log(logging.INFO, "closing stalled connections upstream=%s connections=%d "
                   "reason=%r", addr, len(conns),
                   "excluded by failed checks" if excluded else "a check failed")
            fx.close.extend(conns)  # pipes detach themselves when they notice the close


def harmless(act: Activity, rec: Record) -> bool:
    """A stalled stretch both its looks have checked, the last one passed: the server
    answers its checks while this connection waits (a quiet watch's WINDOW_UPDATE, a
    long poll), so it no longer steers new connections away."""
    return act.checks >= STALL_LOOKS and rec.passed_at >= act.looked


def sample_record(rec: Record, now: float, timeout: float
                  ) -> list[tuple[float, Tracked, Activity]]:
    """Sample ``rec``'s connections; returns those stalled now (``timeout``: the stall
    timeout, 0: none) as (unanswered for, connection, activity)."""
    # One pass, and only two attribute reads for a connection that moved nothing: this
    # runs under the registry lock every sample period for every connection. bytes_up
    # is read before up_answered: the mark only grows and never passes bytes_up, so a
    # read racing the relay errs toward "answered", never toward a stall that was not.
    acts = rec.activity
    stalled: list[tuple[float, Tracked, Activity]] = []
    for key, conn in rec.conns.items():
        act = acts.get(key)
        up, down = conn.bytes_up, conn.bytes_down
        if act is None:
            act = acts[key] = Activity(now, up, down, conn.up_answered)
        elif up != act.up or down != act.down:
            act.sample(now, up, down, conn.up_answered)
        if timeout and act.asked is not None and now - act.asked >= timeout:
            stalled.append((now - act.asked, conn, act))
    return stalled
