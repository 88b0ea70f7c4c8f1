"""Verdicts: what probe and dial results do to an upstream, and the overload guard.

* :meth:`Verdicts.record_probe`: one health check (TCP, and readyz when enabled) into the
  state machine (:mod:`~extractedprism.upstreams.state`); a stall-triggered one is also
  counted and logged (:meth:`Stalls.result_locked`).
* :meth:`Verdicts.record_dial`: a client dial's outcome counts toward the same streak.
* The overload guard (``--overload-guard``, :meth:`Verdicts.guard_holds_locked`): a slow
  answer (connected, then nothing within --health-timeout) counts only against a faster
  peer, and only for a bounded time: an upstream that has passed no check for
  :data:`GUARD_INTERVALS` check periods counts its slow answers whatever the guard says,
  so a frozen server is excluded within a bound the flags give even when every peer
  looks slow.
* Any success there (a check or a dial) ends a dial-stall mark.
"""

from __future__ import annotations

import logging

from extractedprism.upstreams import state as sm
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.records import Record
from extractedprism.upstreams.stalls import Stalls
from extractedprism.upstreams.state import ProbeResult, Transition, UpstreamState
from extractedprism.upstreams.table import Table

# How many check periods (--health-interval + --health-timeout) an upstream may go
# without a passed check while the overload guard holds its slow answers back. An
# overloaded server answers some checks in time (it is slow, not stopped); a frozen one
# or one cut from etcd answers none, and must be out within a bound the flags give (18 s
# with the shipped profile's 5 s + 1 s). Three periods is one more than the two failures
# in a row the spec needs to exclude, so the guard still absorbs a stampede's slow
# rounds. Past it, with no peer ready either, readiness does not narrow picks and closes
# no connection (readiness_moves needs another ready upstream), so the bound costs a
# saturated control plane nothing but the word "unready".
GUARD_INTERVALS = 3


class Verdicts:
    """Probe and dial results."""

    def __init__(self, table: Table, stalls: Stalls) -> None:
        self._t = table
        self._stalls = stalls

    # -- probes -------------------------------------------------------------------

    def record_probe(self, addr: str, result: ProbeResult, *, stall: bool = False) -> bool:
        """Feed one health check into the state machine. ``stall``: a check a stall asked
        for. True when the upstream now awaits the check that confirms a first failure
        (the ticker runs it after --health-recheck)."""
        fx = Effects()
        t = self._t
        with t.lock:
            rec = t.ups.get(addr)
            if rec is None or rec.state.lifecycle not in sm.TAKES_CHECKS:
                return False  # checks stop while an upstream drains; removed ones are gone
            now = t.clock()
            rec.last_check_at = now
            if result.ok:
                rec.last_success = now
                t.clear_dial_stall_locked(rec)
                if t.latency_mode and result.rtt is not None:
                    t.latency.observe(addr, result.rtt)
            before = rec.state
            state, transitions = sm.on_probe(before, result, readyz=t.readyz)
            error = result.reason or result.ready_reason
            held = sm.slow_answer(result) and self.guard_holds_locked(addr, rec, before, now)
            if held:
                state, transitions = self._not_counted_locked(addr, rec, before, error,
                                                            "probe", transitions, fx)
            rec.state = state
            confirm = sm.awaits_confirmation(state) and not held
            if stall:
                self._stalls.result_locked(addr, rec, error, now, fx, held=held)
            fx.transitions(addr, transitions)
            rec.failed_stalled = False  # this check decided; a failure below sets it again
            if not error:
                rec.passed_at = now
                self._stalls.check_passed_locked(addr, now)
            elif not held:
                # A failed check (the first, or the one that excludes) closes the
                # connections stalled now; the rest wait for the confirming check.
                self._stalls.close_stalled_locked(
                    addr, rec, now, fx, excluded=sm.excluded(state) and not sm.excluded(before))
            t.refresh_locked(now, fx)
        # No change notice: the probe thread wakes the ticker when it finishes.
        t.run(fx)
        return confirm

    # -- dials ----------------------------------------------------------------------

    def record_dial(self, addr: str, ok: bool, reason: str = "", *, count_error: bool = True,
                    duration: float | None = None, slow: bool = False) -> None:
        """A client dial's outcome counts toward the same streak as health checks;
        ``duration`` feeds the dial-time histogram; ``slow``: connected, but no first
        answer within --health-timeout (what the overload guard may hold back)."""
        t = self._t
        with t.lock:
            fx = self.record_dial_locked(addr, ok, reason, count_error, duration, slow)
        if fx is not None:
            t.run(fx)

    def record_dial_locked(self, addr: str, ok: bool, reason: str, count_error: bool,
                           duration: float | None, slow: bool) -> Effects | None:
        t = self._t
        rec = t.ups.get(addr)
        if rec is None:
            return None  # removed: failures are not counted until it is added again
        if duration is not None:
            rec.dials.observe(duration)
        if not ok and count_error:
            rec.connection_errors += 1
        if rec.state.draining:
            return None
        if ok:
            rec.last_success = t.clock()
            t.clear_dial_stall_locked(rec)
            if not sm.dial_success_changes(rec.state):
                return None  # nearly every connection: on_dial would change nothing
        state, transitions, probe = sm.on_dial(rec.state, ok, reason, readyz=t.readyz)
        if state is rec.state:
            return None  # the common case: nothing to change, nobody to wake
        fx = Effects()
        now = t.clock()
        if slow and self.guard_holds_locked(addr, rec, rec.state, now):
            state, transitions = self._not_counted_locked(addr, rec, rec.state, reason, "dial",
                                                        transitions, fx)
            probe = False
        recheck = not ok and sm.awaits_confirmation(state) and not sm.awaits_confirmation(
            rec.state)
        before, rec.state = rec.state, state
        if not ok:
            rec.last_check_at = now
        fx.transitions(addr, transitions)
        if sm.excluded(state) and not sm.excluded(before):
            self._stalls.close_stalled_locked(addr, rec, now, fx, excluded=True)
        flipped = any(tr.health_flipped for tr in transitions)
        t.refresh_locked(now, fx, deadlines=flipped)
        if probe:
            fx.changes.append(Change("probe-now", addr))
        elif recheck:
            fx.changes.append(Change("recheck", addr))
        if flipped:
            fx.changes.append(Change("health", addr))
        return fx

    def record_answer_hedge(self, addr: str, outcome: str) -> None:
        """A hedged first answer's outcome for ``addr`` ("won", "lost", "silent")."""
        t = self._t
        with t.lock:
            rec = t.ups.get(addr)
            if rec is not None:
                rec.answer_hedges[outcome] = rec.answer_hedges.get(outcome, 0) + 1

    def record_no_upstream(self) -> None:
        """A client was closed because no upstream was available."""
        t = self._t
        with t.lock:
            t.turned_away += 1

    # -- the overload guard ------------------------------------------------------------

    def guard_holds_locked(self, addr: str, rec: Record, before: UpstreamState,
                           now: float) -> bool:
        """--overload-guard: is this slow answer the control plane's rather than this
        upstream's? It counts only against a faster peer: another upstream in service
        whose latest check (or dial) succeeded and that is not marked. Without one,
        every upstream serving is slow (or it is the last one serving): counting then
        would take the survivors of a fault out of service in turn, the overload feeding
        itself. A frozen upstream beside healthy ones still counts at once; and one that
        has passed no check for GUARD_INTERVALS check periods counts whatever its peers
        look like (a harmless stall on the only peer must not keep a frozen server in
        service for ever)."""
        t = self._t
        if not t.overload_guard or not sm.serving(before, readyz=t.readyz):
            return False
        if now - rec.passed_at >= GUARD_INTERVALS * (t.health_interval + t.health_timeout):
            return False
        readyz = t.readyz
        marked = t.marked_locked()
        return not any(a != addr and a not in marked and not r.state.last_check_error
                       and sm.serving(r.state, readyz=readyz)
                       for a, r in t.ups.items())

    def _not_counted_locked(self, addr: str, rec: Record, before: UpstreamState, error: str,
                            source: str, transitions: list[Transition], fx: Effects
                            ) -> tuple[UpstreamState, list[Transition]]:
        """Do not count the slow answer the guard holds back: the streaks stay, the error
        shows as the latest check's (so this upstream is not anyone's faster peer
        either), one warning says why."""
        rec.slow_not_counted += 1
        fx.log(logging.WARNING, "slow answer not counted upstream=%s reason=%r source=%s "
               "why=%r", addr, error, source,
               "no other upstream in service answers in time (--overload-guard)")
        return sm.kept(before, error, source), [tr for tr in transitions if tr.kind == "check"]
