"""The upstream registry: the one RLock that owns every upstream's record.

Every thread reads and changes upstream state only through this object:

* the ticker's probe threads call :meth:`record_probe`;
* pipe threads call :meth:`pick`, :meth:`record_dial`, :meth:`attach`, :meth:`detach`;
* discovery calls :meth:`set_endpoints`;
* the ticker calls :meth:`tick` to expire drain and readiness deadlines;
* the health server and the metrics collector read :meth:`snapshot`.

The rules of one upstream's state live in :mod:`extractedprism.upstream` (pure); this
module owns what needs the lock: the address -> record dict, live connections, the
counters, the drain and readiness deadlines and the panic flag. Fields guarded by
``self.lock``: ``_ups`` (and everything in each record), ``_panic``, ``_conn_count``,
``_connections_total``, ``_closing``. Methods never do I/O, logging or callbacks while
holding it: sockets to close, log lines and change notices are collected in an
:class:`_Effects` under the lock and carried out after it is released, so a stalled
log handler or a slow close never stalls a pick.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extractedprism import upstream as sm
from extractedprism.endpoints import Endpoint
from extractedprism.latency import LatencyTiers
from extractedprism.selection import Candidate, choose
from extractedprism.snapshot import ConnView, Snapshot, UpstreamView
from extractedprism.upstream import ProbeResult, Readiness, Transition, UpstreamState

log = logging.getLogger(__name__)

__all__ = ["Change", "ProbeResult", "Readiness", "Registry", "Tracked"]


class Tracked(Protocol):
    """What the registry needs of a live connection (implemented by pipe.Pipe)."""

    client: str
    started: float
    bytes_up: int
    bytes_down: int

    def close(self) -> None: ...


@dataclass(frozen=True)
class Change:
    """What the registry tells its one listener (the ticker) after releasing the lock."""

    what: str  # "endpoints" (list changed) | "health" (a dial flipped it) | "probe-now"
    address: str = ""


@dataclass
class _Record:
    endpoint: Endpoint
    state: UpstreamState = field(default_factory=UpstreamState)
    conns: dict[int, Tracked] = field(default_factory=dict)
    dialing: int = 0  # picked, dial in progress: counts for least-conn
    drain_deadline: float | None = None
    unready_deadline: float | None = None
    last_success: float = 0.0
    # Counters, exported at scrape time; they go when the record goes.
    total_connections: int = 0
    connection_errors: int = 0
    bytes_up: int = 0  # of finished connections
    bytes_down: int = 0


class _Effects:
    """Side effects collected under the lock, run after it is released."""

    __slots__ = ("changes", "close", "logs")

    def __init__(self) -> None:
        self.close: list[Tracked] = []
        self.logs: list[tuple[int, str, tuple[object, ...]]] = []
        self.changes: list[Change] = []

    def log(self, level: int, msg: str, *args: object) -> None:
        self.logs.append((level, msg, args))

    def transitions(self, addr: str, transitions: Iterable[Transition]) -> None:
        for t in transitions:
            if t.kind == "check":
                self.log(t.level, "upstream check failed upstream=%s reason=%r", addr, t.reason)
            else:
                self.log(t.level, "upstream %s->%s upstream=%s reason=%r", t.before, t.after,
                         addr, t.reason)


def _started(conn: Tracked) -> float:
    return conn.started


class Registry:
    """Upstream records, live connections, counters and deadlines behind one RLock."""

    def __init__(
        self,
        *,
        selection: str = "random",
        readyz: bool = False,
        drain_timeout: float = 30.0,
        max_connections: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_change: Callable[[Change], None] | None = None,
    ) -> None:
        self.lock = threading.RLock()
        self._selection = selection
        self._latency_mode = selection == "latency"
        self._readyz = readyz
        self._drain_timeout = drain_timeout
        self._max_connections = max_connections
        self._clock = clock
        self._rng = rng or random.Random()
        self._on_change = on_change
        self._ups: dict[str, _Record] = {}
        self._latency = LatencyTiers()
        self._panic = False
        self._conn_count = 0
        self._connections_total = 0
        self._closing = False

    def _run(self, fx: _Effects) -> None:
        """Carry out collected effects; called with the lock released."""
        for conn in fx.close:
            try:
                conn.close()
            except Exception:  # a close must never take a caller down
                log.exception("closing connection failed client=%s", conn.client)
        for level, msg, args in fx.logs:
            log.log(level, msg, *args)
        if self._on_change is not None:
            for change in fx.changes:
                self._on_change(change)

    # -- discovery ----------------------------------------------------------------

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Make ``endpoints`` the upstream list: add new ones, drain removed ones."""
        wanted = {str(ep): ep for ep in endpoints}
        fx = _Effects()
        with self.lock:
            now = self._clock()
            for addr, ep in wanted.items():
                rec = self._ups.get(addr)
                if rec is None:
                    self._ups[addr] = _Record(endpoint=ep)
                    fx.log(logging.INFO, "upstream added upstream=%s", addr)
                elif rec.state.draining:
                    rec.state = sm.undrain(rec.state)
                    rec.drain_deadline = None
                    fx.log(logging.INFO, "upstream drain aborted upstream=%s reason=%r", addr,
                           "re-added")
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
            fx.changes.append(Change("endpoints"))
        self._run(fx)

    def _remove_locked(self, addr: str) -> list[Tracked]:
        rec = self._ups.pop(addr)
        self._latency.remove(addr)
        conns = list(rec.conns.values())
        self._conn_count -= len(conns)
        rec.conns.clear()
        return conns

    # -- selection ----------------------------------------------------------------

    def pick(self, exclude: Iterable[str] = ()) -> Endpoint | None:
        """The upstream for a new connection, or None when nothing is pickable."""
        with self.lock:
            tier = self._latency.tier if self._latency_mode else None
            addr = choose(
                [Candidate(address=a, healthy=r.state.healthy, draining=r.state.draining,
                           ready=r.state.readiness is Readiness.READY,
                           tier=tier(a) if tier is not None else None,
                           active=len(r.conns) + r.dialing)
                 for a, r in self._ups.items()],
                mode=self._selection,
                readyz=self._readyz,
                rng=self._rng,
                exclude=frozenset(exclude) if exclude else (),
            )
            if addr is None:
                return None
            rec = self._ups[addr]
            # Counted until attach() or abandon(), so concurrent picks see each other.
            rec.dialing += 1
            return rec.endpoint

    def any_pickable(self, exclude: Iterable[str] = ()) -> bool:
        skip = frozenset(exclude)
        with self.lock:
            return any(r.state.pickable and a not in skip for a, r in self._ups.items())

    def abandon(self, addr: str) -> None:
        """A picked upstream was not used after all (its dial failed)."""
        with self.lock:
            rec = self._ups.get(addr)
            if rec is not None and rec.dialing > 0:
                rec.dialing -= 1

    def panic_order(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """Every non-draining upstream, most recently successful first (panic mode)."""
        skip = frozenset(exclude)
        with self.lock:
            recs = [r for a, r in self._ups.items() if not r.state.draining and a not in skip]
            recs.sort(key=_last_success, reverse=True)
            return [r.endpoint for r in recs]

    def _update_panic_locked(self, fx: _Effects) -> None:
        panic = bool(self._ups) and not any(r.state.pickable for r in self._ups.values())
        if panic != self._panic:
            self._panic = panic
            if panic:
                fx.log(logging.WARNING, "panic: no upstream is healthy; new connections try "
                       "every known upstream upstreams=%d", len(self._ups))
            else:
                fx.log(logging.INFO, "panic over: an upstream is healthy again")

    # -- health -------------------------------------------------------------------

    def record_probe(self, addr: str, result: ProbeResult) -> None:
        """Feed one health check (TCP, and readyz when enabled) into the state machine."""
        fx = _Effects()
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None or rec.state.lifecycle not in sm.TAKES_CHECKS:
                return  # checks stop while an upstream drains; removed ones are gone
            if result.ok:
                rec.last_success = self._clock()
                if self._latency_mode and result.rtt is not None:
                    self._latency.observe(addr, result.rtt)
            rec.state, transitions = sm.on_probe(rec.state, result, readyz=self._readyz)
            fx.transitions(addr, transitions)
            self._update_readiness_deadlines_locked(self._clock(), fx)
            self._update_panic_locked(fx)
        # No change notice: the probe thread wakes the ticker when it finishes.
        self._run(fx)

    def record_dial(self, addr: str, ok: bool, reason: str = "", *, count_error: bool = True
                    ) -> None:
        """A client dial's outcome counts toward the same streak as health checks."""
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None:
                return  # removed: failures are not counted until it is added again
            if not ok and count_error:
                rec.connection_errors += 1
            if rec.state.draining:
                return
            if ok:
                rec.last_success = self._clock()
            state, transitions, probe = sm.on_dial(rec.state, ok, reason, readyz=self._readyz)
            if state is rec.state:
                return  # the common case: nothing to change, nobody to wake
            rec.state = state
            fx = _Effects()
            fx.transitions(addr, transitions)
            flipped = any(t.health_flipped for t in transitions)
            if flipped:
                self._update_readiness_deadlines_locked(self._clock(), fx)
            self._update_panic_locked(fx)
            if probe:
                fx.changes.append(Change("probe-now", addr))
            if flipped:
                fx.changes.append(Change("health", addr))
        self._run(fx)

    # -- readiness-driven connection moves ----------------------------------------

    def _update_readiness_deadlines_locked(self, now: float, fx: _Effects) -> None:
        if not self._readyz:
            return
        ready_addrs = {a for a, r in self._ups.items() if r.state.pickable and r.state.ready}
        for addr, rec in self._ups.items():
            rec.unready_deadline, close, what = sm.unready_close(
                rec.state, bool(ready_addrs - {addr}), rec.unready_deadline, now,
                self._drain_timeout)
            if close:
                self._close_conns_locked(addr, rec, fx)
            elif what == "scheduled" and rec.conns:
                fx.log(logging.INFO, "upstream unready; closing its connections after "
                       "drain timeout upstream=%s connections=%d drain_timeout=%gs", addr,
                       len(rec.conns), self._drain_timeout)
            elif what and what != "scheduled":
                fx.log(logging.INFO, "upstream connection close called off upstream=%s "
                       "reason=%r", addr, what)

    @staticmethod
    def _close_conns_locked(addr: str, rec: _Record, fx: _Effects) -> None:
        conns = list(rec.conns.values())
        if conns:
            fx.log(logging.INFO, "closing connections upstream=%s connections=%d reason=%r",
                   addr, len(conns), "unready")
        # Pipes detach themselves when their thread notices the close.
        fx.close.extend(conns)

    def tick(self) -> float | None:
        """Expire drain and readiness deadlines; return the next deadline, if any."""
        fx = _Effects()
        with self.lock:
            now = self._clock()
            for addr, rec in list(self._ups.items()):
                if (rec.state.draining and rec.drain_deadline is not None
                        and now >= rec.drain_deadline):
                    fx.log(logging.INFO, "upstream drain timeout; force-closing upstream=%s "
                           "connections=%d", addr, len(rec.conns))
                    fx.close.extend(self._remove_locked(addr))
            self._update_readiness_deadlines_locked(now, fx)
            self._update_panic_locked(fx)
            deadlines = [d for r in self._ups.values()
                         for d in (r.drain_deadline, r.unready_deadline) if d is not None]
        self._run(fx)
        return min(deadlines) if deadlines else None

    # -- connections --------------------------------------------------------------

    def attach(self, addr: str, conn: Tracked) -> bool:
        """Track a connection that just dialed ``addr``; False if it drains or left."""
        with self.lock:
            rec = self._ups.get(addr)
            if rec is not None and rec.dialing > 0:
                rec.dialing -= 1
            if rec is None or rec.state.draining or self._closing:
                return False
            rec.conns[id(conn)] = conn
            rec.total_connections += 1
            self._conn_count += 1
            self._connections_total += 1
            return True

    def detach(self, addr: str, conn: Tracked) -> None:
        with self.lock:
            rec = self._ups.get(addr)
            if rec is None or rec.conns.pop(id(conn), None) is None:
                return
            self._conn_count -= 1
            rec.bytes_up += conn.bytes_up
            rec.bytes_down += conn.bytes_down
            if not (rec.state.draining and not rec.conns):
                return
            self._remove_locked(addr)
        log.info("upstream drained upstream=%s", addr)

    def close_all(self) -> int:
        """Shutdown: refuse new attaches and force-close every live connection."""
        fx = _Effects()
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
        conns.sort(key=_started)
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
            latency, readyz = self._latency_mode, self._readyz
            views = tuple(
                UpstreamView.of(
                    addr, r.state, readyz=readyz,
                    tier=self._latency.tier(addr) if latency else None,
                    rtt=self._latency.average(addr) if latency else None,
                    active=len(r.conns), total=r.total_connections, errors=r.connection_errors,
                    bytes_up=r.bytes_up + sum(c.bytes_up for c in r.conns.values()),
                    bytes_down=r.bytes_down + sum(c.bytes_down for c in r.conns.values()))
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
            )

    def healthy(self) -> bool:
        """At least one upstream is pickable (the proxy's /readyz)."""
        with self.lock:
            return any(r.state.pickable for r in self._ups.values())


def _last_success(rec: _Record) -> float:
    return rec.last_success
