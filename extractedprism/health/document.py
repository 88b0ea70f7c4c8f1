"""The ``/upstreams`` document: one registry snapshot rendered as JSON-ready data (pure).

Kept apart from the HTTP plumbing so ``extractedprism status`` and the admin socket's
``list`` show exactly what ``/upstreams`` shows. Registry times are monotonic (they
order events and deadlines); here each becomes wall-clock time through the pair of
clocks the snapshot was taken with, and is written as RFC 3339 with milliseconds and
the local offset (``2026-12-01T18:25:55.148+00:00``).

Per upstream: ``address``, ``source`` (providers that list it), ``state`` in words
(``healthy``, ``unhealthy``, ``draining`` (removed from the endpoint list),
``closing-unready`` (TCP-healthy, unready, readiness drain scheduled), ``admin-drain``,
``fallback``), ``since`` (last change of ``state``), ``healthy``, ``draining`` (removed
endpoints only, as before),
``draining_reason`` (``removed``, ``unready``, ``admin``, or null) and ``close_deadline``
(when its remaining connections are closed, whenever that is scheduled), ``ready``,
``readiness``, ``ready_reason``, ``failures`` (current consecutive-failure streak),
``last_check_at``, ``last_check_error``, ``last_error_source`` (``probe`` or ``dial``),
``tier``, ``rtt_seconds``, ``active_connections``, ``total_connections``,
``dials_in_flight`` (reservations held: picked, dial not yet attached or released),
``dial_stalled`` (a dial stalled past --dial-hedge-delay, no success since), ``bytes_up``
(client to upstream), ``bytes_down``, ``answer_hedges`` (``won``/``lost``/``silent``:
connections whose first answer was hedged, as extractedprism_answer_hedges_total),
``admin`` (the operator's action, its uid and time, or null); ``connection_share`` (its
part of all live connections, 0 to 1), ``fair_share`` (the connections it should hold by
weight, while rebalancing or slow start is on and it is pickable, else null), ``weight``
(slow start's, 0.1 to 1; null when ``--slow-start`` is 0) and ``rebalance_closes``; the
stall check's ``stalls`` (stalls seen on its connections, one per unanswered stretch of a
connection), ``stalled_connections`` (its live connections stalled at the last sample),
``suspect`` (the stall check's mark new connections avoid while an unmarked upstream is
eligible: a stalled connection its checks have not settled, docs/architecture.md) and
``stall_checks`` (``failed``/``passed``: the checks stalls asked for, as
extractedprism_stall_checks_total), all four null when ``--stall-timeout`` is 0;
``slow_not_counted`` (slow answers not counted against it because no faster upstream
served, as extractedprism_slow_not_counted_total; null when ``--overload-guard`` is off).

Top level, ``rebalance``: ``enabled``, and while on ``interval_seconds``,
``quiet_seconds``, ``rounds``, ``closes``, ``last_round_at``, ``last_acted_at`` (the
last round that closed a connection), ``last_result`` (``acted`` or why the last round
did not act: ``no skew``, ``nothing quiet``, ``an upstream is draining``, ...) and
``last_detail`` (the upstream that blocked it, or what was closed). ``stall_check``:
``enabled``, and while on ``timeout_seconds`` (``--stall-timeout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from extractedprism.discovery.status import DiscoveryView
from extractedprism.upstreams.activity import STALL_CHECK_RESULTS

if TYPE_CHECKING:
    from extractedprism.upstreams.snapshot import Snapshot, UpstreamView


def rfc3339(wall: float | None) -> str | None:
    """Unix time -> ``YYYY-MM-DDTHH:MM:SS.mmm+HH:MM`` in the local zone (None stays None)."""
    if wall is None:
        return None
    return datetime.fromtimestamp(wall, UTC).astimezone().isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class ProcessInfo:
    """What the document says about the process itself."""

    version: str
    started: float  # wall time
    relay: str  # "native" | "python"
    discovery: DiscoveryView | None  # None: --enable-discovery=false


class _Clock:
    """Monotonic registry times -> wall times, through one snapshot's pair of clocks."""

    def __init__(self, snap: Snapshot) -> None:
        self._offset = snap.taken_wall - snap.taken_mono

    def __call__(self, mono: float | None) -> str | None:
        return None if mono is None else rfc3339(mono + self._offset)


def upstream_entry(u: UpstreamView, wall: _Clock, live: int = 0) -> dict[str, Any]:
    admin = None
    if u.admin is not None:
        admin = {"action": u.admin.action, "uid": u.admin.uid, "at": wall(u.admin.at)}
    return {
        "address": u.address,
        "source": list(u.sources),
        "state": u.state,
        "since": wall(u.since),
        "healthy": u.healthy,
        "draining": u.draining,
        "draining_reason": u.draining_reason,
        "close_deadline": wall(u.close_deadline),
        "ready": u.ready if u.readiness != "n/a" else None,
        "readiness": u.readiness,
        "ready_reason": u.ready_reason,
        "failures": u.failures,
        "last_check_at": wall(u.last_check_at),
        "last_check_error": u.last_check_error,
        "last_error_source": u.last_error_source or None,
        "tier": u.tier,
        "rtt_seconds": u.rtt_seconds,
        "active_connections": u.active_connections,
        "total_connections": u.total_connections,
        "dials_in_flight": u.dials_in_flight,
        "dial_stalled": u.dial_stalled,
        "bytes_up": u.bytes_up,
        "bytes_down": u.bytes_down,
        "answer_hedges": {o: dict(u.answer_hedges).get(o, 0) for o in ("won", "lost", "silent")},
        "admin": admin,
        "connection_share": round(u.active_connections / live, 4) if live else 0.0,
        "fair_share": None if u.fair_share is None else round(u.fair_share, 2),
        "weight": None if u.weight is None else round(u.weight, 3),
        "rebalance_closes": u.rebalance_closes,
        "stalls": u.stalls,
        "stalled_connections": u.stalled_connections,
        "suspect": u.suspect,
        "stall_checks": None if u.stalls is None else {
            r: dict(u.stall_checks).get(r, 0) for r in STALL_CHECK_RESULTS},
        "slow_not_counted": u.slow_not_counted,
    }


def rebalance_entry(snap: Snapshot, wall: _Clock) -> dict[str, Any]:
    r = snap.rebalance
    if r is None:
        return {"enabled": False}
    return {"enabled": True, "interval_seconds": r.interval, "quiet_seconds": r.quiet,
            "rounds": r.rounds, "closes": r.closes, "last_round_at": wall(r.last_round_at),
            "last_acted_at": wall(r.last_acted_at), "last_result": r.last_reason or None,
            "last_detail": r.last_detail or None}


def stall_entry(snap: Snapshot) -> dict[str, Any]:
    if snap.stall_timeout <= 0:
        return {"enabled": False}
    return {"enabled": True, "timeout_seconds": snap.stall_timeout}


def discovery_entry(d: DiscoveryView | None) -> dict[str, Any]:
    if d is None:
        return {"enabled": False}
    return {"enabled": True, "connected": d.connected, "last_event": rfc3339(d.last_event),
            "last_error": d.last_error or None}


def upstreams_document(snap: Snapshot, info: ProcessInfo) -> dict[str, Any]:
    """The whole ``/upstreams`` body."""
    wall = _Clock(snap)
    return {
        "version": info.version,
        "started": rfc3339(info.started),
        "relay": info.relay,
        "panic": snap.panic,
        "connections_active": snap.connections_active,
        "max_connections": snap.max_connections,
        "discovery": discovery_entry(info.discovery),
        "rebalance": rebalance_entry(snap, wall),
        "stall_check": stall_entry(snap),
        "upstreams": [upstream_entry(u, wall, snap.connections_active)
                      for u in snap.upstreams],
    }
