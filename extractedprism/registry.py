"""The upstream registry: the one RLock that owns every upstream's state.

Every thread reads and changes upstream state only through this object:

* the ticker's probe threads call :meth:`record_probe`;
* pipe threads call :meth:`pick`, :meth:`record_dial`, :meth:`attach`, :meth:`detach`;
* discovery calls :meth:`set_endpoints`;
* the ticker calls :meth:`tick` to expire drain and readiness deadlines;
* the health server and the metrics collector read :meth:`snapshot`.

Fields guarded by ``self.lock``: ``_ups`` (address -> _Upstream and everything inside
each record), ``_panic``, ``_conn_count``. Methods never do I/O while holding it:
connections to close are collected under the lock and closed after it is released
(``_run``). Every state transition logs one line with its reason.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extractedprism.endpoints import Endpoint
from extractedprism.latency import LatencyTiers
from extractedprism.metrics import Metrics
from extractedprism.probes import ProbeResult
from extractedprism.selection import Candidate, choose

log = logging.getLogger(__name__)

FAILURE_THRESHOLD = 2  # consecutive failures that exclude an upstream (spec)


class Readiness(enum.Enum):
    PENDING = "pending"  # new, or reachable again after a TCP failure; next probe decides
    READY = "ready"
    UNREADY = "unready"


class Tracked(Protocol):
    """What the registry needs of a live connection (implemented by pipe.Pipe)."""

    client: str
    started: float
    bytes_up: int
    bytes_down: int

    def close(self) -> None: ...


@dataclass
class _Upstream:
    endpoint: Endpoint
    healthy: bool = True
    fail_streak: int = 0
    readiness: Readiness = Readiness.PENDING
    ready_fail_streak: int = 0
    probed_ready: bool = False
    tcp_failed_since_probe: bool = False
    draining: bool = False
    drain_deadline: float | None = None
    unready_deadline: float | None = None
    conns: dict[int, Tracked] = field(default_factory=dict)
    dialing: int = 0  # picked, dial in progress: counts for least-conn
    total_connections: int = 0
    last_check_error: str = ""
    last_success: float = 0.0


@dataclass(frozen=True)
class ConnView:
    client: str
    upstream: str
    started: float
    bytes_up: int
    bytes_down: int


@dataclass(frozen=True)
class UpstreamView:
    address: str
    healthy: bool
    draining: bool
    ready: bool
    readiness: str
    probed_ready: bool
    tier: int | None
    rtt_seconds: float | None
    active_connections: int
    total_connections: int
    last_check_error: str

    @property
    def pickable(self) -> bool:
        return self.healthy and not self.draining

    def as_json(self) -> dict[str, object]:
        return {
            "address": self.address,
            "healthy": self.healthy,
            "draining": self.draining,
            "ready": self.ready if self.readiness != "n/a" else None,
            "readiness": self.readiness,
            "tier": self.tier,
            "rtt_seconds": self.rtt_seconds,
            "active_connections": self.active_connections,
            "total_connections": self.total_connections,
            "last_check_error": self.last_check_error,
        }


@dataclass(frozen=True)
class Snapshot:
    upstreams: tuple[UpstreamView, ...]
    connections_active: int
    max_connections: int
    panic: bool
    latency_mode: bool
    readyz_mode: bool

    def get(self, address: str) -> UpstreamView | None:
        return next((u for u in self.upstreams if u.address == address), None)


def _started(conn: Tracked) -> float:
    return conn.started


class Registry:
    """Upstream records, their state transitions, live connections and deadlines."""

    def __init__(
        self,
        *,
        metrics: Metrics,
        selection: str = "random",
        readyz: bool = False,
        drain_timeout: float = 30.0,
        max_connections: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        probe_now: Callable[[str], None] | None = None,
    ) -> None:
        self.lock = threading.RLock()
        self._metrics = metrics
        self._selection = selection
        self._readyz = readyz
        self._drain_timeout = drain_timeout
        self._max_connections = max_connections
        self._clock = clock
        self._rng = rng or random.Random()
        self._probe_now = probe_now
        self._ups: dict[str, _Upstream] = {}
        self._latency = LatencyTiers()
        self._panic = False
        self._conn_count = 0
        self._closing = False
        self.on_change: Callable[[], None] | None = None  # ticker wake-up

    # -- wiring -------------------------------------------------------------------

    def set_probe_now(self, fn: Callable[[str], None]) -> None:
        self._probe_now = fn

    @staticmethod
    def _run(closers: Iterable[Tracked]) -> None:
        for conn in closers:
            try:
                conn.close()
            except Exception:  # a close must never take a caller down
                log.exception("closing connection failed client=%s", conn.client)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- discovery ----------------------------------------------------------------

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Make ``endpoints`` the upstream list: add new ones, drain removed ones."""
        wanted = {str(ep): ep for ep in endpoints}
        to_close: list[Tracked] = []
        with self.lock:
            now = self._clock()
            for addr, ep in wanted.items():
                up = self._ups.get(addr)
                if up is None:
                    self._ups[addr] = _Upstream(endpoint=ep)
                    log.info("upstream added upstream=%s", addr)
                elif up.draining:
                    up.draining = False
                    up.drain_deadline = None
                    log.info("upstream drain aborted upstream=%s reason=%r", addr, "re-added")
            for addr, up in list(self._ups.items()):
                if addr in wanted or up.draining:
                    continue
                up.draining = True
                up.unready_deadline = None
                if self._drain_timeout <= 0 or not up.conns:
                    log.info("upstream removed upstream=%s connections_closed=%d",
                             addr, len(up.conns))
                    to_close.extend(self._remove_locked(addr))
                else:
                    up.drain_deadline = now + self._drain_timeout
                    log.info("upstream draining upstream=%s connections=%d drain_timeout=%gs",
                             addr, len(up.conns), self._drain_timeout)
            to_close.extend(self._update_readiness_deadlines_locked(now))
            self._update_panic_locked()
        self._run(to_close)
        self._changed()

    def _remove_locked(self, addr: str) -> list[Tracked]:
        up = self._ups.pop(addr)
        self._latency.remove(addr)
        # Counter series go with the upstream; failures reported later are not counted
        # (record_dial checks membership under this same lock).
        self._metrics.forget_upstream(addr)
        conns = list(up.conns.values())
        self._conn_count -= len(conns)
        up.conns.clear()
        return conns

    # -- selection ----------------------------------------------------------------

    def _candidates_locked(self) -> list[Candidate]:
        latency = self._selection == "latency"
        return [
            Candidate(
                address=addr,
                healthy=up.healthy,
                draining=up.draining,
                ready=up.readiness is Readiness.READY,
                tier=self._latency.tier(addr) if latency else None,
                active=len(up.conns) + up.dialing,
            )
            for addr, up in self._ups.items()
        ]

    def pick(self, exclude: Iterable[str] = ()) -> Endpoint | None:
        """The upstream for a new connection, or None when nothing is pickable."""
        with self.lock:
            addr = choose(
                self._candidates_locked(),
                mode=self._selection,
                readyz=self._readyz,
                rng=self._rng,
                exclude=frozenset(exclude) if exclude else (),
            )
            if addr is None:
                return None
            up = self._ups[addr]
            # Counted until attach() or abandon(), so concurrent picks see each other.
            up.dialing += 1
            return up.endpoint

    def any_pickable(self, exclude: Iterable[str] = ()) -> bool:
        skip = frozenset(exclude)
        with self.lock:
            return any(u.healthy and not u.draining and a not in skip
                       for a, u in self._ups.items())

    def abandon(self, addr: str) -> None:
        """A picked upstream was not used after all (its dial failed)."""
        with self.lock:
            up = self._ups.get(addr)
            if up is not None and up.dialing > 0:
                up.dialing -= 1

    def panic_order(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """Every non-draining upstream, most recently successful first (panic mode)."""
        skip = frozenset(exclude)
        with self.lock:
            ups = [u for a, u in self._ups.items() if not u.draining and a not in skip]
            ups.sort(key=lambda u: u.last_success, reverse=True)
            return [u.endpoint for u in ups]

    def _update_panic_locked(self) -> None:
        panic = bool(self._ups) and not any(u.healthy and not u.draining
                                            for u in self._ups.values())
        if panic != self._panic:
            self._panic = panic
            if panic:
                log.warning("panic: no upstream is healthy; new connections try every "
                            "known upstream upstreams=%d", len(self._ups))
            else:
                log.info("panic over: an upstream is healthy again")

    # -- health -------------------------------------------------------------------

    def _tcp_result_locked(self, addr: str, up: _Upstream, ok: bool, reason: str,
                           source: str) -> bool:
        """Feed one TCP outcome into the streak; True when the health state flipped."""
        if ok:
            up.fail_streak = 0
            up.last_success = self._clock()
            if not up.healthy:
                up.healthy = True
                log.info("upstream unhealthy->healthy upstream=%s reason=%r", addr,
                         f"{source} succeeded")
                return True
            return False
        up.fail_streak += 1
        if self._readyz:
            up.tcp_failed_since_probe = True
        if up.healthy and up.fail_streak >= FAILURE_THRESHOLD:
            up.healthy = False
            log.warning("upstream healthy->unhealthy upstream=%s reason=%r", addr,
                        f"{source}: {reason}")
            if self._readyz and up.readiness is Readiness.READY:
                # It failed its probes at the TCP level: a partitioned or frozen API
                # server must lose its long-lived connections like an unready one,
                # instead of holding them until keepalive gives up.
                up.readiness = Readiness.UNREADY
                log.info("upstream ready->unready upstream=%s reason=%r", addr,
                         f"TCP {source} failed")
            return True
        return False

    def record_probe(self, addr: str, result: ProbeResult) -> None:
        """Feed one health check (TCP, and readyz when enabled) into the state machine."""
        to_close: list[Tracked] = []
        with self.lock:
            up = self._ups.get(addr)
            if up is None or up.draining:
                return  # checks stop while an upstream drains; removed ones are gone
            before_error = up.last_check_error
            self._tcp_result_locked(addr, up, result.ok, result.reason, "probe")
            if result.ok and self._selection == "latency" and result.rtt is not None:
                self._latency.observe(addr, result.rtt)
            if result.ok and self._readyz and result.ready is not None:
                self._ready_result_locked(addr, up, result.ready, result.ready_reason)
            up.last_check_error = result.reason or result.ready_reason
            if up.last_check_error and up.last_check_error != before_error:
                log.info("upstream check failed upstream=%s reason=%r", addr,
                         up.last_check_error)
            to_close.extend(self._update_readiness_deadlines_locked(self._clock()))
            self._update_panic_locked()
        self._run(to_close)
        # No ticker wake-up here: the probe thread wakes it when it finishes.

    def _ready_result_locked(self, addr: str, up: _Upstream, ready: bool, reason: str) -> None:
        before = up.readiness
        fresh = up.readiness is Readiness.PENDING or up.tcp_failed_since_probe
        up.tcp_failed_since_probe = False
        up.probed_ready = True
        if ready:
            up.ready_fail_streak = 0
            up.readiness = Readiness.READY
        else:
            up.ready_fail_streak += 1
            # After a reset the upstream already counts as not ready, so one failed
            # probe settles it; otherwise two in a row are needed (spec).
            if fresh or up.ready_fail_streak >= FAILURE_THRESHOLD:
                up.readiness = Readiness.UNREADY
        if up.readiness is not before:
            log.info("upstream %s->%s upstream=%s reason=%r", before.value, up.readiness.value,
                     addr, reason or "readyz 200")

    def record_dial(self, addr: str, ok: bool, reason: str = "", *, count_error: bool = True
                    ) -> None:
        """A client dial's outcome counts toward the same streak as health checks."""
        probe = False
        with self.lock:
            up = self._ups.get(addr)
            if up is None:
                return  # removed: failures are not counted until it is added again
            if not ok and count_error:
                self._metrics.connection_errors_total.labels(upstream=addr).inc()
            if up.draining:
                return
            if ok and up.fail_streak == 0 and not up.tcp_failed_since_probe:
                up.last_success = self._clock()
                return  # the common case: nothing to change, nobody to wake
            was_failed = up.tcp_failed_since_probe
            flipped = self._tcp_result_locked(addr, up, ok, reason, "dial")
            if ok and self._readyz and was_failed:
                # Reachable again after a TCP failure: not ready until the probe that
                # runs right now passes.
                if up.readiness is not Readiness.PENDING:
                    log.info("upstream %s->pending upstream=%s reason=%r",
                             up.readiness.value, addr, "reachable again after TCP failure")
                up.readiness = Readiness.PENDING
                up.ready_fail_streak = 0
                probe = True
            to_close = self._update_readiness_deadlines_locked(self._clock()) if flipped else []
            self._update_panic_locked()
        self._run(to_close)
        if probe and self._probe_now is not None:
            self._probe_now(addr)
        if flipped:
            self._changed()

    # -- readiness-driven connection moves ----------------------------------------

    def _update_readiness_deadlines_locked(self, now: float) -> list[Tracked]:
        if not self._readyz:
            return []
        to_close: list[Tracked] = []
        ready_addrs = {a for a, u in self._ups.items()
                       if u.healthy and not u.draining and u.readiness is Readiness.READY}
        for addr, up in self._ups.items():
            should = (up.readiness is Readiness.UNREADY and not up.draining
                      and bool(ready_addrs - {addr}))
            if should and up.unready_deadline is None:
                if self._drain_timeout <= 0:
                    to_close.extend(self._close_conns_locked(addr, up, "unready"))
                    continue
                up.unready_deadline = now + self._drain_timeout
                if up.conns:
                    log.info("upstream unready; closing its connections after drain timeout "
                             "upstream=%s connections=%d drain_timeout=%gs", addr,
                             len(up.conns), self._drain_timeout)
            elif not should and up.unready_deadline is not None:
                up.unready_deadline = None
                log.info("upstream connection close called off upstream=%s reason=%r", addr,
                         "ready again" if up.readiness is not Readiness.UNREADY
                         else "no other upstream is ready")
            elif should and up.unready_deadline is not None and now >= up.unready_deadline:
                to_close.extend(self._close_conns_locked(addr, up, "unready"))
                up.unready_deadline = now + self._drain_timeout
        return to_close

    def _close_conns_locked(self, addr: str, up: _Upstream, why: str) -> list[Tracked]:
        conns = list(up.conns.values())
        if conns:
            log.info("closing connections upstream=%s connections=%d reason=%r",
                     addr, len(conns), why)
        # Pipes detach themselves when their thread notices the close.
        return conns

    def tick(self) -> float | None:
        """Expire drain and readiness deadlines; return the next deadline, if any."""
        to_close: list[Tracked] = []
        with self.lock:
            now = self._clock()
            for addr, up in list(self._ups.items()):
                if up.draining and up.drain_deadline is not None and now >= up.drain_deadline:
                    log.info("upstream drain timeout; force-closing upstream=%s connections=%d",
                             addr, len(up.conns))
                    to_close.extend(self._remove_locked(addr))
            to_close.extend(self._update_readiness_deadlines_locked(now))
            self._update_panic_locked()
            deadlines = [d for u in self._ups.values()
                         for d in (u.drain_deadline, u.unready_deadline) if d is not None]
        self._run(to_close)
        return min(deadlines) if deadlines else None

    # -- connections --------------------------------------------------------------

    def attach(self, addr: str, conn: Tracked) -> bool:
        """Track a connection that just dialed ``addr``; False if it drains or left."""
        with self.lock:
            up = self._ups.get(addr)
            if up is not None and up.dialing > 0:
                up.dialing -= 1
            if up is None or up.draining or self._closing:
                return False
            up.conns[id(conn)] = conn
            up.total_connections += 1
            self._conn_count += 1
            self._metrics.connections_total.inc()
            return True

    def detach(self, addr: str, conn: Tracked) -> None:
        with self.lock:
            up = self._ups.get(addr)
            if up is None or up.conns.pop(id(conn), None) is None:
                return
            self._conn_count -= 1
            if up.draining and not up.conns:
                log.info("upstream drained upstream=%s", addr)
                self._remove_locked(addr)

    def close_all(self) -> int:
        """Shutdown: refuse new attaches and force-close every live connection."""
        with self.lock:
            self._closing = True
            conns = [c for up in self._ups.values() for c in up.conns.values()]
        self._run(conns)
        return len(conns)

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
            return [u.endpoint for u in self._ups.values() if not u.draining]

    def connection_count(self) -> int:
        with self.lock:
            return self._conn_count

    def connections(self) -> list[ConnView]:
        with self.lock:
            return [ConnView(c.client, a, c.started, c.bytes_up, c.bytes_down)
                    for a, u in self._ups.items() for c in u.conns.values()]

    def snapshot(self) -> Snapshot:
        with self.lock:
            latency = self._selection == "latency"
            views = tuple(
                UpstreamView(
                    address=addr,
                    healthy=up.healthy,
                    draining=up.draining,
                    ready=up.readiness is Readiness.READY,
                    readiness=up.readiness.value if self._readyz else "n/a",
                    probed_ready=up.probed_ready,
                    tier=self._latency.tier(addr) if latency else None,
                    rtt_seconds=self._latency.average(addr) if latency else None,
                    active_connections=len(up.conns),
                    total_connections=up.total_connections,
                    last_check_error=up.last_check_error,
                )
                for addr, up in sorted(self._ups.items())
            )
            return Snapshot(
                upstreams=views,
                connections_active=self._conn_count,
                max_connections=self._max_connections,
                panic=self._panic,
                latency_mode=latency,
                readyz_mode=self._readyz,
            )

    def healthy(self) -> bool:
        """At least one upstream is healthy and not draining (the proxy's /readyz)."""
        with self.lock:
            return any(u.healthy and not u.draining for u in self._ups.values())
