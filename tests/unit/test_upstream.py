"""The pure upstream state machine, from tables: no threads, no clock, no registry."""

from __future__ import annotations

import logging

import pytest

from extractedprism.upstreams import state as sm
from extractedprism.upstreams.state import (
    Lifecycle,
    ProbeResult,
    Readiness,
    UpstreamState,
    on_dial,
    on_probe,
    pickable,
)

OK = ProbeResult(True, 0.001, "")
DOWN = ProbeResult(False, None, "connection refused")
READY = ProbeResult(True, 0.001, "", ready=True)
UNREADY = ProbeResult(True, 0.001, "", ready=False, ready_reason="HTTP 500")

NEW = UpstreamState()
UNHEALTHY = UpstreamState(healthy=False, fail_streak=2)
IS_READY = UpstreamState(readiness=Readiness.READY, probed_ready=True)


def probes(state: UpstreamState, *results: ProbeResult, readyz: bool = False
           ) -> tuple[UpstreamState, list[str]]:
    lines = []
    for r in results:
        state, ts = on_probe(state, r, readyz=readyz)
        lines += [f"{t.before}->{t.after}" for t in ts]
    return state, lines


# "two consecutive failures exclude an upstream, one success re-includes it"
@pytest.mark.parametrize("start,inputs,healthy,lines", [
    (NEW, [DOWN], True, []),
    (NEW, [DOWN, DOWN], False, ["healthy->unhealthy"]),
    (NEW, [DOWN, OK, DOWN], True, []),  # a success resets the streak
    (UNHEALTHY, [OK], True, ["unhealthy->healthy"]),
    (UNHEALTHY, [DOWN], False, []),  # no line per interval
])
def test_tcp_streak(start, inputs, healthy, lines):
    state, got = probes(start, *inputs)
    assert state.healthy is healthy
    assert [x for x in got if "healthy" in x] == lines


# "Failed and successful client dials count toward the same streak"
def test_dials_and_probes_share_the_streak():
    state, _ = on_probe(NEW, DOWN, readyz=False)
    state, ts, probe = on_dial(state, False, "refused", readyz=False)
    assert not state.healthy and ts[0].health_flipped and ts[0].level == logging.WARNING
    assert ts[0].reason == "dial: refused" and not probe
    state, ts, _ = on_dial(state, True, "", readyz=False)
    assert state.healthy and [t.reason for t in ts] == ["dial succeeded"]


def test_a_plain_successful_dial_changes_nothing():
    state, ts, probe = on_dial(NEW, True, "", readyz=True)
    assert state is NEW and ts == [] and probe is False


# "two consecutive failures mark the upstream not ready and one success restores it"
# "A new upstream ... counts as not ready until its next probe passes"
@pytest.mark.parametrize("start,inputs,readiness", [
    (NEW, [], Readiness.PENDING),
    (NEW, [READY], Readiness.READY),
    (NEW, [UNREADY], Readiness.UNREADY),  # after a reset one failure settles it
    (IS_READY, [UNREADY], Readiness.READY),
    (IS_READY, [UNREADY, UNREADY], Readiness.UNREADY),
    (IS_READY, [UNREADY, READY, UNREADY], Readiness.READY),
    (UpstreamState(readiness=Readiness.UNREADY), [READY], Readiness.READY),
])
def test_readiness_streak(start, inputs, readiness):
    state, _ = probes(start, *inputs, readyz=True)
    assert state.readiness is readiness


# "... and one that becomes reachable again after a TCP failure, counts as not ready
# until its next probe passes; that probe runs right after the successful connect"
def test_reachable_again_after_a_tcp_failure_is_pending_and_probed_now():
    state, _ = probes(IS_READY, DOWN, DOWN, readyz=True)
    assert state.readiness is Readiness.UNREADY  # a TCP-dead ready upstream loses conns
    state, ts, probe = on_dial(state, True, "", readyz=True)
    assert probe and state.healthy and state.readiness is Readiness.PENDING
    assert [f"{t.before}->{t.after}" for t in ts] == ["unhealthy->healthy", "unready->pending"]
    state, _ = probes(state, UNREADY, readyz=True)  # one failure settles a reset
    assert state.readiness is Readiness.UNREADY


def test_tcp_failure_without_readyz_never_touches_readiness():
    state, lines = probes(IS_READY, DOWN, DOWN)
    assert state.readiness is Readiness.READY
    assert lines == ["->failed", "healthy->unhealthy"]  # the check error, then health
    assert not state.tcp_failed_since_probe


def test_check_errors_are_reported_once_per_change():
    state, ts = on_probe(NEW, DOWN, readyz=False)
    assert [(t.kind, t.reason) for t in ts] == [("check", "connection refused")]
    state, ts = on_probe(state, DOWN, readyz=False)
    assert [t.kind for t in ts] == ["health"]  # same error: no second "check failed"
    state, ts = on_probe(state, OK, readyz=False)
    assert state.last_check_error == ""


# "healthy and not draining", the one definition
@pytest.mark.parametrize("state,expected", [
    (NEW, True),
    (UNHEALTHY, False),
    (sm.drain(NEW), False),
    (sm.undrain(sm.drain(NEW)), True),
])
def test_pickable(state, expected):
    assert pickable(state) is expected is state.pickable


def test_drain_lifecycle_and_checks():
    assert sm.drain(NEW).lifecycle is Lifecycle.DRAINING
    assert Lifecycle.DRAINING not in sm.TAKES_CHECKS and Lifecycle.ACTIVE in sm.TAKES_CHECKS


# "When an upstream has failed its probes while another healthy upstream is ready, its
# connections are closed after --drain-timeout"; "With no upstream ready, existing
# connections stay"; "so do the connections of an upstream whose first probe after a
# reset is still pending"
@pytest.mark.parametrize("readiness,draining,another_ready,expected", [
    (Readiness.UNREADY, False, True, True),
    (Readiness.UNREADY, False, False, False),
    (Readiness.PENDING, False, True, False),
    (Readiness.READY, False, True, False),
    (Readiness.UNREADY, True, True, False),
])
def test_loses_connections(readiness, draining, another_ready, expected):
    state = UpstreamState(readiness=readiness)
    if draining:
        state = sm.drain(state)
    assert sm.loses_connections(state, another_ready) is expected


UNREADY_STATE = UpstreamState(readiness=Readiness.UNREADY)


# "its connections are closed after --drain-timeout ... (0 closes them at once)";
# "The closing is called off if, before the timeout, the upstream turns ready again or
# no other healthy upstream is ready any more."
@pytest.mark.parametrize("state,another,deadline,now,drain,expected", [
    (UNREADY_STATE, True, None, 100.0, 30.0, (130.0, False, "scheduled")),
    (UNREADY_STATE, True, None, 100.0, 0.0, (None, True, "closed")),
    (UNREADY_STATE, True, 130.0, 129.9, 30.0, (130.0, False, "")),
    (UNREADY_STATE, True, 130.0, 130.0, 30.0, (160.0, True, "closed")),
    (IS_READY, True, 130.0, 110.0, 30.0, (None, False, "ready again")),
    (UNREADY_STATE, False, 130.0, 110.0, 30.0, (None, False, "no other upstream is ready")),
    (UpstreamState(), True, None, 100.0, 30.0, (None, False, "")),  # pending: stays
])
def test_unready_close(state, another, deadline, now, drain, expected):
    assert sm.unready_close(state, another, deadline, now, drain) == expected


# --health-recheck: after which check does the confirming one come sooner? Exactly when
# the upstream is one failure short of exclusion (FAILURE_THRESHOLD = 2).
@pytest.mark.parametrize("start,inputs,readyz,expected", [
    (NEW, [OK], False, False),
    (NEW, [DOWN], False, True),  # healthy, 1 of 2 TCP failures
    (NEW, [DOWN, DOWN], False, False),  # excluded: nothing left to confirm
    (NEW, [DOWN, OK], False, False),  # one success resets the streak
    (UNHEALTHY, [DOWN], False, False),  # already out
    (IS_READY, [UNREADY], True, True),  # ready, 1 of 2 /readyz failures
    (IS_READY, [UNREADY, UNREADY], True, False),  # unready now
    (IS_READY, [UNREADY, READY], True, False),
    (IS_READY, [DOWN], True, True),  # ready and healthy, 1 TCP failure
    (NEW, [UNREADY], True, False),  # pending: one failed probe settles it at once
])
def test_awaits_confirmation(start, inputs, readyz, expected):
    state, _ = probes(start, *inputs, readyz=readyz)
    assert sm.awaits_confirmation(state) is expected


def test_a_failed_dial_also_leaves_a_healthy_upstream_awaiting_confirmation():
    state, _, _ = on_dial(NEW, False, "refused", readyz=False)
    assert sm.awaits_confirmation(state)
    state, _, _ = on_dial(state, False, "refused", readyz=False)
    assert not state.healthy and not sm.awaits_confirmation(state)
