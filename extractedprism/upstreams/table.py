"""The registry's table: every upstream's record, the one lock, and the derived marks
every policy reads.

The rooms acting on the table (``registry.Registry`` builds them) each own one policy:

* :mod:`~extractedprism.upstreams.membership`: the endpoint list, operator marks, deadlines;
* :mod:`~extractedprism.upstreams.picks`: reserve, hedge, last resort, panic order;
* :mod:`~extractedprism.upstreams.verdicts`: probe and dial results, the overload guard;
* :mod:`~extractedprism.upstreams.stalls`: connection sampling and the stall check;
* :mod:`~extractedprism.upstreams.connections`: attach, detach, counting, shutdown;
* :mod:`~extractedprism.upstreams.rounds`: the rebalancer's rounds.

The table owns what several rooms read: the records (``ups``), the counters, the panic
flag, the state words and slow start's serving marks (all recomputed in one place,
:meth:`refresh_locked`), and the two marks picks avoid (:meth:`marked_locked`): the stall
check's suspects and dial stalls. Who may take a connection is decided in one function,
:func:`~extractedprism.upstreams.eligibility.eligible`, over the table's
:meth:`candidates_locked`.

Fields guarded by ``lock``: everything below and in each record. Nothing here or in a
room does I/O, logging or callbacks while holding it: sockets to close, log lines and
change notices go into an :class:`~extractedprism.upstreams.effects.Effects`, run by
:meth:`run` after the lock is released.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams import balance
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.effects import Change, Effects
from extractedprism.upstreams.eligibility import Candidate, eligible
from extractedprism.upstreams.latency import LatencyTiers
from extractedprism.upstreams.policies import policy_for
from extractedprism.upstreams.records import Record, Tracked, readiness_moves, started
from extractedprism.upstreams.snapshot import ConnView, RebalanceView, Snapshot
from extractedprism.upstreams.state import Readiness

log = logging.getLogger("extractedprism.upstreams.registry")


class Table:
    """Upstream records, counters and derived marks behind one RLock."""

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
        health_interval: float = 5.0,
        health_timeout: float = 1.0,
    ) -> None:
        self.lock = threading.RLock()
        self.policy = policy_for(selection)
        self.latency_mode = self.policy.wants_tiers
        self._readyz = readyz
        self._drain_timeout = drain_timeout
        # None: the same as --drain-timeout (the spec gives both cases one grace period).
        self.unready_drain_timeout = (drain_timeout if unready_drain_timeout is None
                                      else unready_drain_timeout)
        self.max_connections = max_connections
        self.clock = clock
        self.wall = wall_clock
        self.rng = rng or random.Random()
        self.on_change = on_change
        self.ups: dict[str, Record] = {}
        self.latency = LatencyTiers()
        self.panic = False
        self.conn_count = 0
        self.connections_total = 0
        self.turned_away = 0
        self._closing = False
        self.rebalance_interval = rebalance_interval
        self.rebalance_quiet = rebalance_quiet
        self.rebalance: RebalanceView | None = (
            RebalanceView(rebalance_interval, rebalance_quiet) if rebalance_interval > 0
            else None)
        # Slow start (0: off) and the upstreams ramping now: picks weigh only while it is
        # non-empty, so with slow start off (or no ramp running) a pick costs what it did.
        self.slow_start = slow_start
        self.ramping: set[str] = set()
        self.stall_timeout = stall_timeout
        self.overload_guard = overload_guard
        # How long an upstream answering no check may go before the overload guard stops
        # holding its slow answers back (verdicts.Verdicts.guard_holds).
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        # The marks (eligibility rule, step 3): the stall check's suspects at the last
        # sample (stalls.Stalls), and how many records carry a dial stall. ``marks_epoch``
        # changes whenever either does, so picks' cached pool knows.
        self.suspect: frozenset[str] = frozenset()
        self.dial_stalls = 0
        self.marks_epoch = 0

    # -- plumbing -----------------------------------------------------------------

    def run(self, fx: Effects) -> None:
        """Carry out ``fx`` (the lock released)."""
        fx.run(log, self.on_change)

    @property
    def readyz(self) -> bool:
        """--health-check=readyz: readiness decides, not only TCP health."""
        return self._readyz

    @property
    def drain_timeout(self) -> float:
        return self._drain_timeout

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def rebalancing(self) -> bool:
        return self.rebalance is not None

    def set_closing_locked(self) -> None:
        self._closing = True

    # -- the marks ------------------------------------------------------------------

    def set_suspect_locked(self, suspect: frozenset[str]) -> None:
        if suspect != self.suspect:
            self.suspect = suspect
            self.marks_epoch += 1

    def mark_dial_stall_locked(self, rec: Record) -> None:
        """A dial to ``rec`` stalled (picks.Picks.stall_dial)."""
        if not rec.stalled:
            rec.stalled = True
            self.dial_stalls += 1
            self.marks_epoch += 1

    def clear_dial_stall_locked(self, rec: Record) -> None:
        """A success there: a check, or a dial (the stalled one completing included)."""
        if rec.stalled:
            rec.stalled = False
            self.dial_stalls -= 1
            self.marks_epoch += 1

    def marked_locked(self) -> frozenset[str]:
        """The upstreams the rule's step 3 avoids while another is left."""
        if not self.dial_stalls:
            return self.suspect
        return self.suspect | {a for a, r in self.ups.items() if r.stalled}

    # -- the rule's input -------------------------------------------------------------

    def candidates_locked(self) -> list[Candidate]:
        tier = self.latency.tier if self.latency_mode else None
        marked = self.marked_locked()
        return [Candidate(address=a, healthy=r.state.healthy, draining=r.state.draining,
                          ready=r.state.readiness is Readiness.READY,
                          tier=tier(a) if tier is not None else None,
                          active=len(r.conns) + r.dialing, fallback=r.state.fallback,
                          admin_drained=r.state.admin_drained, marked=a in marked,
                          last_success=r.last_success)
                for a, r in self.ups.items()]

    def eligible_locked(self, exclude: frozenset[str] = frozenset()) -> list[Candidate]:
        return eligible(self.candidates_locked(), readyz=self._readyz, policy=self.policy,
                        exclude=exclude)

    def weight_locked(self, addr: str, now: float) -> float:
        """Slow start's weight of ``addr`` now; a finished ramp leaves the ramping set."""
        rec = self.ups[addr]
        if rec.ramp_start is None:
            return 1.0
        weight = balance.ramp_weight(now - rec.ramp_start, self.slow_start)
        if weight >= 1.0:
            rec.ramp_start = None
            self.ramping.discard(addr)
        return weight

    def loads_locked(self) -> list[balance.Load]:
        """What new picks may take (the one rule, marks included), with live connections
        and weights: the rebalancer's fair shares are computed over exactly this."""
        now = self.clock()
        return [balance.Load(c.address, len(self.ups[c.address].conns),
                             self.weight_locked(c.address, now)) for c in self.eligible_locked()]

    def another_serves_locked(self, addr: str) -> bool:
        """Another upstream takes new connections in the normal course (sm.serving)."""
        readyz = self._readyz
        return any(a != addr and sm.serving(r.state, readyz=readyz)
                   for a, r in self.ups.items())

    # -- derived state, recomputed in one place ----------------------------------------

    def refresh_locked(self, now: float, fx: Effects, *, deadlines: bool = True) -> None:
        """After any state change: readiness close deadlines (``deadlines``), panic, slow
        start's serving marks and the state words."""
        if deadlines and self._readyz:
            readiness_moves(self.ups, now, self.unready_drain_timeout, fx)
        self._update_panic_locked(fx)
        if self.slow_start > 0:
            self._update_serving_locked(now)
        for rec in self.ups.values():
            word = sm.state_word(rec.state, closing_unready=rec.unready_deadline is not None)
            if word != rec.word:
                rec.word, rec.since = word, now

    def _update_panic_locked(self, fx: Effects) -> None:
        panic = bool(self.ups) and not any(r.state.pickable for r in self.ups.values())
        if panic == self.panic:
            return
        self.panic = panic
        drained = sum(1 for r in self.ups.values() if r.state.admin_drained)
        if panic and drained:
            # An operator's drain is kept even in panic: those are not tried.
            fx.log(logging.WARNING, "panic: no upstream is pickable; new connections try "
                   "every known upstream an operator has not drained upstreams=%d "
                   "admin_drained=%d", len(self.ups), drained)
        elif panic:
            fx.log(logging.WARNING, "panic: no upstream is healthy; new connections try "
                   "every known upstream upstreams=%d", len(self.ups))
        else:
            fx.log(logging.INFO, "panic over: an upstream is healthy again")

    def _update_serving_locked(self, now: float) -> None:
        """Slow start: an upstream that starts serving (pickable, and ready with readyz)
        after it served before, or that was added to a serving list, or that a readyz
        probe had found not ready, ramps from now."""
        readyz = self._readyz
        for addr, rec in self.ups.items():
            st = rec.state
            serving = sm.serving(st, readyz=readyz)
            if not serving and st.probed_ready:
                # Seen not serving by a probe, not merely unprobed: coming up later is a
                # recovery, even if it never served.
                rec.ramp_new = True
            if serving == rec.serving:
                continue
            rec.serving = serving
            if serving and (rec.served or rec.ramp_new):
                rec.ramp_start = now
                self.ramping.add(addr)
            elif not serving:
                rec.ramp_start = None
                self.ramping.discard(addr)
            rec.served = rec.served or serving

    # -- records and counts ---------------------------------------------------------------

    def remove_locked(self, addr: str) -> list[Tracked]:
        """Forget ``addr``; returns its live connections (to close after the lock)."""
        rec = self.ups.pop(addr)
        self.clear_dial_stall_locked(rec)
        if addr in self.suspect:
            self.set_suspect_locked(self.suspect - {addr})
        if rec.judging:  # the ones carrying bytes are counted before the record goes
            self.settle_record_locked(rec)
        self.latency.remove(addr)
        self.ramping.discard(addr)
        conns = list(rec.conns.values())
        self.conn_count -= len(conns)
        rec.conns.clear()
        rec.judging.clear()
        rec.activity.clear()
        return conns

    def count_locked(self, rec: Record) -> None:
        """The one place a connection is counted (connections_total and its upstream's
        total): once, on the upstream that carries it (connections.Connections)."""
        rec.total_connections += 1
        self.connections_total += 1

    def settle_locked(self) -> None:
        """Count the judging connections whose relay carries bytes by now: a byte either
        way means this upstream carries the connection. Run before every read of the
        totals, so no reader sees a connection that carries uncounted."""
        for rec in self.ups.values():
            if rec.judging:
                self.settle_record_locked(rec)

    def settle_record_locked(self, rec: Record) -> None:
        for key in [k for k in rec.judging
                    if rec.conns[k].bytes_up or rec.conns[k].bytes_down]:
            rec.judging.discard(key)
            self.count_locked(rec)

    # -- reading ------------------------------------------------------------------------

    def known_addresses(self) -> list[str]:
        with self.lock:
            return list(self.ups)

    def probe_targets(self) -> list[Endpoint]:
        with self.lock:
            return [r.endpoint for r in self.ups.values()
                    if r.state.lifecycle in sm.TAKES_CHECKS]

    def healthy(self) -> bool:
        """At least one upstream is pickable (the proxy's /readyz)."""
        with self.lock:
            return any(r.state.pickable for r in self.ups.values())

    def live_connections(self) -> list[Tracked]:
        """Every tracked connection, oldest first (the shutdown drain closes them one by
        one, outside the lock)."""
        with self.lock:
            conns = [c for up in self.ups.values() for c in up.conns.values()]
        conns.sort(key=started)
        return conns

    def snapshot(self, *, connections: bool = False) -> Snapshot:
        """A frozen copy of every upstream (and, if asked, every live connection)."""
        with self.lock:
            self.settle_locked()
            latency, readyz = self.latency_mode, self._readyz
            now, wall = self.clock(), self.wall()
            slow = self.slow_start > 0
            stall = self.stall_timeout
            shares = (balance.fair_shares(self.loads_locked())
                      if slow or self.rebalance is not None else {})
            views = tuple(
                r.view(addr, readyz=readyz,
                       tier=self.latency.tier(addr) if latency else None,
                       rtt=self.latency.average(addr) if latency else None,
                       weight=self.weight_locked(addr, now) if slow else None,
                       fair_share=shares.get(addr), overload_guard=self.overload_guard,
                       **({"stalls": r.stalls, "stalled_connections": sum(
                           1 for a in r.activity.values() if a.is_stalled(now, stall)),
                           "suspect": addr in self.suspect} if stall > 0 else {}))
                for addr, r in sorted(self.ups.items()))
            conns = tuple(ConnView(c.client, a, c.started, c.bytes_up, c.bytes_down)
                          for a, r in self.ups.items() for c in r.conns.values()
                          ) if connections else ()
            return Snapshot(
                upstreams=views, connections_active=self.conn_count,
                max_connections=self.max_connections, panic=self.panic,
                latency_mode=latency, readyz_mode=readyz,
                connections_total=self.connections_total, connections=conns,
                turned_away=self.turned_away, taken_mono=now, taken_wall=wall,
                rebalance=self.rebalance, stall_timeout=stall,
                overload_guard=self.overload_guard)
