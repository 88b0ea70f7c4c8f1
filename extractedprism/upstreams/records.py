"""The registry's per-upstream record and its frozen view.

Owns the fields the registry's lock guards for one upstream address: its state
(:class:`~extractedprism.upstreams.state.UpstreamState`), live connections, deadlines,
operator marks and counters, how they become an
:class:`~extractedprism.upstreams.snapshot.UpstreamView`, and the readiness-driven connection
moves over all records. Only registry methods (under the lock) touch a record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.activity import Activity
from extractedprism.upstreams.dialstats import DialHistogram
from extractedprism.upstreams.effects import Effects
from extractedprism.upstreams.snapshot import AdminMark, UpstreamView
from extractedprism.upstreams.state import UpstreamState


class Tracked(Protocol):
    """What the registry needs of a live connection (implemented by pipe.Pipe)."""

    client: str
    started: float
    bytes_up: int
    bytes_down: int
    up_answered: int  # bytes_up when the upstream's latest bytes were read (stall check)

    def close(self) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class StallTrigger:
    """What a stall-triggered check was asked for: the stalled connections then, how
    long the oldest had gone unanswered, and its client."""

    at: float
    connections: int
    stalled_for: float
    client: str


@dataclass
class Record:
    """What the registry keeps per upstream address (guarded by its lock)."""

    endpoint: Endpoint
    state: UpstreamState = field(default_factory=UpstreamState)
    conns: dict[int, Tracked] = field(default_factory=dict)
    # Live connections whose relay still judges the first answer (Connections.attach_judging):
    # not counted in the totals until they carry bytes or end answered.
    judging: set[int] = field(default_factory=set)
    dialing: int = 0  # picked, dial in progress: counts for least-conn
    # A dial to it has been in flight past --dial-hedge-delay (Picks.stall_dial) and
    # nothing has succeeded there since (a check, or a dial: the stalled one connecting
    # included): picks avoid it while another is eligible (the rule's step 3).
    stalled: bool = False
    drain_deadline: float | None = None
    unready_deadline: float | None = None
    last_success: float = 0.0
    # The operator's view: the state word and when it last changed, the last check.
    word: str = "healthy"
    since: float = 0.0
    last_check_at: float | None = None
    admin_mark: AdminMark | None = None
    # An admin close: (when, id(conn)) in time order, the last one at +--drain-timeout.
    close_plan: list[tuple[float, int]] = field(default_factory=list)
    dials: DialHistogram = field(default_factory=DialHistogram)
    # Counters, exported at scrape time; they go when the record goes.
    total_connections: int = 0
    connection_errors: int = 0
    # extractedprism_answer_hedges_total by outcome ("won", "lost", "silent")
    answer_hedges: dict[str, int] = field(default_factory=dict)
    bytes_up: int = 0  # of finished connections
    bytes_down: int = 0
    sources: tuple[str, ...] = ()  # the providers listing it (roles.Roles)
    # Rebalancing and the stall check (--rebalance-interval, --stall-timeout): id(conn)
    # -> its Activity (conn-sampler), and the closes rebalancing made.
    activity: dict[int, Activity] = field(default_factory=dict)
    rebalance_closes: int = 0
    # The stall check (--stall-timeout): stalls counted (one per unanswered stretch of a
    # connection), the stall-triggered checks' results ("failed", "passed"), when the
    # last one was asked for (the rate limit), and what it was asked for (the log line
    # of its result; None once that result is in).
    stalls: int = 0
    stall_checks: dict[str, int] = field(default_factory=dict)
    # A check failed while a connection of it was stalled (the stalled ones were closed):
    # picks avoid it like a suspect until its next check decides (Verdicts.record_probe).
    failed_stalled: bool = False
    # When its latest check passed (TCP, and readyz with readyz; the record's creation
    # before the first): stalls that began before it no longer mark it (a check passed
    # after they began: the stall is the client's quiet stream, not this server's), and
    # the overload guard holds back slow answers only within a bound after it.
    passed_at: float = 0.0
    # --overload-guard: slow answers not counted because no faster upstream served.
    slow_not_counted: int = 0
    stall_check_at: float | None = None
    stall_trigger: StallTrigger | None = None
    # Slow start (--slow-start): serving now (pickable, and ready with readyz); has
    # served since it was added; ramps on its first serve (added to a list that already
    # served); when its current ramp began (None: full weight).
    serving: bool = False
    served: bool = False
    ramp_new: bool = False
    ramp_start: float | None = None

    def set_role(self, addr: str, demoted: bool, fx: Effects) -> None:
        """Demoted to a fallback (a static endpoint discovery does not list) or back."""
        if self.state.fallback == demoted:
            return
        self.state = sm.listed(self.state, fallback=demoted)
        if demoted:
            fx.log(logging.INFO, "upstream kept as a fallback upstream=%s reason=%r", addr,
                   "static endpoint not in discovery's list")
        else:
            fx.log(logging.INFO, "upstream fallback over upstream=%s reason=%r", addr,
                   "listed by discovery")

    def plan_close(self, now: float, over: float) -> None:
        """An operator's close: each live connection's close, oldest first, spread over
        ``over`` seconds (:func:`spread`)."""
        self.close_plan = spread(list(self.conns), now, over)  # attach order: oldest first

    def close_due(self, now: float, fx: Effects) -> None:
        """Hand the connections whose planned close time has come to ``fx``."""
        while self.close_plan and self.close_plan[0][0] <= now:
            _, conn_id = self.close_plan.pop(0)
            conn = self.conns.get(conn_id)
            if conn is not None:  # it may have ended by itself meanwhile
                fx.close.append(conn)

    def view(self, addr: str, *, readyz: bool, tier: int | None, rtt: float | None,
             weight: float | None = None, fair_share: float | None = None,
             stalls: int | None = None, stalled_connections: int | None = None,
             suspect: bool | None = None, overload_guard: bool = False) -> UpstreamView:
        live = self.conns.values()
        return UpstreamView.of(
            addr, self.state, readyz=readyz, tier=tier, rtt=rtt, active=len(self.conns),
            total=self.total_connections, errors=self.connection_errors,
            bytes_up=self.bytes_up + sum(c.bytes_up for c in live),
            bytes_down=self.bytes_down + sum(c.bytes_down for c in live),
            sources=self.sources, state=self.word, since=self.since,
            last_check_at=self.last_check_at, draining_reason=_draining_reason(self),
            close_deadline=_close_deadline(self), admin=self.admin_mark,
            dials=self.dials.frozen(), weight=weight, fair_share=fair_share,
            rebalance_closes=self.rebalance_closes,
            stalls=stalls, stalled_connections=stalled_connections,
            stall_checks=tuple(sorted(self.stall_checks.items())),
            answer_hedges=tuple(sorted(self.answer_hedges.items())),
            dials_in_flight=self.dialing, dial_stalled=self.stalled, suspect=suspect,
            slow_not_counted=self.slow_not_counted if overload_guard else None)


def spread(ids: list[int], now: float, over: float) -> list[tuple[float, int]]:
    """When to close each connection: evenly over ``over`` seconds, the last one at the
    end, oldest first; all at once when ``over`` is 0."""
    if over <= 0:
        return [(now, i) for i in ids]
    step = over / max(1, len(ids))
    return [(now + step * (n + 1), i) for n, i in enumerate(ids)]


def started(conn: Tracked) -> float:
    return conn.started


def last_success(rec: Record) -> float:
    return rec.last_success


def _draining_reason(rec: Record) -> str | None:
    if rec.state.lifecycle is sm.Lifecycle.DRAINING:
        return "removed"
    if rec.state.admin_drained:
        return "admin"
    if rec.unready_deadline is not None:
        return "unready"
    return None


def _close_deadline(rec: Record) -> float | None:
    """When its remaining connections will all have been closed, if that is scheduled.

    A readiness close with no connection left is no close: the deadline is re-armed each
    period (for a connection that might still arrive), and shown it would move forward
    for ever on a dead upstream.
    """
    times = [t for t in (rec.drain_deadline if rec.state.lifecycle is sm.Lifecycle.DRAINING
                         else None,
                         rec.unready_deadline if rec.conns else None,
                         rec.close_plan[-1][0] if rec.close_plan else None) if t is not None]
    return min(times) if times else None


def readiness_moves(records: dict[str, Record], now: float, unready_drain_timeout: float,
                    fx: Effects) -> None:
    """Readiness moves existing connections (spec): start, expire or call off each
    unready upstream's close deadline (``unready_drain_timeout`` after it turned
    unready), collecting the closes and log lines in ``fx``."""
    ready = {a for a, r in records.items() if r.state.pickable and r.state.ready}
    for addr, rec in records.items():
        rec.unready_deadline, close, what = sm.unready_close(
            rec.state, bool(ready - {addr}), rec.unready_deadline, now, unready_drain_timeout)
        if close:
            conns = list(rec.conns.values())
            if conns:
                fx.log(logging.INFO, "closing connections upstream=%s connections=%d "
                       "reason=%r", addr, len(conns), "unready")
            fx.close.extend(conns)  # pipes detach themselves when they notice the close
        elif what == "scheduled" and rec.conns:
            fx.log(logging.INFO, "upstream unready; closing its connections after drain "
                   "timeout upstream=%s connections=%d drain_timeout=%gs", addr,
                   len(rec.conns), unready_drain_timeout)
        elif what and what != "scheduled":
            fx.log(logging.INFO, "upstream connection close called off upstream=%s "
                   "reason=%r", addr, what)
