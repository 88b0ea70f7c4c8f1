"""The operator's view and hands in the registry, with an injected clock (issue 15):
state words and their ``since``, dial-marked errors, admin drain / undrain / close with
the close plan spread over --drain-timeout, the refusal, dial times, turned-away clients."""

from __future__ import annotations

import random

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.actions import AdminActions
from extractedprism.upstreams.registry import Registry
from tests.unit.test_registry import DOWN, EPS, OK, Clock, Conn, picked, ready

A, B, C = (str(e) for e in EPS)


def make(readyz: bool = False, drain: float = 30.0) -> tuple[Registry, Clock]:
    clock = Clock()
    reg = Registry(readyz=readyz, drain_timeout=drain, clock=clock, rng=random.Random(1),
                   wall_clock=lambda: 1796150000.0 + clock.now)
    reg.membership.set_endpoints(EPS)
    return reg, clock


def view(reg: Registry, addr: str):  # type: ignore[no-untyped-def]
    v = reg.snapshot().get(addr)
    assert v is not None
    return v


def attach(reg: Registry, addr: str, n: int) -> list[Conn]:
    conns = [Conn(f"c{i}") for i in range(n)]
    for c in conns:
        assert reg.conns.attach(addr, c)
    return conns


# -- the pure state machine ---------------------------------------------------------------


@pytest.mark.parametrize(("state", "closing", "word"), [
    (sm.UpstreamState(), False, "healthy"),
    (sm.UpstreamState(healthy=False), False, "unhealthy"),
    (sm.UpstreamState(), True, "closing-unready"),
    (sm.UpstreamState(healthy=False), True, "unhealthy"),
    (sm.UpstreamState(admin="drain", healthy=False), True, "admin-drain"),
    (sm.UpstreamState(admin="close"), False, "admin-drain"),
    (sm.UpstreamState(lifecycle=sm.Lifecycle.DRAINING, admin="drain"), True, "draining"),
])
def test_state_word(state: sm.UpstreamState, closing: bool, word: str) -> None:
    assert sm.state_word(state, closing_unready=closing) == word


def test_errors_remember_who_saw_them() -> None:
    s = sm.UpstreamState()
    s, _, _ = sm.on_dial(s, False, "connection refused", readyz=False)
    assert (s.last_check_error, s.last_error_source) == ("connection refused", "dial")
    s, _, _ = sm.on_dial(s, True, "", readyz=False)
    assert (s.last_check_error, s.last_error_source) == ("", "")
    s, _ = sm.on_probe(s, DOWN, readyz=False)
    assert (s.last_check_error, s.last_error_source) == ("connection refused", "probe")
    s, _, _ = sm.on_dial(s, True, "", readyz=False)  # a dial does not clear a probe's error
    assert s.last_error_source == "probe"
    s, _ = sm.on_probe(s, OK, readyz=False)
    assert (s.last_check_error, s.last_error_source) == ("", "")


def test_ready_reason_follows_readiness() -> None:
    s = sm.UpstreamState()
    assert s.ready_reason == sm.PENDING_REASON
    s, _ = sm.on_probe(s, ready(True), readyz=True)
    assert s.ready_reason == "readyz answered 200"
    s, _ = sm.on_probe(s, ready(False), readyz=True)
    assert s.ready and "1 failed probe: HTTP 500" in s.ready_reason
    s, _ = sm.on_probe(s, ready(False), readyz=True)
    assert not s.ready and s.ready_reason == "HTTP 500"
    s, _ = sm.on_probe(s, ready(True), readyz=True)
    s, _ = sm.on_probe(s, DOWN, readyz=True)
    s, _ = sm.on_probe(s, DOWN, readyz=True)
    assert s.ready_reason == "TCP probe failed"
    s, _, _ = sm.on_dial(s, True, "", readyz=True)
    assert "reachable again" in s.ready_reason


# -- the registry -------------------------------------------------------------------------


def test_since_moves_only_when_the_word_changes() -> None:
    reg, clock = make()
    assert view(reg, A).since == 1000.0 and view(reg, A).state == "healthy"
    clock.now = 1010.0
    reg.verdicts.record_probe(A, DOWN)
    assert view(reg, A).since == 1000.0  # one failure: still healthy
    assert view(reg, A).failures == 1 and view(reg, A).last_check_at == 1010.0
    clock.now = 1020.0
    reg.verdicts.record_probe(A, DOWN)
    assert (view(reg, A).state, view(reg, A).since) == ("unhealthy", 1020.0)
    snap = reg.snapshot()
    assert snap.taken_mono == 1020.0 and snap.taken_wall == 1796150000.0 + 1020.0


def test_dials_mark_and_say_so_and_their_times_are_kept() -> None:
    reg, clock = make()
    clock.now = 1005.0
    reg.verdicts.record_dial(A, False, "connection refused", duration=0.002)
    reg.verdicts.record_dial(A, False, "connection refused", duration=0.003)
    v = view(reg, A)
    assert (v.state, v.last_error_source, v.last_check_error) == (
        "unhealthy", "dial", "connection refused")
    assert v.last_check_at == 1005.0 and v.since == 1005.0 and v.failures == 2
    reg.verdicts.record_dial(B, True, duration=0.0001)
    assert view(reg, A).dials.count == 2 and abs(view(reg, A).dials.total - 0.005) < 1e-9
    assert view(reg, B).dials.count == 1
    assert view(reg, C).dials.count == 0


def test_turned_away_clients_are_counted() -> None:
    reg, _ = make()
    reg.verdicts.record_no_upstream()
    reg.verdicts.record_no_upstream()
    assert reg.snapshot().turned_away == 2


def test_removed_and_unready_closes_show_reason_and_deadline() -> None:
    reg, clock = make(readyz=True, drain=30.0)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(True))
    attach(reg, A, 1)
    attach(reg, B, 1)
    clock.now = 1100.0
    reg.membership.set_endpoints(EPS[1:])
    v = view(reg, A)
    assert (v.state, v.draining, v.draining_reason, v.close_deadline) == (
        "draining", True, "removed", 1130.0)
    reg.verdicts.record_probe(B, ready(False))
    reg.verdicts.record_probe(B, ready(False))
    v = view(reg, B)
    assert (v.state, v.draining, v.draining_reason, v.close_deadline) == (
        "closing-unready", False, "unready", 1130.0)
    assert v.since == 1100.0


def test_drain_stops_picks_keeps_connections_and_probes() -> None:
    reg, clock = make()
    (conn,) = attach(reg, A, 1)
    assert AdminActions(reg).drain(A, 1000)[0] == 0
    v = view(reg, A)
    assert (v.state, v.draining, v.draining_reason, v.pickable) == (
        "admin-drain", False, "admin", False)
    assert v.admin is not None and (v.admin.action, v.admin.uid) == ("drain", 1000)
    assert all(str(picked(reg)) != A for _ in range(50))
    assert not reg.conns.attach(A, Conn("late"))  # a dial in flight when the drain came
    assert A in {str(e) for e in reg.probe_targets()}
    clock.now = 2000.0
    assert reg.membership.tick() is None and not conn.closed
    # Probed while drained: it turns unhealthy, and undrain does not make it pickable.
    reg.verdicts.record_probe(A, DOWN)
    reg.verdicts.record_probe(A, DOWN)
    code, message = AdminActions(reg).undrain(A, 1000)
    assert code == 0 and "unhealthy" in message
    assert view(reg, A).state == "unhealthy" and view(reg, A).admin is None
    assert all(str(picked(reg)) != A for _ in range(50))
    reg.verdicts.record_probe(A, OK)
    assert view(reg, A).pickable


def test_close_spreads_over_the_drain_timeout() -> None:
    reg, clock = make(drain=30.0)
    conns = attach(reg, A, 3)
    code, message = AdminActions(reg).close(A, 0)
    assert code == 0 and "3 connection(s)" in message
    v = view(reg, A)
    assert (v.state, v.draining_reason, v.close_deadline) == ("admin-drain", "admin", 1030.0)
    assert v.admin is not None and v.admin.action == "close"
    assert reg.membership.tick() == 1010.0
    clock.now = 1010.0
    assert reg.membership.tick() == 1020.0
    assert [c.closed for c in conns] == [True, False, False]
    reg.conns.detach(A, conns[0])
    reg.conns.detach(A, conns[2])  # ended by itself: its turn is dropped
    assert view(reg, A).close_deadline == 1020.0
    clock.now = 1020.0
    assert reg.membership.tick() is None
    assert conns[1].closed
    reg.conns.detach(A, conns[1])
    assert view(reg, A).close_deadline is None and view(reg, A).state == "admin-drain"
    assert not reg.conns.attach(A, Conn("new"))


def test_close_with_zero_drain_timeout_closes_at_once() -> None:
    reg, _ = make(drain=0.0)
    conns = attach(reg, A, 2)
    assert AdminActions(reg).close(A, 0)[0] == 0
    assert all(c.closed for c in conns)


def test_close_refused_without_another_healthy_upstream_unless_forced() -> None:
    reg, _ = make()
    for addr in (B, C):
        reg.verdicts.record_probe(addr, DOWN)
        reg.verdicts.record_probe(addr, DOWN)
    (conn,) = attach(reg, A, 1)
    code, message = AdminActions(reg).close(A, 0)
    assert code == 1 and "no other healthy upstream" in message and "--force" in message
    assert view(reg, A).admin is None and not conn.closed
    assert AdminActions(reg).close(A, 0, force=True)[0] == 0


def test_close_in_readyz_mode_needs_another_ready_one() -> None:
    reg, _ = make(readyz=True)
    reg.verdicts.record_probe(A, ready(True))
    reg.verdicts.record_probe(B, ready(False))  # healthy, not ready
    code, message = AdminActions(reg).close(A, 0)
    assert code == 1 and "no other ready upstream" in message
    reg.verdicts.record_probe(C, ready(True))
    assert AdminActions(reg).close(A, 0)[0] == 0
    # A drained (or closed) upstream does not count as the "other" one either.
    assert AdminActions(reg).close(C, 0)[0] == 1


def test_a_drained_ready_upstream_does_not_trigger_readiness_closes_elsewhere() -> None:
    reg, _ = make(readyz=True)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(True))
    AdminActions(reg).drain(B, 0)
    AdminActions(reg).drain(C, 0)
    attach(reg, A, 1)
    reg.verdicts.record_probe(A, ready(False))
    reg.verdicts.record_probe(A, ready(False))
    # Only drained upstreams are ready: A keeps its connections (no close scheduled).
    assert view(reg, A).state == "healthy" and view(reg, A).close_deadline is None


def test_unknown_addresses() -> None:
    reg, _ = make()
    assert AdminActions(reg).drain("10.9.9.9:6443", 0)[0] == 2
    assert AdminActions(reg).undrain("10.9.9.9:6443", 0)[0] == 2
    assert AdminActions(reg).close("10.9.9.9:6443", 0)[0] == 2
    assert sorted(AdminActions(reg).known_addresses()) == sorted([A, B, C])


def test_every_upstream_drained_means_panic_and_not_ready() -> None:
    reg, _ = make()
    for addr in (A, B, C):
        AdminActions(reg).drain(addr, 0)
    assert not reg.healthy()
    assert picked(reg) is None and reg.picks.panic_order() == []
    assert reg.snapshot().panic
    AdminActions(reg).undrain(B, 0)
    assert reg.healthy() and str(picked(reg)) == B


def test_drain_survives_a_readd_but_not_a_completed_removal() -> None:
    reg, _ = make(drain=30.0)
    attach(reg, A, 1)
    AdminActions(reg).drain(A, 0)
    reg.membership.set_endpoints(EPS[1:])
    assert view(reg, A).state == "draining"
    reg.membership.set_endpoints(EPS)  # re-added before the drain completed
    assert view(reg, A).state == "admin-drain"
    reg2, _ = make(drain=0.0)
    AdminActions(reg2).drain(A, 0)
    reg2.membership.set_endpoints(EPS[1:])
    reg2.membership.set_endpoints(EPS)
    assert view(reg2, A).state == "healthy" and view(reg2, A).admin is None
    assert isinstance(EPS[0], Endpoint)


def test_the_messages_of_drain_and_undrain() -> None:
    reg, _ = make(drain=30.0)
    ops = AdminActions(reg)
    attach(reg, A, 2)
    assert ops.drain(A, 0) == (0, f"drained {A}: no new connections; its 2 existing "
                                  "connection(s) stay")
    assert ops.drain(A, 0) == (0, f"{A} was already drained")
    assert ops.undrain(A, 0) == (0, f"undrained {A}: back in service")
    assert ops.undrain(A, 0) == (0, f"{A} was not drained")
    assert ops.close(B, 0)[0] == 0
    # A close is not weakened to a drain: the mark stays "close".
    assert ops.drain(B, 0) == (0, f"{B} is already closed by an operator (undrain it first)")
    assert view(reg, B).admin is not None and view(reg, B).admin.action == "close"
    ops.drain(A, 0)
    reg.membership.set_endpoints(EPS[1:])  # A is removed and drains its two connections
    assert ops.undrain(A, 0) == (0, f"undrained {A}; it stays draining: it was removed "
                                    "from the endpoints")
    reg, _ = make(readyz=True)
    ops = AdminActions(reg)
    reg.verdicts.record_probe(A, ready(False))
    ops.drain(A, 0)
    assert ops.undrain(A, 0) == (0, f"undrained {A}; readyz says not ready: new "
                                    "connections prefer others")
