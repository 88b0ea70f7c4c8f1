"""Frozen views of the registry (pure): what readers get from ``Table.snapshot()``.

The health server (/readyz, /upstreams), the metrics collector and the tests read
upstream state only through these values, taken under the registry lock in one go,
so a scrape or a page never mixes two moments. Counters (connections, dial errors,
bytes) are plain integers here: the collector exports them at scrape time, so a
removed upstream's series disappear with its record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extractedprism.upstreams.dialstats import DialCounts
from extractedprism.upstreams.state import UpstreamState, pickable


@dataclass(frozen=True)
class AdminMark:
    """An operator's action on an upstream (kept in memory only)."""

    action: str  # "drain" | "close"
    uid: int  # the caller's uid (SO_PEERCRED)
    at: float  # registry (monotonic) clock


@dataclass(frozen=True)
class AdminOutcome:
    """What :meth:`Membership.set_admin` found and did, read under its lock in one go."""

    before: str  # the operator's mark it had: "", "drain" or "close"
    state: UpstreamState  # its state afterwards
    connections: int  # its live connections afterwards
    # Another upstream is pickable (and ready, with --health-check=readyz).
    others: bool
    done: bool  # False: a check the caller asked for said no; nothing changed


@dataclass(frozen=True)
class RebalanceView:
    """The last rebalance rounds (``--rebalance-interval``), times on the registry clock."""

    interval: float
    quiet: float
    rounds: int = 0
    closes: int = 0
    last_round_at: float | None = None
    last_reason: str = ""  # balance.ACTED or why the last round did not act
    last_detail: str = ""  # which upstream blocked it, or what the close was
    last_acted_at: float | None = None


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
    readiness: str  # "pending" | "ready" | "unready", or "n/a" without readyz
    probed_ready: bool
    tier: int | None
    rtt_seconds: float | None
    active_connections: int
    total_connections: int
    last_check_error: str
    lifecycle: str = "active"  # upstream.Lifecycle value
    connection_errors: int = 0  # failed dials counted for connection_errors_total
    bytes_up: int = 0  # client -> upstream, finished and live connections
    bytes_down: int = 0  # upstream -> client
    # The providers whose lists hold it, in provider order: "static", "kubernetes",
    # "cache" (one or several).
    sources: tuple[str, ...] = ()
    # The operator's view (issue 15); times are on the registry's monotonic clock,
    # Snapshot.taken_mono/taken_wall turn them into wall-clock time.
    state: str = "healthy"  # upstream.state_word
    since: float = 0.0  # last change of ``state``
    last_check_at: float | None = None  # last health check, or last failed client dial
    last_error_source: str = ""  # "probe" | "dial" | ""
    failures: int = 0  # current consecutive-failure streak
    ready_reason: str = ""
    draining_reason: str | None = None  # "removed" | "unready" | "admin"
    close_deadline: float | None = None  # when its remaining connections are closed
    admin: AdminMark | None = None
    dials: DialCounts = field(default_factory=DialCounts)  # client dial times
    # Slow start's weight (None: --slow-start 0), the fair share of the live connections
    # to pickable upstreams by weight (None: not pickable, or rebalancing and slow start
    # are off), and the connections rebalancing closed.
    weight: float | None = None
    fair_share: float | None = None
    rebalance_closes: int = 0
    # Connections whose first answer was hedged, by this upstream's outcome: "won",
    # "lost" (answered after the other), "silent" (never within --health-timeout).
    answer_hedges: tuple[tuple[str, int], ...] = ()
    # The stall check (None: --stall-timeout 0): stalls seen on its connections (one per
    # unanswered stretch of a connection), its live connections stalled at the last
    # sample, and the stall-triggered checks' results ("failed", "passed").
    stalls: int | None = None
    stalled_connections: int | None = None
    stall_checks: tuple[tuple[str, int], ...] = ()
    # --overload-guard (None: off): slow answers not counted against it because no
    # faster upstream served.
    slow_not_counted: int | None = None
    # Picked and dialing: reservations held (least-conn counts them). Each ends at attach
    # or release, so a count that never returns to 0 is a leaked reservation.
    dials_in_flight: int = 0
    # A dial to it stalled past --dial-hedge-delay and nothing succeeded there since:
    # hedges avoid it (Picks.reserve_hedge).
    dial_stalled: bool = False
    # The stall check's mark (None: --stall-timeout 0): a connection of it is stalled and
    # not yet settled by its checks, or a check failed while one was (upstreams.stalls).
    # Like dial_stalled, a mark new connections avoid while an unmarked one is eligible.
    suspect: bool | None = None

    @property
    def admin_drained(self) -> bool:
        return self.admin is not None

    @classmethod
    def of(cls, address: str, s: UpstreamState, *, readyz: bool, tier: int | None,
           rtt: float | None, active: int, total: int, errors: int, bytes_up: int,
           bytes_down: int, sources: tuple[str, ...] = (), **more: object) -> UpstreamView:
        return cls(address=address, healthy=s.healthy, draining=s.draining, ready=s.ready,
                   readiness=s.readiness.value if readyz else "n/a",
                   probed_ready=s.probed_ready, tier=tier, rtt_seconds=rtt,
                   active_connections=active, total_connections=total,
                   last_check_error=s.last_check_error, lifecycle=s.lifecycle.value,
                   connection_errors=errors, bytes_up=bytes_up, bytes_down=bytes_down,
                   last_error_source=s.last_error_source, failures=s.fail_streak,
                   ready_reason=s.ready_reason if readyz else "not probed (--health-check=tcp)",
                   sources=sources, **more)  # type: ignore[arg-type]

    @property
    def fallback(self) -> bool:
        """A static endpoint demoted by --static-endpoints=fallback (panic mode only)."""
        return self.lifecycle == "fallback"

    @property
    def pickable(self) -> bool:
        return pickable(self)

    def as_json(self) -> dict[str, object]:
        return {
            "address": self.address,
            "source": list(self.sources),
            "state": self.state,
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
    connections_total: int = 0  # connections established since start (all upstreams)
    connections: tuple[ConnView, ...] = ()  # only with snapshot(connections=True)
    turned_away: int = 0  # clients closed for lack of an upstream (connection_errors "none")
    taken_mono: float = 0.0  # the registry clock when the snapshot was taken
    taken_wall: float = 0.0  # time.time() at the same moment
    rebalance: RebalanceView | None = None  # None: --rebalance-interval 0
    stall_timeout: float = 0.0  # --stall-timeout (0: the stall check is off)
    overload_guard: bool = False  # --overload-guard

    def get(self, address: str) -> UpstreamView | None:
        return next((u for u in self.upstreams if u.address == address), None)
