"""The upstream registry: the one RLock that owns every upstream's record.

Every thread reads and changes upstream state only through this object:

* the ticker's probe threads call :meth:`record_probe` (which says whether the next
  check should come after --health-recheck);
* pipe threads call :meth:`reserve`, :meth:`record_dial`, :meth:`attach`, :meth:`detach`;
* discovery calls :meth:`set_endpoints`;
* the ticker calls :meth:`tick` to expire drain and readiness deadlines;
* the operator actions (:class:`~extractedprism.upstreams.actions.AdminActions`, for the
  admin socket) call :meth:`set_admin` and :meth:`known_addresses`;
* the ``conn-sampler`` thread (:mod:`extractedprism.upstreams.sampler`, only with
  --rebalance-interval or --stall-timeout) calls :meth:`sample_activity` (which also finds
  stalls, :mod:`extractedprism.upstreams.activity`, and asks the ticker for a
  stall-triggered check) and :meth:`rebalance`, whose rule is
  :mod:`extractedprism.upstreams.balance` (pure), as is slow start's weight ramp;
* the health server and the metrics collector read :meth:`snapshot`.

The rules of one upstream's state live in :mod:`extractedprism.upstreams.state` (pure),
the per-address record in :mod:`extractedprism.upstreams.records`, the wording and checks
of the operator actions in :mod:`extractedprism.upstreams.actions`; this module owns what
needs the lock: the address -> record dict, live connections, the counters, the drain
and readiness deadlines and the panic flag. Fields guarded by
``self.lock``: ``_ups`` (and everything in each record), ``_panic``, ``_conn_count``,
``_connections_total``, ``_closing``, ``_rebalance`` (the rounds' record), ``_ramping``,
``_dial_stalls`` (the records marked by :meth:`stall_dial`, counted so a pick skips the
scan while none is).
The stall check's rules (``--stall-timeout``) live here too, each once: when a stall asks
for a check (:meth:`_stalls_locked`: a checked upstream that is not excluded, at most once
per stall timeout), how its result counts (:meth:`record_probe` with ``stall=True``:
like any other, plus the metric and one log line), and which connections go at the
moment failed checks exclude an upstream (:meth:`_close_stalled_locked`).
Methods never do I/O, logging or callbacks while holding it: sockets to close, log lines
and change notices are collected in an
:class:`~extractedprism.upstreams.effects.Effects` under the lock and carried out after it is
released, so a stalled log handler or a slow close never stalls a pick.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams import balance
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.activity import STALL_FAILED, STALL_PASSED, Activity
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.latency import LatencyTiers
from extractedprism.upstreams.records import (
    Record,
    StallTrigger,
    Tracked,
    last_success,
    readiness_moves,
    started,
)
from extractedprism.upstreams.reservation import Reservation
from extractedprism.upstreams.roles import Roles
from extractedprism.upstreams.selection import (
    Candidate,
    choose,
    eligible,
    hedge_last_resort,
    pick,
)
from extractedprism.upstreams.snapshot import (
    AdminMark,
    AdminOutcome,
    ConnView,
    RebalanceView,
    Snapshot,
)
from extractedprism.upstreams.state import ProbeResult, Readiness, Transition, UpstreamState

log = logging.getLogger(__name__)
_STATE = operator.attrgetter("state")
_first = operator.itemgetter(0)


class Registry:
    """Upstream records, live connections, counters and deadlines behind one RLock."""

    def __init__(
        self,
        *,
        selection: str = "random",
        readyz: bool = False,
        drain_timeout: float = 30.0,
        unready_drain_timeout: float | None = None,
        max_connections: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_change: Callable[[Change], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        rebalance_interval: float = 0.0,
        rebalance_quiet: float = 5.0,
        slow_start: float = 0.0,
        stall_timeout: float = 0.0,
        overload_guard: bool = False,
    ) -> None:
        self.lock = threading.RLock()
        self._selection = selection
        self._latency_mode = selection == "latency"
        self._readyz = readyz
        self._drain_timeout = drain_timeout
        # None: the same as --drain-timeout (the spec gives both cases one grace period).
        self._unready_drain_timeout = (drain_timeout if unready_drain_timeout is None
                                       else unready_drain_timeout)
        self._max_connections = max_connections
        self._clock = clock
        self._wall = wall_clock
        self._rng = rng or random.Random()
        self._on_change = on_change
        self._ups: dict[str, Record] = {}
        self._latency = LatencyTiers()
        self._panic = False
        self._conn_count = 0
        self._connections_total = 0
        self._turned_away = 0
        self._closing = False
        # The eligible upstreams for a pick, and the key they were computed from (see
        # _choose_locked; a key of None: not computed yet).
        self._pool: list[str] = []
        self._pickable = 0  # how many upstreams are pickable, counted with _pool
        self._pool_key: tuple[object, ...] | None = None
        # Rebalancing (0: off; then no connection's activity is tracked) and its rounds.
        self._rebalance_interval = rebalance_interval
        self._rebalance_quiet = rebalance_quiet
        self._rebalance = (RebalanceView(rebalance_interval, rebalance_quiet)
                           if rebalance_interval > 0 else None)
        # Slow start (0: off) and the upstreams ramping now: picks weigh only while it is
        # non-empty, so with slow start off (or no ramp running) a pick costs what it did.
        self._slow_start = slow_start
        self._ramping: set[str] = set()
        # The stall check (0: off). Connections' activity is sampled (conn-sampler) only
        # when it or rebalancing is on.
        self._stall_timeout = stall_timeout
        # --overload-guard: a slow answer (sm.slow_answer, or a client's first answer
        # past --health-timeout) counts only while a faster peer serves
        # (_slow_not_counted_locked).
        self._overload_guard = overload_guard
        # Upstreams with a stalled connection at the last sample: new connections go
        # elsewhere while another eligible upstream has none (_choose_locked).
        self._suspect: frozenset[str] = frozenset()
        # How many records carry a dial stall (Record.stalled: a dial past
        # --dial-hedge-delay, no success since; stall_dial() sets it, a success clears
        # it): while any does, picks skip them like the stall check's suspects.
        self._dial_stalls = 0

    def _run(self, fx: Effects) -> None:
        fx.run(log, self._on_change)

    # -- discovery ----------------------------------------------------------------

    def set_endpoints(self, endpoints: Sequence[Endpoint], roles: Roles | None = None
                      ) -> None:
        """Make ``endpoints`` the upstream list: add new ones, drain removed ones.

        ``roles`` (from the merger): each address's providers, and the static ones kept
        only as a last resort (lifecycle FALLBACK: checked, tried in panic mode, never
        picked normally)."""
        wanted = {str(ep): ep for ep in endpoints}
        sources = roles.sources if roles is not None else {}
        fallback = roles.fallback if roles is not None else frozenset()
        fx = Effects()
        with self.lock:
            now = self._clock()
            for addr, ep in wanted.items():
                rec = self._ups.get(addr)
                demoted = addr in fallback
                if rec is None:
                    rec = self._ups[addr] = Record(endpoint=ep, since=now)
                    # Slow start: added to a list that already serves, it ramps up; the
                    # first list (and a start with readyz, ready one by one) does not.
                    rec.ramp_new = any(r.served for r in self._ups.values())
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
            for addr, rec in list(self._ups.items()):
                if addr in wanted or rec.state.draining:
                    continue
                rec.state = sm.drain(rec.state)
                rec.unready_deadline = None
                if self._drain_timeout <= 0 or not rec.conns:
                    fx.log(logging.INFO, "upstream removed upstream=%s connections_closed=%d",
                           addr, len(rec.conns))
                    fx.close.extend(self._remove_locked(addr))
                else:
                    rec.drain_deadline = now + self._drain_timeout
                    fx.log(logging.INFO, "upstream draining upstream=%s connections=%d "
                           "drain_timeout=%gs", addr, len(rec.conns), self._drain_timeout)
            self._update_readiness_deadlines_locked(now, fx)
            self._update_panic_locked(fx)
            self._update_words_locked(now)
            fx.changes.append(Change("endpoints"))
        self._run(fx)

    def set_roles(self, roles: Roles) -> None:
        """The same endpoint list with other roles (sources, fallback demotions)."""
        fx = Effects()
        with self.lock:
            for addr, rec in self._ups.items():
                if rec.state.draining:
                    continue
                rec.set_role(addr, addr in roles.fallback, fx)
                rec.sources = tuple(roles.sources.get(addr, rec.sources))
            now = self._clock()
            self._update_readiness_deadlines_locked(now, fx)
            self._update_panic_locked(fx)
            if self._slow_start > 0:  # a fallback listed again serves again: it ramps
                self._update_serving_locked(now)
        self._run(fx)

    def _remove_locked(self, addr: str) -> list[Tracked]:
        rec = self._ups.pop(addr)
        self._clear_stall_locked(rec)
        if rec.judging:  # the ones carrying bytes are counted before the record goes
            self._settle_record_locked(rec)
        self._latency.remove(addr)
        self._ramping.discard(addr)
        conns = list(rec.conns.values())
        self._conn_count -= len(conns)
        rec.conns.clear()
        rec.judging.clear()
        rec.activity.clear()
        return conns

    # -- selection ----------------------------------------------------------------

    def reserve(self, exclude: Iterable[str] = ()) -> Reservation | None:
        """Pick the upstream for a new connection and count its dial in flight, so
        concurrent picks see each other; None when nothing is pickable."""
        with self.lock:
            addr = self._choose_locked(exclude)
            if addr is None:
                return None
            rec = self._ups[addr]
            rec.dialing += 1
            if exclude:
                skip = frozenset(exclude)
                alone = not any(r.state.pickable and a != addr and a not in skip
                                for a, r in self._ups.items())
            else:
                alone = self._pickable <= 1  # counted with the eligible list
            return Reservation(self.lock, rec, addr, alone=alone)

    def reserve_hedge(self, exclude: Iterable[str]) -> Reservation | None:
        """Pick and count the hedge of a connection whose dial in flight has stalled
        (Dialer): an ordinary pick among the pickable upstreams not in ``exclude`` that
        are not marked stalled; if none is left, :func:`hedge_last_resort` (a static
        fallback, or a stalled one). None when nothing is left at all."""
        skip = set(exclude)
        with self.lock:
            stalled = {a for a, r in self._ups.items() if r.stalled}
            addr = self._choose_locked(skip | stalled)
            if addr is None:
                addr = hedge_last_resort(
                    [Candidate(address=a, healthy=r.state.healthy, draining=r.state.draining,
                               fallback=r.state.fallback,
                               ready=r.state.readiness is Readiness.READY, tier=None,
                               active=len(r.conns) + r.dialing,
                               admin_drained=r.state.admin_drained, stalled=r.stalled,
                               last_success=r.last_success)
                     for a, r in self._ups.items()],
                    readyz=self._readyz, exclude=skip)
                if addr is None:
                    return None
            rec = self._ups[addr]
            rec.dialing += 1
            alone = not any(r.state.pickable and a != addr and a not in skip
                            for a, r in self._ups.items())
            return Reservation(self.lock, rec, addr, alone=alone,
                               panic=rec.state.fallback)

    def stall_dial(self, res: Reservation) -> None:
        """``res``'s dial has been in flight past --dial-hedge-delay (the Dialer says so,
        once per dial): its upstream is marked stalled until something succeeds there.
        New connections and hedges avoid marked upstreams while another is left."""
        with self.lock:
            if res.stalled or not res.held:
                return
            res.stalled = True
            rec = self._ups.get(res.address)
            if rec is not None and not rec.stalled:
                rec.stalled = True
                self._dial_stalls += 1

    def _clear_stall_locked(self, rec: Record) -> None:
        if rec.stalled:
            rec.stalled = False
            self._dial_stalls -= 1

    def reserve_endpoint(self, endpoint: Endpoint) -> Reservation | None:
        """Count a dial to ``endpoint`` chosen by panic mode; None if no longer known."""
        addr = str(endpoint)
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None:
                return None
            rec.dialing += 1
            return Reservation(self.lock, rec, addr, panic=True)

    def _candidates_locked(self) -> list[Candidate]:
        tier = self._latency.tier if self._latency_mode else None
        return [Candidate(address=a, healthy=r.state.healthy, draining=r.state.draining,
                          fallback=r.state.fallback,
                          ready=r.state.readiness is Readiness.READY,
                          tier=tier(a) if tier is not None else None,
                          active=len(r.conns) + r.dialing,
                          admin_drained=r.state.admin_drained)
                for a, r in self._ups.items()]

    def _choose_locked(self, exclude: Iterable[str]) -> str | None:
        if exclude:  # a retry or a hedge: rare, and the readyz rule applies after the exclusion
            skip = frozenset(exclude)
            candidates = self._candidates_locked()
            marked = self._marked_locked()
            if marked - skip:
                # The same rule as a first pick's (below): a suspect or dial-stalled
                # upstream takes a retry, or the first answer's hedge, only when nothing
                # else is left.
                addr = choose(candidates, mode=self._selection, readyz=self._readyz,
                              rng=self._rng, exclude=skip | marked)
                if addr is not None:
                    return addr
            return choose(candidates, mode=self._selection, readyz=self._readyz,
                          rng=self._rng, exclude=skip)
        # Every new connection's pick: the eligible list is kept while the records, their
        # (frozen, so replaced on change) states and the latency tiers stay the same; the
        # key costs two C-level tuple builds where the list cost a Candidate per upstream.
        ups = self._ups
        key = (tuple(ups), tuple(map(_STATE, ups.values())),
               self._latency.tier_map if self._latency_mode else None)
        if key != self._pool_key:
            candidates = self._candidates_locked()
            self._pool = [c.address for c in eligible(
                candidates, mode=self._selection, readyz=self._readyz)]
            self._pickable = sum(1 for c in candidates if sm.pickable(c))
        self._pool_key = key  # also when equal: the next comparison is by identity again
        pool = self._pool
        if (self._suspect or self._dial_stalls) and len(pool) > 1:
            # The stall check's suspects take no new connection while another can: a
            # request hanging there says new ones would too, until a check decides (the
            # leastconn effect of a server piling up hung connections, per node). So do
            # upstreams whose dial stalled with no success since (a black hole's dials
            # all stall): new connections reach a live one without first waiting out a
            # dead one's hedge delay, until the failures exclude it.
            marked = self._marked_locked()
            pool = [a for a in pool if a not in marked] or pool
        if self._ramping and len(pool) > 1:
            return self._pick_weighted_locked(pool)
        if self._selection == "least-conn" and len(pool) > 1:
            return pick(pool, rng=self._rng,
                        active=[len(ups[a].conns) + ups[a].dialing for a in pool])
        return pick(pool, rng=self._rng)

    def _marked_locked(self) -> frozenset[str]:
        """The upstreams a pick avoids while another is left: the stall check's suspects
        and those whose dial stalled with no success since."""
        if not self._dial_stalls:
            return self._suspect
        return self._suspect | {a for a, r in self._ups.items() if r.stalled}

    def _weight_locked(self, addr: str, now: float) -> float:
        """Slow start's weight of ``addr`` now; a finished ramp leaves the ramping set."""
        rec = self._ups[addr]
        if rec.ramp_start is None:
            return 1.0
        weight = balance.ramp_weight(now - rec.ramp_start, self._slow_start)
        if weight >= 1.0:
            rec.ramp_start = None
            self._ramping.discard(addr)
        return weight

    def _pick_weighted_locked(self, pool: list[str]) -> str | None:
        now = self._clock()
        weights = [self._weight_locked(a, now) for a in pool]
        ups = self._ups
        active = ([len(ups[a].conns) + ups[a].dialing for a in pool]
                  if self._selection == "least-conn" else None)
        return balance.pick_weighted(pool, weights, rng=self._rng, active=active)

    def _update_serving_locked(self, now: float) -> None:
        """Slow start: an upstream that starts serving (pickable, and ready with readyz)
        after it served before, or that was added to a serving list, or that a readyz
        probe had found not ready (a server of the first list that was down at start and
        comes up later), ramps from now."""
        readyz = self._readyz
        for addr, rec in self._ups.items():
            st = rec.state
            serving = sm.serving(st, readyz=readyz)
            if not serving and st.probed_ready:
                # Seen not serving by a probe, not merely unprobed: coming up later is a
                # recovery, even if it never served (new upstreams serve before their
                # first check only without readyz).
                rec.ramp_new = True
            if serving == rec.serving:
                continue
            rec.serving = serving
            if serving and (rec.served or rec.ramp_new):
                rec.ramp_start = now
                self._ramping.add(addr)
            elif not serving:
                rec.ramp_start = None
                self._ramping.discard(addr)
            rec.served = rec.served or serving

    def any_pickable(self, exclude: Iterable[str] = ()) -> bool:
        skip = frozenset(exclude)
        with self.lock:
            return any(r.state.pickable and a not in skip for a, r in self._ups.items())

    def panic_order(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """Every non-draining upstream, most recently successful first (panic mode)."""
        skip = frozenset(exclude)
        with self.lock:
            recs = [r for a, r in self._ups.items()
                    if not r.state.draining and not r.state.admin_drained and a not in skip]
            recs.sort(key=last_success, reverse=True)
            return [r.endpoint for r in recs]

    def _update_words_locked(self, now: float) -> None:
        """Recompute each upstream's state word; a change restarts its ``since``. Every
        state change ends here, so slow start's serving marks are kept here too."""
        if self._slow_start > 0:
            self._update_serving_locked(now)
        for rec in self._ups.values():
            word = sm.state_word(rec.state, closing_unready=rec.unready_deadline is not None)
            if word != rec.word:
                rec.word, rec.since = word, now

    def record_no_upstream(self) -> None:
        """A client was closed because no upstream was available."""
        with self.lock:
            self._turned_away += 1

    def _update_panic_locked(self, fx: Effects) -> None:
        panic = bool(self._ups) and not any(r.state.pickable for r in self._ups.values())
        if panic != self._panic:
            self._panic = panic
            drained = sum(1 for r in self._ups.values() if r.state.admin_drained)
            if panic and drained:
                # An operator's drain is kept even in panic: those are not tried.
                fx.log(logging.WARNING, "panic: no upstream is pickable; new connections try "
                       "every known upstream an operator has not drained upstreams=%d "
                       "admin_drained=%d", len(self._ups), drained)
            elif panic:
                fx.log(logging.WARNING, "panic: no upstream is healthy; new connections try "
                       "every known upstream upstreams=%d", len(self._ups))
            else:
                fx.log(logging.INFO, "panic over: an upstream is healthy again")

    # -- operator marks (upstreams.actions.AdminActions) ------------------------------

    @property
    def readyz(self) -> bool:
        """--health-check=readyz: readiness decides, not only TCP health."""
        return self._readyz

    @property
    def drain_timeout(self) -> float:
        return self._drain_timeout

    def known_addresses(self) -> list[str]:
        with self.lock:
            return list(self._ups)

    def set_admin(self, addr: str, action: str, uid: int, *, unless_closed: bool = False,
                  unless_alone: bool = False) -> AdminOutcome | None:
        """Set the operator's mark on ``addr`` ("drain" or "close"; "" clears it); None
        when the address is unknown.

        Checked in the same lock round trip as the change, which is skipped (``done``
        False) when ``unless_closed`` and an operator has closed it, or when
        ``unless_alone`` and no other pickable (and, with readyz, ready) upstream is
        left. A close plans the closes of its connections spread over --drain-timeout."""
        fx = Effects()
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None:
                return None
            before = rec.state.admin
            others = self._another_serves_locked(addr)
            done = not (unless_closed and before == "close") and not (unless_alone
                                                                        and not others)
            if done:
                self._set_admin_locked(addr, rec, action, uid, fx)
            outcome = AdminOutcome(before=before, state=rec.state, connections=len(rec.conns),
                                   others=others, done=done)
        self._run(fx)
        return outcome

    def _set_admin_locked(self, addr: str, rec: Record, action: str, uid: int,
                          fx: Effects) -> None:
        now = self._clock()
        rec.state = sm.admin_set(rec.state, action)
        rec.admin_mark = AdminMark(action, uid, now) if action else None
        rec.close_plan = []
        if action == "close":
            rec.plan_close(now, self._drain_timeout)
            if rec.close_plan:
                fx.log(logging.INFO, "closing connections upstream=%s connections=%d "
                       "reason=%r over=%gs", addr, len(rec.close_plan), "admin close",
                       max(0.0, self._drain_timeout))
            rec.close_due(now, fx)
        # The set of pickable (and ready) upstreams changed: readiness closes elsewhere
        # may start or be called off, panic may begin or end.
        self._update_readiness_deadlines_locked(now, fx)
        self._update_panic_locked(fx)
        self._update_words_locked(now)
        fx.changes.append(Change("health", addr))  # wakes the ticker for new deadlines

    # -- health -------------------------------------------------------------------

    def record_probe(self, addr: str, result: ProbeResult, *, stall: bool = False) -> bool:
        """Feed one health check (TCP, and readyz when enabled) into the state machine.

        ``stall``: a check a stall asked for (:meth:`_stalls_locked`); it counts like any
        other, and is also counted by result and logged once. True when the upstream now
        awaits the check that confirms a first failure
        (:func:`~extractedprism.upstreams.state.awaits_confirmation`): the ticker runs it
        after --health-recheck."""
        fx = Effects()
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None or rec.state.lifecycle not in sm.TAKES_CHECKS:
                return False  # checks stop while an upstream drains; removed ones are gone
            now = self._clock()
            rec.last_check_at = now
            if result.ok:
                rec.last_success = now
                self._clear_stall_locked(rec)
                if self._latency_mode and result.rtt is not None:
                    self._latency.observe(addr, result.rtt)
            before = rec.state
            state, transitions = sm.on_probe(rec.state, result, readyz=self._readyz)
            error = result.reason or result.ready_reason
            held = sm.slow_answer(result) and self._slow_not_counted_locked(addr, before)
            if held:
                state, transitions = self._not_counted_locked(addr, rec, before, error,
                                                            "probe", transitions, fx)
            rec.state = state
            confirm = sm.awaits_confirmation(rec.state) and not held
            if stall:
                self._stall_result_locked(addr, rec, result, now, fx)
            fx.transitions(addr, transitions)
            rec.failed_stalled = False  # this check decided; a failure below sets it again
            if error and not held:
                # A failed check (the first, or the one that excludes) closes the
                # connections stalled now: they wait on an answer a server failing its
                # checks is not giving; the rest wait for the confirming check.
                self._close_stalled_locked(addr, rec, now, fx, excluded=sm.excluded(state)
                                           and not sm.excluded(before))
            self._update_readiness_deadlines_locked(now, fx)
            self._update_panic_locked(fx)
            self._update_words_locked(now)
        # No change notice: the probe thread wakes the ticker when it finishes.
        self._run(fx)
        return confirm

    def _stall_result_locked(self, addr: str, rec: Record, result: ProbeResult, now: float,
                             fx: Effects) -> None:
        """A stall-triggered check's result: counted (extractedprism_stall_checks_total)
        and logged in one line with what asked for it."""
        error = result.reason or result.ready_reason
        outcome = STALL_FAILED if error else STALL_PASSED
        rec.stall_checks[outcome] = rec.stall_checks.get(outcome, 0) + 1
        why, rec.stall_trigger = rec.stall_trigger, None
        if why is None:  # asked for before the upstream was removed and added again
            why = StallTrigger(now, 0, 0.0, "")
        fx.log(logging.WARNING if error else logging.INFO,
               "stall check upstream=%s result=%s reason=%r stalled_connections=%d "
               "stalled_for=%.1fs client=%s took=%.1fs", addr, outcome, error, why.connections,
               why.stalled_for, why.client or "-", now - why.at)

    def record_dial(self, addr: str, ok: bool, reason: str = "", *, count_error: bool = True,
                    duration: float | None = None, slow: bool = False) -> None:
        """A client dial's outcome counts toward the same streak as health checks;
        ``duration`` (seconds, successful or not) feeds the dial-time histogram;
        ``slow``: connected, but no first answer within --health-timeout (what
        --overload-guard does not count while no faster upstream serves)."""
        with self.lock:
            fx = self._record_dial_locked(addr, ok, reason, count_error, duration, slow)
        if fx is not None:
            self._run(fx)

    def _record_dial_locked(self, addr: str, ok: bool, reason: str, count_error: bool,
                            duration: float | None, slow: bool) -> Effects | None:
        rec = self._ups.get(addr)
        if rec is None:
            return None  # removed: failures are not counted until it is added again
        if duration is not None:
            rec.dials.observe(duration)
        if not ok and count_error:
            rec.connection_errors += 1
        if rec.state.draining:
            return None
        if ok:
            rec.last_success = self._clock()
            self._clear_stall_locked(rec)
            if not sm.dial_success_changes(rec.state):
                return None  # nearly every connection: on_dial would change nothing
        state, transitions, probe = sm.on_dial(rec.state, ok, reason, readyz=self._readyz)
        if state is rec.state:
            return None  # the common case: nothing to change, nobody to wake
        fx = Effects()
        if slow and self._slow_not_counted_locked(addr, rec.state):
            state, transitions = self._not_counted_locked(addr, rec, rec.state, reason, "dial",
                                                        transitions, fx)
            probe = False
        recheck = not ok and sm.awaits_confirmation(state) and not sm.awaits_confirmation(
            rec.state)
        before, rec.state = rec.state, state
        now = self._clock()
        if not ok:
            rec.last_check_at = now
        fx.transitions(addr, transitions)
        if sm.excluded(state) and not sm.excluded(before):
            self._close_stalled_locked(addr, rec, now, fx, excluded=True)
        flipped = any(t.health_flipped for t in transitions)
        if flipped:
            self._update_readiness_deadlines_locked(now, fx)
        self._update_panic_locked(fx)
        self._update_words_locked(now)
        if probe:
            fx.changes.append(Change("probe-now", addr))
        elif recheck:
            fx.changes.append(Change("recheck", addr))
        if flipped:
            fx.changes.append(Change("health", addr))
        return fx

    def record_answer_hedge(self, addr: str, outcome: str) -> None:
        """A hedged first answer's outcome for ``addr`` ("won", "lost", "silent")."""
        with self.lock:
            rec = self._ups.get(addr)
            if rec is not None:
                rec.answer_hedges[outcome] = rec.answer_hedges.get(outcome, 0) + 1

    # -- readiness-driven connection moves ----------------------------------------

    def _update_readiness_deadlines_locked(self, now: float, fx: Effects) -> None:
        if self._readyz:
            readiness_moves(self._ups, now, self._unready_drain_timeout, fx)

    def tick(self) -> float | None:
        """Expire drain and readiness deadlines; return the next deadline, if any."""
        fx = Effects()
        with self.lock:
            now = self._clock()
            for addr, rec in list(self._ups.items()):
                if (rec.state.draining and rec.drain_deadline is not None
                        and now >= rec.drain_deadline):
                    fx.log(logging.INFO, "upstream drain timeout; force-closing upstream=%s "
                           "connections=%d", addr, len(rec.conns))
                    fx.close.extend(self._remove_locked(addr))
            self._update_readiness_deadlines_locked(now, fx)
            for rec in self._ups.values():
                rec.close_due(now, fx)
            self._update_panic_locked(fx)
            self._update_words_locked(now)
            deadlines = [d for r in self._ups.values()
                         for d in (r.drain_deadline, r.unready_deadline,
                                   r.close_plan[0][0] if r.close_plan else None)
                         if d is not None]
        self._run(fx)
        return min(deadlines) if deadlines else None

    # -- rebalancing (upstreams.rebalancer.Rebalancer runs the rounds) ---------------

    @property
    def rebalancing(self) -> bool:
        return self._rebalance is not None

    def sample_activity(self) -> None:
        """Note which live connections moved bytes since the last sample (their pipes
        count live; this only reads the counts, so the relay does no extra work), and,
        with --stall-timeout, which stalled: a stall asks the ticker for a check of its
        upstream (after the lock is released)."""
        fx = Effects()
        with self.lock:
            self._sample_locked(self._clock(), fx)
        self._run(fx)

    def _sample_locked(self, now: float, fx: Effects) -> None:
        # A connection's Activity starts at the first sample that sees it, not in attach:
        # a new connection's pick costs nothing more with sampling on, and its age and
        # quiet time err short by at most one sample period (never long).
        timeout = self._stall_timeout
        suspect = []
        for addr, rec in self._ups.items():
            stalled = self._sample_record_locked(rec, now, timeout)
            if stalled:
                suspect.append(addr)
                self._stalls_locked(addr, rec, now, stalled, fx)
            elif rec.failed_stalled:
                suspect.append(addr)
        if suspect or self._suspect:
            self._suspect = frozenset(suspect)

    @staticmethod
    def _sample_record_locked(rec: Record, now: float, timeout: float
                              ) -> list[tuple[float, Tracked, Activity]]:
        """Sample ``rec``'s connections; returns those stalled now (``timeout``: the
        stall timeout, 0: none) as (unanswered for, connection, activity)."""
        # One pass, and only two attribute reads for a connection that moved nothing:
        # this runs under the registry lock every sample period for every connection.
        # bytes_up is read before up_answered: the mark only grows and never passes
        # bytes_up, so a read racing the relay errs toward "answered", never toward a
        # stall that was not.
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

    def _stalls_locked(self, addr: str, rec: Record, now: float,
                       stalled: list[tuple[float, Tracked, Activity]], fx: Effects) -> None:
        """Count ``addr``'s newly ``stalled`` connections; a stall that wants a look
        (:meth:`~extractedprism.upstreams.activity.Activity.wants_look`: its first, or a
        second one while still unanswered) asks for one now (Change "stall-check": the
        ticker runs its next check at once), at most once per --stall-timeout, and only
        of an upstream that takes checks and is not excluded (an excluded one is checked
        anyway, and loses nothing)."""
        for _, _, act in stalled:
            if not act.stalled:
                act.stalled = True
                rec.stalls += 1
        due = [act for _, _, act in stalled if act.wants_look(now, self._stall_timeout)]
        if not due:
            return
        if rec.state.lifecycle not in sm.TAKES_CHECKS or sm.excluded(rec.state):
            return
        if rec.stall_check_at is not None and now - rec.stall_check_at < self._stall_timeout:
            return  # the rate limit: the next sample after it asks again
        for act in due:
            act.looked_now(now)
        oldest = max(stalled, key=_first)
        rec.stall_check_at = now
        rec.stall_trigger = StallTrigger(now, len(stalled), oldest[0], oldest[1].client)
        fx.changes.append(Change("stall-check", addr))

    def _close_stalled_locked(self, addr: str, rec: Record, now: float, fx: Effects, *,
                              excluded: bool) -> None:
        """A check of ``addr`` failed (``excluded``: and failed checks just took it out of
        service): its connections stalled right now are closed at once, while another
        upstream serves (the rest keep --unready-drain-timeout once it is excluded). They
        wait on an answer an upstream failing its checks is not giving: there is nothing
        to drain, and the client reconnects to a serving one. Until its next check
        decides, picks avoid it like a suspect, so the reconnect does not land on the
        upstream it just left. Only with --stall-timeout."""
        if self._stall_timeout <= 0 or not self._another_serves_locked(addr):
            return
        conns = [c for _, c, _ in self._sample_record_locked(rec, now, self._stall_timeout)]
        if conns:
            if not excluded:
                rec.failed_stalled = True
                self._suspect = self._suspect | {addr}
            fx.log(logging.INFO, "closing stalled connections upstream=%s connections=%d "
                   "reason=%r", addr, len(conns),
                   "excluded by failed checks" if excluded else "a check failed")
            fx.close.extend(conns)  # pipes detach themselves when they notice the close

    def _another_serves_locked(self, addr: str) -> bool:
        """Another upstream takes new connections in the normal course (sm.serving)."""
        readyz = self._readyz
        return any(a != addr and sm.serving(r.state, readyz=readyz)
                   for a, r in self._ups.items())

    def _slow_not_counted_locked(self, addr: str, before: UpstreamState) -> bool:
        """--overload-guard: is this slow answer (connected, then nothing within
        --health-timeout) the control plane's rather than this upstream's? It counts only
        against a faster peer: another upstream in service whose latest check (or dial)
        succeeded and that has no stalled connection. Without one, every upstream serving
        is slow (or it is the last one serving): the survivors of a fault overloaded by
        the clients it moved, or a control plane saturated as a whole. Counting then
        would take them out of service in turn, close their connections and send every
        client into new handshakes and re-lists on the others: the overload feeding
        itself. A frozen upstream beside healthy ones still counts, at once."""
        if not self._overload_guard or not sm.serving(before, readyz=self._readyz):
            return False
        readyz = self._readyz
        marked = self._marked_locked()
        return not any(a != addr and a not in marked and not r.state.last_check_error
                       and sm.serving(r.state, readyz=readyz)
                       for a, r in self._ups.items())

    def _not_counted_locked(self, addr: str, rec: Record, before: UpstreamState, error: str,
                            source: str, transitions: list[Transition], fx: Effects
                            ) -> tuple[UpstreamState, list[Transition]]:
        """Do not count the slow answer :meth:`_slow_not_counted_locked` found: the
        streaks stay, the error shows as the latest check's (so this upstream is not
        anyone's faster peer either), one warning says why."""
        rec.slow_not_counted += 1
        fx.log(logging.WARNING, "slow answer not counted upstream=%s reason=%r source=%s "
               "why=%r", addr, error, source,
               "no other upstream in service answers in time (--overload-guard)")
        return sm.kept(before, error, source), [t for t in transitions if t.kind == "check"]

    def _rebalance_blocker_locked(self) -> tuple[str, str] | None:
        """(reason, upstream) when another mechanism is moving connections right now."""
        if self._panic:
            return balance.PANIC, ""
        for addr, rec in self._ups.items():
            if rec.state.draining:
                return balance.DRAINING, addr
            if rec.unready_deadline is not None:
                return balance.CLOSING_UNREADY, addr
            if rec.close_plan:
                return balance.ADMIN_CLOSE, addr
        return None

    def _loads_locked(self) -> list[balance.Load]:
        """The upstreams new connections may go to (pickable; ready ones with readyz; the
        lowest tier with latency) with their live connections and weights."""
        pool = eligible(self._candidates_locked(), mode=self._selection, readyz=self._readyz)
        now = self._clock()
        return [balance.Load(c.address, len(self._ups[c.address].conns),
                             self._weight_locked(c.address, now)) for c in pool]

    def rebalance(self, trigger: str = "interval") -> RebalanceView:
        """One rebalance round (see :mod:`extractedprism.upstreams.balance`): close at
        most one quiet connection of the most loaded upstream, with a FIN both ways,
        after the lock is released. Returns the round's outcome; a no-op view when
        rebalancing is off."""
        fx = Effects()
        with self.lock:
            view = self._rebalance
            if view is None:
                return RebalanceView(0.0, self._rebalance_quiet, last_reason="off")
            now = self._clock()
            self._sample_locked(now, fx)
            reason, detail, acted = self._round_locked(now, trigger, fx)
            view = self._rebalance = dataclasses.replace(
                view, rounds=view.rounds + 1, closes=view.closes + acted,
                last_round_at=now, last_reason=reason, last_detail=detail,
                last_acted_at=now if acted else view.last_acted_at)
        self._run(fx)
        return view

    def _round_locked(self, now: float, trigger: str, fx: Effects) -> tuple[str, str, bool]:
        blocked = self._rebalance_blocker_locked()
        if blocked is not None:
            return blocked[0], blocked[1], False
        loads = self._loads_locked()
        verdict = balance.judge(loads)
        if verdict.over is None:
            return verdict.reason, "", False
        rec = self._ups[verdict.over]
        acts = rec.activity
        victim = balance.choose_quiet(
            (balance.Quiet(k, now - a.attached, now - a.active) for k, a in acts.items()),
            quiet=self._rebalance_quiet, min_age=self._rebalance_interval)
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
        detail = f"closed a connection of {verdict.over} ({counts})"
        return balance.ACTED, detail, True

    # -- connections --------------------------------------------------------------

    def attach(self, target: Reservation | str, conn: Tracked) -> bool:
        """Track a connection whose carrier is known (the reservation ends here, attached
        or not) and count it; False if the upstream drains or left meanwhile.

        The reservation's dial succeeded: recorded here, in the same lock round trip. A
        plain address attaches without a reservation and records nothing (the first
        upstream after a hedge, tests, tools)."""
        with self.lock:
            ok, fx = self._attach_locked(target, conn, judging=False)
        if fx is not None:
            self._run(fx)
        return ok

    def attach_judging(self, res: Reservation, conn: Tracked) -> bool | None:
        """attach() before the silent-upstream check has judged the dial, so the check
        and the relay can run as one native call (Pipe.run_judged). The connection is
        live (drains, shutdown and /upstreams see it) but not counted until it carries
        (see :meth:`_settle_locked`): a silent or left verdict detaches it uncounted.

        Only where the dial's success changes nothing about the upstream (no streak to
        clear, no readiness to reset: the common case), so a silent verdict recorded after
        it (FirstAnswer.judged) counts exactly as if the check had come first. None: it
        would change something; nothing was done, and the caller judges first and then
        calls attach()."""
        with self.lock:
            rec = self._ups.get(res.address)
            if rec is not None and not rec.state.draining and sm.dial_success_changes(
                    rec.state):
                return None
            ok, fx = self._attach_locked(res, conn, judging=True)
        assert fx is None  # a success that changes nothing has no effects
        return ok

    def _attach_locked(self, target: Reservation | str, conn: Tracked, *, judging: bool
                       ) -> tuple[bool, Effects | None]:
        fx = None
        if isinstance(target, Reservation):
            target.take_locked()
            addr = target.address
            fx = self._record_dial_locked(addr, True, "", True, target.dial_seconds, False)
        else:
            addr = target
        rec = self._ups.get(addr)
        ok = not (rec is None or rec.state.draining or rec.state.admin_drained
                  or self._closing)
        if ok:
            assert rec is not None
            key = id(conn)
            rec.conns[key] = conn
            self._conn_count += 1
            if judging:
                rec.judging.add(key)
            else:
                self._count_locked(rec)
        return ok, fx

    def _count_locked(self, rec: Record) -> None:
        """The one place a connection is counted (connections_total and its upstream's
        total): once, on the upstream that carries it. That is known at attach(), or, for
        a connection attached while its relay judges the first answer, when the relay
        carries bytes (_settle_locked) or ends answered (detach)."""
        rec.total_connections += 1
        self._connections_total += 1

    def _settle_locked(self) -> None:
        """Count the judging connections whose relay carries bytes by now: the native relay
        moves none before the upstream answered (nothing on a silent verdict), so a byte
        either way means this upstream carries the connection. Run before every read of
        the totals, so no reader sees a connection that carries uncounted."""
        for rec in self._ups.values():
            if rec.judging:
                self._settle_record_locked(rec)

    def _settle_record_locked(self, rec: Record) -> None:
        for key in [k for k in rec.judging
                    if rec.conns[k].bytes_up or rec.conns[k].bytes_down]:
            rec.judging.discard(key)
            self._count_locked(rec)

    def detach(self, addr: str, conn: Tracked, *, carried: bool = True) -> None:
        """The connection ended. ``carried``: False when its relay found the upstream
        silent or the client gone before it answered (a judging connection is then never
        counted)."""
        with self.lock:
            rec = self._ups.get(addr)
            key = id(conn)
            if rec is None or rec.conns.pop(key, None) is None:
                return
            if rec.judging and key in rec.judging:
                rec.judging.discard(key)
                if carried:
                    self._count_locked(rec)
            if rec.activity:
                rec.activity.pop(key, None)
            self._conn_count -= 1
            if rec.close_plan:  # it ended before its admin close came
                rec.close_plan = [(t, i) for t, i in rec.close_plan if i != key]
            rec.bytes_up += conn.bytes_up
            rec.bytes_down += conn.bytes_down
            if not (rec.state.draining and not rec.conns):
                return
            self._remove_locked(addr)
        log.info("upstream drained upstream=%s", addr)

    def close_all(self) -> int:
        """Shutdown: refuse new attaches and force-close every live connection."""
        fx = Effects()
        with self.lock:
            self._closing = True
            fx.close = [c for r in self._ups.values() for c in r.conns.values()]
        self._run(fx)
        return len(fx.close)

    def live_connections(self) -> list[Tracked]:
        """Every tracked connection, oldest first (the shutdown drain closes them one
        by one, outside the lock)."""
        with self.lock:
            conns = [c for up in self._ups.values() for c in up.conns.values()]
        conns.sort(key=started)
        return conns

    @property
    def closing(self) -> bool:
        return self._closing

    # -- reading --------------------------------------------------------------------

    def probe_targets(self) -> list[Endpoint]:
        with self.lock:
            return [r.endpoint for r in self._ups.values()
                    if r.state.lifecycle in sm.TAKES_CHECKS]

    def snapshot(self, *, connections: bool = False) -> Snapshot:
        """A frozen copy of every upstream (and, if asked, every live connection)."""
        with self.lock:
            self._settle_locked()
            latency, readyz = self._latency_mode, self._readyz
            now, wall = self._clock(), self._wall()
            slow = self._slow_start > 0
            stall = self._stall_timeout
            shares = (balance.fair_shares(self._loads_locked())
                      if slow or self._rebalance is not None else {})
            views = tuple(
                r.view(addr, readyz=readyz,
                       tier=self._latency.tier(addr) if latency else None,
                       rtt=self._latency.average(addr) if latency else None,
                       weight=self._weight_locked(addr, now) if slow else None,
                       fair_share=shares.get(addr), overload_guard=self._overload_guard,
                       **(self._stall_view_locked(r, now) if stall > 0 else {}))
                for addr, r in sorted(self._ups.items())
            )
            conns = tuple(ConnView(c.client, a, c.started, c.bytes_up, c.bytes_down)
                          for a, r in self._ups.items() for c in r.conns.values()
                          ) if connections else ()
            return Snapshot(
                upstreams=views,
                connections_active=self._conn_count,
                max_connections=self._max_connections,
                panic=self._panic,
                latency_mode=latency,
                readyz_mode=readyz,
                connections_total=self._connections_total,
                connections=conns,
                turned_away=self._turned_away,
                taken_mono=now,
                taken_wall=wall,
                rebalance=self._rebalance,
                stall_timeout=stall,
                overload_guard=self._overload_guard,
            )

    def _stall_view_locked(self, rec: Record, now: float) -> dict[str, int]:
        """The stall check's part of an upstream's view (at the last sample)."""
        acts = rec.activity
        return {"stalls": rec.stalls,
                "stalled_connections": sum(1 for a in acts.values()
                                           if a.is_stalled(now, self._stall_timeout))}

    def healthy(self) -> bool:
        """At least one upstream is pickable (the proxy's /readyz)."""
        with self.lock:
            return any(r.state.pickable for r in self._ups.values())
