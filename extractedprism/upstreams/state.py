"""One upstream's state machine (pure): health streak, readiness, lifecycle.

Owns the spec's per-upstream rules ("Load balancer", "Readiness-aware selection",
"Graceful draining") as functions of (state, input) -> (new state, transitions). No
lock, clock, socket or logger: the registry calls these under its lock, keeps the
result in its record, and logs the returned :class:`Transition` records after it
releases the lock. The unit tests drive them from tables.

Rules
-----
* TCP health: two consecutive failures (health checks and client dials feed the same
  streak) make an upstream unhealthy; one success makes it healthy again.
* Readiness (``--health-check=readyz`` only): two consecutive failed /readyz probes make
  a ready upstream unready, one success makes it ready. A new upstream, and one
  reachable again after a TCP failure, is PENDING (not ready) until its next probe,
  which settles it either way. An upstream that turns TCP-unhealthy while ready
  becomes unready, so it loses its long-lived connections like an unready one.
* Lifecycle: ACTIVE while in the endpoint list; DRAINING once removed (no new
  connections, no health checks, the health value holds) until its connections end or
  --drain-timeout; re-adding it makes it ACTIVE again. FALLBACK (``--static-endpoints=
  fallback``): a static endpoint that discovery's list lacks; still health-checked and
  tried in panic mode, never picked normally (a hedge may take it when every discovered
  upstream left has a stalled dial: eligibility.ranked); listed by discovery
  again, it is ACTIVE.
* Pickable for a new connection: healthy, not draining, not a fallback and not drained
  by an operator (:func:`pickable`, the one place that says so).
* Operator actions (``extractedprism admin``, kept in memory only): ``admin`` is "" (in
  service), "drain" (no new connections; existing ones stay) or "close" (no new
  connections; the registry closes the existing ones spread over --drain-timeout). An
  admin-drained upstream is still health-checked, so undraining puts it back only when
  it is healthy.
* ``last_check_error`` / ``last_error_source``: the latest failed check's reason and
  whether a health check ("probe") or a client dial ("dial") reported it; a passing
  probe clears both, a successful dial clears a dial's.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Protocol

FAILURE_THRESHOLD = 2  # consecutive failures that exclude an upstream (spec)


@dataclass(frozen=True)
class ProbeResult:
    """One health check's outcome (made by probes.py, consumed by :func:`on_probe`)."""

    ok: bool  # TCP connect succeeded
    rtt: float | None  # connect time in seconds incl. name resolution (set when ok)
    reason: str  # "" when ok, else short: "connection refused", "timeout", ...
    ready: bool | None = None  # /readyz outcome; None when not probed
    ready_reason: str = ""  # "" when ready, else "HTTP 500", "TLS verify failed: ..."


class Readiness(enum.Enum):
    PENDING = "pending"  # new, or reachable again after a TCP failure; next probe decides
    READY = "ready"
    UNREADY = "unready"


class Lifecycle(enum.Enum):
    """Where the upstream stands with respect to the endpoint list.

    New states (an operator's drain or close, a demoted static "fallback" endpoint) go
    here, with their rule in :func:`pickable`, :data:`TAKES_CHECKS`, and the
    transition functions below (:func:`drain`, :func:`undrain`).
    """

    ACTIVE = "active"  # in the merged endpoint list
    DRAINING = "draining"  # removed: connections finish within --drain-timeout
    FALLBACK = "fallback"  # static, not in discovery's list: last resort (panic mode)


# Lifecycles whose upstreams are health-checked.
TAKES_CHECKS = frozenset({Lifecycle.ACTIVE, Lifecycle.FALLBACK})
# Lifecycles that are in the endpoint list (the others drain).
LISTED = frozenset({Lifecycle.ACTIVE, Lifecycle.FALLBACK})


class _HealthAndDrain(Protocol):
    @property
    def healthy(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def fallback(self) -> bool: ...

    @property
    def admin_drained(self) -> bool: ...


def pickable(u: _HealthAndDrain) -> bool:
    """Eligible for a new connection: healthy, not draining, not a fallback, not drained
    by an operator."""
    return u.healthy and not u.draining and not u.fallback and not u.admin_drained


ADMIN_ACTIONS = ("drain", "close")
PENDING_REASON = "waiting for the first readyz probe"


@dataclass(frozen=True, slots=True)
class UpstreamState:
    healthy: bool = True  # new upstreams take picks before their first check (spec)
    fail_streak: int = 0
    readiness: Readiness = Readiness.PENDING
    ready_fail_streak: int = 0
    probed_ready: bool = False  # at least one /readyz probe has run (metric shown)
    tcp_failed_since_probe: bool = False
    lifecycle: Lifecycle = Lifecycle.ACTIVE
    last_check_error: str = ""
    last_error_source: str = ""  # "probe" | "dial" | "" (no error)
    ready_reason: str = PENDING_REASON  # why readiness is what it is (readyz only)
    admin: str = ""  # "" | "drain" | "close" (ADMIN_ACTIONS)

    @property
    def draining(self) -> bool:
        return self.lifecycle is Lifecycle.DRAINING

    @property
    def fallback(self) -> bool:
        return self.lifecycle is Lifecycle.FALLBACK

    @property
    def admin_drained(self) -> bool:
        return bool(self.admin)

    @property
    def pickable(self) -> bool:
        return pickable(self)

    @property
    def ready(self) -> bool:
        return self.readiness is Readiness.READY


@dataclass(frozen=True, slots=True)
class Transition:
    """One change worth a log line: ``upstream <before>-><after> upstream=... reason=...``."""

    kind: str  # "health" | "readiness" | "check"
    before: str
    after: str
    reason: str
    level: int = logging.INFO

    @property
    def health_flipped(self) -> bool:
        return self.kind == "health"


_replace = dataclasses.replace


def on_tcp(s: UpstreamState, ok: bool, reason: str, source: str, *, readyz: bool
           ) -> tuple[UpstreamState, list[Transition]]:
    """One TCP outcome (``source`` is "probe" or "dial") fed into the streak."""
    if ok:
        if s.healthy:
            return (s if s.fail_streak == 0 else _replace(s, fail_streak=0)), []
        return _replace(s, healthy=True, fail_streak=0), [
            Transition("health", "unhealthy", "healthy", f"{source} succeeded")]
    streak = s.fail_streak + 1
    tcp_failed = s.tcp_failed_since_probe or readyz
    if not (s.healthy and streak >= FAILURE_THRESHOLD):
        return _replace(s, fail_streak=streak, tcp_failed_since_probe=tcp_failed), []
    out = [Transition("health", "healthy", "unhealthy", f"{source}: {reason}",
                      logging.WARNING)]
    readiness = s.readiness
    if readyz and readiness is Readiness.READY:
        # It failed at the TCP level: a partitioned or frozen API server must lose its
        # long-lived connections like an unready one, instead of holding them until
        # keepalive gives up.
        readiness = Readiness.UNREADY
        out.append(Transition("readiness", "ready", "unready", f"TCP {source} failed"))
    ready_reason = f"TCP {source} failed" if readiness is not s.readiness else s.ready_reason
    return _replace(s, healthy=False, fail_streak=streak, tcp_failed_since_probe=tcp_failed,
                    readiness=readiness, ready_reason=ready_reason), out


def on_ready(s: UpstreamState, ready: bool, reason: str
             ) -> tuple[UpstreamState, list[Transition]]:
    """One /readyz outcome (after a successful connect)."""
    fresh = s.readiness is Readiness.PENDING or s.tcp_failed_since_probe
    if ready:
        readiness, streak = Readiness.READY, 0
    else:
        streak = s.ready_fail_streak + 1
        readiness = s.readiness
        # After a reset the upstream already counts as not ready, so one failed probe
        # settles it; otherwise two in a row are needed (spec).
        if fresh or streak >= FAILURE_THRESHOLD:
            readiness = Readiness.UNREADY
    if ready:
        why = "readyz answered 200"
    elif readiness is Readiness.READY:
        why = f"still ready after {streak} failed probe: {reason}"
    else:
        why = reason or "readyz probe failed"
    new = _replace(s, readiness=readiness, ready_fail_streak=streak, probed_ready=True,
                   tcp_failed_since_probe=False, ready_reason=why)
    if readiness is s.readiness:
        return new, []
    return new, [Transition("readiness", s.readiness.value, readiness.value,
                            reason or "readyz 200")]


def on_probe(s: UpstreamState, result: ProbeResult, *, readyz: bool
             ) -> tuple[UpstreamState, list[Transition]]:
    """One health check (TCP, then readyz when enabled). Draining upstreams are not
    checked; the caller does not feed them."""
    s, out = on_tcp(s, result.ok, result.reason, "probe", readyz=readyz)
    if result.ok and readyz and result.ready is not None:
        s, more = on_ready(s, result.ready, result.ready_reason)
        out += more
    error = result.reason or result.ready_reason
    if error and (error != s.last_check_error or s.last_error_source != "probe"):
        out.append(Transition("check", "", "failed", error))
    source = "probe" if error else ""
    if error != s.last_check_error or source != s.last_error_source:
        s = _replace(s, last_check_error=error, last_error_source=source)
    return s, out


def serving(s: UpstreamState, *, readyz: bool) -> bool:
    """Takes new connections in the normal course: pickable, and ready with readyz."""
    return s.pickable and (s.ready or not readyz)


def slow_answer(result: ProbeResult) -> bool:
    """Connected, then no answer in time: the readyz request (or its TLS handshake) ran
    out of --health-timeout. A refusal, a reset, a TLS error or a non-200 answer is an
    answer; a frozen server and an overloaded one both look like this."""
    return result.ok and result.ready is False and result.ready_reason == "timeout"


def kept(s: UpstreamState, error: str, source: str) -> UpstreamState:
    """A slow answer --overload-guard does not count (no faster upstream serves): the
    streaks stay where they were; the error shows as the latest check's."""
    return _replace(s, last_check_error=error, last_error_source=source)


def awaits_confirmation(s: UpstreamState) -> bool:
    """One failure short of exclusion: a healthy upstream with a TCP failure streak, or
    a ready one with a failed /readyz streak. The check that would confirm it runs
    after --health-recheck instead of a whole interval (HAProxy's ``fastinter``)."""
    return ((s.healthy and 0 < s.fail_streak < FAILURE_THRESHOLD)
            or (s.readiness is Readiness.READY
                and 0 < s.ready_fail_streak < FAILURE_THRESHOLD))


def excluded(s: UpstreamState) -> bool:
    """Failed checks (or dials) have taken it out of service: TCP-unhealthy, or unready
    (readyz). The stall check asks for checks only of upstreams that are not, and closes
    stalled connections at the moment one becomes so (``--stall-timeout``)."""
    return not s.healthy or s.readiness is Readiness.UNREADY


def dial_success_changes(s: UpstreamState) -> bool:
    """Whether a successful dial changes anything: a failure streak to clear, or (after a
    TCP failure) a readiness to reset. Mostly not: every new connection asks."""
    return s.fail_streak != 0 or s.tcp_failed_since_probe


def on_dial(s: UpstreamState, ok: bool, reason: str, *, readyz: bool
            ) -> tuple[UpstreamState, list[Transition], bool]:
    """A client dial's outcome; the bool says "probe it now" (readiness reset)."""
    if ok and not dial_success_changes(s):
        return s, [], False  # the common case: nothing changes
    was_failed = s.tcp_failed_since_probe
    s, out = on_tcp(s, ok, reason, "dial", readyz=readyz)
    # A failed dial is a failed check as far as the operator can tell (it counts toward
    # the same streak); a successful one clears only what a dial reported.
    if not ok:
        s = _replace(s, last_check_error=reason, last_error_source="dial")
    elif s.last_error_source == "dial":
        s = _replace(s, last_check_error="", last_error_source="")
    if not (ok and readyz and was_failed):
        return s, out, False
    # Reachable again after a TCP failure: not ready until the probe that runs now passes.
    if s.readiness is not Readiness.PENDING:
        out.append(Transition("readiness", s.readiness.value, "pending",
                              "reachable again after TCP failure"))
    return _replace(s, readiness=Readiness.PENDING, ready_fail_streak=0,
                    ready_reason="reachable again after a TCP failure; waiting for the next "
                    "readyz probe"), out, True


def drain(s: UpstreamState) -> UpstreamState:
    """Removed from the endpoint list."""
    return _replace(s, lifecycle=Lifecycle.DRAINING)


def undrain(s: UpstreamState) -> UpstreamState:
    """Re-added before its drain completed: the drain is aborted."""
    return _replace(s, lifecycle=Lifecycle.ACTIVE)


def listed(s: UpstreamState, *, fallback: bool) -> UpstreamState:
    """In the new endpoint list, as an ordinary upstream or as a fallback (a drain, if
    any, is aborted)."""
    want = Lifecycle.FALLBACK if fallback else Lifecycle.ACTIVE
    return s if s.lifecycle is want else _replace(s, lifecycle=want)


def admin_set(s: UpstreamState, action: str) -> UpstreamState:
    """An operator's drain or close ("" puts it back in service)."""
    assert action in ("", *ADMIN_ACTIONS), action
    return s if s.admin == action else _replace(s, admin=action)


def state_word(s: UpstreamState, *, closing_unready: bool) -> str:
    """The one word /upstreams and `status` show: what happens to new connections and
    to the existing ones, most consequential first."""
    if s.lifecycle is not Lifecycle.ACTIVE:
        return s.lifecycle.value  # "draining" (removed from the endpoint list), ...
    if s.admin:
        return "admin-drain"
    if not s.healthy:
        # A TCP failure says more than readiness; an unready close still shows in
        # draining_reason and close_deadline.
        return "unhealthy"
    return "closing-unready" if closing_unready else "healthy"


def loses_connections(s: UpstreamState, another_ready: bool) -> bool:
    """Readiness moves connections: an unready upstream's are closed after
    --unready-drain-timeout (default --drain-timeout, the spec's) while another healthy
    upstream is ready (spec)."""
    return s.readiness is Readiness.UNREADY and not s.draining and another_ready


def unready_close(s: UpstreamState, another_ready: bool, deadline: float | None, now: float,
                  drain_timeout: float) -> tuple[float | None, bool, str]:
    """The close deadline of an unready upstream's connections, at ``now``
    (``drain_timeout``: --unready-drain-timeout).

    Returns (new deadline, close its connections now, what happened): "scheduled",
    "closed", the reason it was called off, or "" for no change. The closing is called
    off if, before the timeout, the upstream turns ready again or no other healthy
    upstream is ready any more (spec).
    """
    should = loses_connections(s, another_ready)
    if should and deadline is None:
        if drain_timeout <= 0:
            return None, True, "closed"
        return now + drain_timeout, False, "scheduled"
    if not should and deadline is not None:
        return None, False, ("ready again" if s.readiness is not Readiness.UNREADY
                             else "no other upstream is ready")
    if should and deadline is not None and now >= deadline:
        return now + drain_timeout, True, "closed"
    return deadline, False, ""
