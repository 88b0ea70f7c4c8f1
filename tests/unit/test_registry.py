"""Registry state machine with an injected clock: streaks, readiness, deadlines, metrics."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.util import sample

A, B, C = "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"
EPS = [Endpoint("10.0.0.1", 6443), Endpoint("10.0.0.2", 6443), Endpoint("10.0.0.3", 6443)]
OK = ProbeResult(True, 0.001, "")
DOWN = ProbeResult(False, None, "connection refused")


def ready(flag: bool) -> ProbeResult:
    return ProbeResult(True, 0.001, "", ready=flag, ready_reason="" if flag else "HTTP 500")


def all_ready(reg: Registry) -> None:
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(True))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Conn:
    def __init__(self, name: str) -> None:
        self.client = name
        self.started = 0.0
        self.bytes_up = self.bytes_down = self.up_answered = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True


def picked(reg: Registry, exclude: Iterable[str] = ()) -> Endpoint | None:
    """The upstream a new connection gets now, through the product's own path
    (``reserve``), the reservation then released unused as after a failed dial."""
    res = reg.picks.reserve(exclude)
    if res is None:
        return None
    res.release()
    return res.endpoint


def make(readyz: bool = False, drain: float = 30.0, selection: str = "random"
         ) -> tuple[Registry, Clock, Metrics, list[str]]:
    clock, metrics, probes = Clock(), Metrics(), []

    def changed(change: Change) -> None:
        if change.what == "probe-now":
            probes.append(change.address)

    reg = Registry(readyz=readyz, drain_timeout=drain, clock=clock,
                   selection=selection, rng=random.Random(1), on_change=changed)
    metrics.attach_state(reg.snapshot)
    reg.membership.set_endpoints(EPS)
    return reg, clock, metrics, probes


def test_two_failures_exclude_one_success_restores():
    reg, *_ = make()
    reg.verdicts.record_probe(A, DOWN)
    assert reg.snapshot().get(A).healthy  # one failure is not enough
    reg.verdicts.record_dial(A, False, "refused")  # a dial failure counts toward the same streak
    assert not reg.snapshot().get(A).healthy
    assert all(picked(reg) != EPS[0] for _ in range(50))
    reg.verdicts.record_dial(A, True)  # one success (a dial here) re-includes it
    assert reg.snapshot().get(A).healthy


def test_success_resets_the_streak():
    reg, *_ = make()
    reg.verdicts.record_probe(A, DOWN)
    reg.verdicts.record_probe(A, OK)
    reg.verdicts.record_probe(A, DOWN)
    assert reg.snapshot().get(A).healthy


def test_new_upstream_is_pickable_before_its_first_check():
    reg, *_ = make()
    assert {picked(reg) for _ in range(100)} == set(EPS)


def test_drain_deadline_and_removal_with_clock():
    reg, clock, metrics, _ = make(drain=30)
    c = Conn("c1")
    assert picked(reg, exclude=[B, C]) == EPS[0]
    assert reg.conns.attach(A, c)
    reg.verdicts.record_dial(A, False, "x")  # a counter series for A exists
    reg.membership.set_endpoints(EPS[1:])
    assert reg.snapshot().get(A).draining
    clock.now += 29.9
    assert reg.membership.tick() == pytest.approx(1030.0)
    assert not c.closed
    clock.now += 0.2
    reg.membership.tick()
    assert c.closed and reg.snapshot().get(A) is None
    assert sample(metrics, "extractedprism_connection_errors_total", {"upstream": A}) is None
    reg.verdicts.record_dial(A, False, "late")  # not counted until added again
    assert sample(metrics, "extractedprism_connection_errors_total", {"upstream": A}) is None


def test_draining_upstream_ignores_health_checks_and_holds_status():
    reg, *_ = make()
    reg.conns.attach(A, Conn("c"))
    reg.membership.set_endpoints(EPS[1:])
    reg.verdicts.record_probe(A, DOWN)
    reg.verdicts.record_probe(A, DOWN)
    assert reg.snapshot().get(A).healthy  # checks stop while draining: the value holds


def test_readd_aborts_drain_and_keeps_connections():
    reg, clock, *_ = make(drain=5)
    c = Conn("c")
    reg.conns.attach(A, c)
    reg.membership.set_endpoints(EPS[1:])
    reg.membership.set_endpoints(EPS)
    clock.now += 60
    reg.membership.tick()
    assert not c.closed and not reg.snapshot().get(A).draining


def test_attach_refused_while_draining():
    reg, *_ = make()
    reg.conns.attach(A, Conn("keeps-it-draining"))
    reg.membership.set_endpoints(EPS[1:])
    assert not reg.conns.attach(A, Conn("late"))


def test_panic_flag_and_order():
    reg, clock, metrics, _ = make()
    for addr in (A, B, C):
        clock.now += 1
        reg.verdicts.record_probe(addr, OK)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, DOWN)
        reg.verdicts.record_probe(addr, DOWN)
    assert picked(reg) is None
    assert reg.snapshot().panic
    assert sample(metrics, "extractedprism_panic") == 1
    assert [str(e) for e in reg.picks.panic_order()] == [C, B, A]  # most recent success first


def test_readiness_two_failures_then_one_success():
    reg, *_ = make(readyz=True)
    all_ready(reg)
    reg.verdicts.record_probe(A, ready(False))
    assert reg.snapshot().get(A).readiness == "ready"
    reg.verdicts.record_probe(A, ready(False))
    assert reg.snapshot().get(A).readiness == "unready"
    assert all(picked(reg) != EPS[0] for _ in range(50))
    reg.verdicts.record_probe(A, ready(True))
    assert reg.snapshot().get(A).readiness == "ready"


def test_new_upstream_pending_and_first_failure_settles():
    reg, *_ = make(readyz=True)
    assert reg.snapshot().get(A).readiness == "pending"
    reg.verdicts.record_probe(B, ready(True))
    assert {picked(reg) for _ in range(50)} == {EPS[1]}  # ready ones only
    reg.verdicts.record_probe(A, ready(False))
    assert reg.snapshot().get(A).readiness == "unready"


def test_fallback_to_tcp_healthy_when_none_ready():
    reg, *_ = make(readyz=True)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(False))
    assert {picked(reg) for _ in range(100)} == set(EPS)


def test_reachable_again_after_tcp_failure_is_pending_and_probed_at_once():
    reg, _, _, probes = make(readyz=True)
    all_ready(reg)
    reg.verdicts.record_dial(A, False, "refused")
    reg.verdicts.record_dial(A, True)
    assert reg.snapshot().get(A).readiness == "pending"
    assert probes == [A]
    reg.verdicts.record_probe(A, ready(False))  # the first probe after the reset decides alone
    assert reg.snapshot().get(A).readiness == "unready"


def test_unready_connections_closed_after_drain_timeout_and_called_off():
    reg, clock, *_ = make(readyz=True, drain=10)
    all_ready(reg)
    c = Conn("c")
    reg.conns.attach(A, c)
    reg.verdicts.record_probe(A, ready(False))
    reg.verdicts.record_probe(A, ready(False))
    clock.now += 9
    reg.membership.tick()
    assert not c.closed
    reg.verdicts.record_probe(A, ready(True))  # ready again: called off
    clock.now += 5
    reg.membership.tick()
    assert not c.closed
    reg.verdicts.record_probe(A, ready(False))
    reg.verdicts.record_probe(A, ready(False))
    clock.now += 10.1
    reg.membership.tick()
    assert c.closed


def test_record_probe_says_when_the_next_check_confirms_a_first_failure():
    reg, *_ = make(readyz=True)
    all_ready(reg)
    assert reg.verdicts.record_probe(A, ready(False)) is True  # ready, 1 of 2: recheck soon
    assert reg.verdicts.record_probe(A, ready(False)) is False  # unready: nothing to confirm
    assert reg.verdicts.record_probe(B, DOWN) is True
    assert reg.verdicts.record_probe(B, DOWN) is False
    assert reg.verdicts.record_probe(C, ready(True)) is False
    reg.membership.set_endpoints(EPS[:2])  # C drains: no checks, nothing to confirm
    assert reg.verdicts.record_probe(C, DOWN) is False


def _unready_with_a_connection(reg: Registry, clock: Clock) -> Conn:
    all_ready(reg)
    c = Conn("c")
    reg.conns.attach(A, c)
    reg.verdicts.record_probe(A, ready(False))
    reg.verdicts.record_probe(A, ready(False))
    return c


@pytest.mark.parametrize("drain,unready", [(30.0, 3.0), (3.0, 30.0), (10.0, 0.5)])
def test_unready_connections_wait_the_unready_drain_timeout_not_the_drain_timeout(
        drain, unready):
    clock = Clock()
    reg = Registry(readyz=True, drain_timeout=drain, unready_drain_timeout=unready,
                   clock=clock, rng=random.Random(1))
    reg.membership.set_endpoints(EPS)
    c = _unready_with_a_connection(reg, clock)
    assert reg.snapshot().get(A).close_deadline == pytest.approx(clock.now + unready)
    clock.now += unready - 0.01
    reg.membership.tick()
    assert not c.closed
    clock.now += 0.02
    reg.membership.tick()
    assert c.closed
    # A removed endpoint keeps --drain-timeout.
    d = Conn("d")
    reg.conns.attach(B, d)
    reg.membership.set_endpoints([EPS[0], EPS[2]])
    assert reg.snapshot().get(B).close_deadline == pytest.approx(clock.now + drain)


def test_unready_drain_timeout_defaults_to_the_drain_timeout():
    reg, clock, *_ = make(readyz=True, drain=7)
    c = _unready_with_a_connection(reg, clock)
    assert reg.snapshot().get(A).close_deadline == pytest.approx(clock.now + 7)
    clock.now += 6.9
    reg.membership.tick()
    assert not c.closed
    clock.now += 0.2
    reg.membership.tick()
    assert c.closed


def test_zero_unready_drain_timeout_closes_at_once():
    clock = Clock()
    reg = Registry(readyz=True, drain_timeout=30, unready_drain_timeout=0, clock=clock,
                   rng=random.Random(1))
    reg.membership.set_endpoints(EPS)
    c = _unready_with_a_connection(reg, clock)
    assert c.closed


def test_unready_close_called_off_when_no_other_is_ready():
    reg, clock, *_ = make(readyz=True, drain=10)
    all_ready(reg)
    c = Conn("c")
    reg.conns.attach(A, c)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(False))
        reg.verdicts.record_probe(addr, ready(False))
    clock.now += 20
    reg.membership.tick()
    assert not c.closed  # with no upstream ready, connections stay


def test_zero_drain_closes_unready_at_once():
    reg, *_ = make(readyz=True, drain=0)
    all_ready(reg)
    c = Conn("c")
    reg.conns.attach(A, c)
    reg.verdicts.record_probe(A, ready(False))
    reg.verdicts.record_probe(A, ready(False))
    assert c.closed


def test_least_conn_counts_dials_in_flight():
    reg, *_ = make(selection="least-conn")
    held = [reg.picks.reserve() for _ in range(3)]  # none attached yet
    assert sorted(r.address for r in held if r) == [A, B, C]
    a = next(r for r in held if r and r.address == A)
    a.release()
    a.release()  # twice is once
    assert picked(reg) == EPS[0]
    res = reg.picks.reserve()
    assert res is not None and res.address == A
    assert reg.conns.attach(res, Conn("c"))
    res.release()  # after attach: nothing left to release
    b = next(r for r in held if r and r.address == B)
    b.release()
    assert picked(reg) == EPS[1]  # A: one connection, B: none, C: one dial in flight


def test_a_reservation_cannot_leak_on_an_exception():
    reg, *_ = make(selection="least-conn")
    with pytest.raises(RuntimeError), reg.picks.reserve(exclude=[B, C]) as res:
        assert res.address == A
        raise RuntimeError("dial blew up")
    # A is not counted any more: the next pick among A and B ties, not B always.
    assert {picked(reg, exclude=[C]) for _ in range(60)} == {EPS[0], EPS[1]}


def test_dials_in_flight_shows_held_reservations():
    """/upstreams' dials_in_flight: a reservation counts until attach or release, so a
    leaked one shows as a count that stays above 0 (scripts/chaos checks it)."""
    reg, *_ = make(selection="least-conn")

    def dials() -> dict[str, int]:
        return {u.address: u.dials_in_flight for u in reg.snapshot().upstreams}

    assert dials() == {A: 0, B: 0, C: 0}
    held = reg.picks.reserve(exclude=[B, C])
    other = reg.picks.reserve(exclude=[B, C])
    assert held is not None and other is not None
    assert dials() == {A: 2, B: 0, C: 0}
    assert reg.conns.attach(held, Conn("c"))
    assert dials() == {A: 1, B: 0, C: 0}
    other.release()
    assert dials() == {A: 0, B: 0, C: 0}


def test_panic_dials_are_counted_for_least_conn():
    reg, *_ = make(selection="least-conn")
    res = reg.picks.reserve_endpoint(EPS[0])
    assert res is not None
    # A panic-mode dial in flight to A steers a concurrent pick elsewhere.
    assert all(picked(reg, exclude=[C]) == EPS[1] for _ in range(20))
    assert reg.conns.attach(res, Conn("c"))
    assert all(picked(reg, exclude=[C]) == EPS[1] for _ in range(20))
    assert reg.picks.reserve_endpoint(Endpoint("10.9.9.9", 1)) is None  # unknown


def test_latency_tiers_from_probes():
    reg, *_ = make(selection="latency")
    reg.verdicts.record_probe(A, ProbeResult(True, 0.001, ""))
    reg.verdicts.record_probe(B, ProbeResult(True, 0.0015, ""))
    reg.verdicts.record_probe(C, ProbeResult(True, 0.050, ""))
    snap = reg.snapshot()
    assert (snap.get(A).tier, snap.get(B).tier, snap.get(C).tier) == (0, 0, 1)
    assert {picked(reg) for _ in range(100)} == {EPS[0], EPS[1]}
    reg.verdicts.record_probe(C, DOWN)  # failed checks feed no sample
    assert reg.snapshot().get(C).rtt_seconds == pytest.approx(0.050)


def test_tcp_unhealthy_upstream_loses_connections_in_readyz_mode():
    reg, clock, *_ = make(readyz=True, drain=10)
    all_ready(reg)
    c = Conn("c")
    reg.conns.attach(A, c)
    reg.verdicts.record_probe(A, DOWN)
    reg.verdicts.record_probe(A, DOWN)  # partitioned: the probe cannot even connect
    assert reg.snapshot().get(A).readiness == "unready"
    clock.now += 10.1
    reg.membership.tick()
    assert c.closed
    reg.verdicts.record_probe(A, ready(True))  # back and ready: one probe restores both
    snap = reg.snapshot().get(A)
    assert snap.healthy and snap.readiness == "ready"


# --- issue 12, items 7 and 8 -------------------------------------------------------


class _StallingHandler(logging.Handler):
    """A log handler that blocks like a write to a full stderr pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.unblock = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.unblock.wait(30)


def test_a_stalled_log_handler_does_not_stall_pick():
    reg, *_ = make()
    handler = _StallingHandler()
    logger = logging.getLogger("extractedprism.upstreams.registry")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    writer = threading.Thread(name="test-set-endpoints", target=reg.membership.set_endpoints,
                              args=(EPS[:2],))  # logs "upstream removed"
    got: list[object] = []
    picker = threading.Thread(name="test-pick", target=lambda: got.append(picked(reg)))
    try:
        writer.start()
        assert handler.entered.wait(10), "set_endpoints logged nothing"
        picker.start()
        picker.join(10)
        # The old registry logged under its lock: a pick waited for the handler.
        assert not picker.is_alive(), "reserve() waited for a log handler"
        assert got and got[0] in EPS[:2]
    finally:
        handler.unblock.set()
        writer.join(10)
        picker.join(10)
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_counters_are_registry_state_exported_at_scrape_time():
    reg, _, metrics, _ = make(drain=30)
    c = Conn("c")
    assert reg.conns.attach(A, c)
    c.bytes_up, c.bytes_down = 10, 200
    reg.verdicts.record_dial(A, False, "refused")
    # shutdown / panic: not counted
    reg.verdicts.record_dial(B, False, "refused", count_error=False)
    snap = reg.snapshot()
    assert (snap.connections_total, snap.get(A).connection_errors) == (1, 1)
    assert snap.get(B).connection_errors == 0
    assert (snap.get(A).bytes_up, snap.get(A).bytes_down) == (10, 200)
    assert sample(metrics, "extractedprism_connections_total") == 1
    assert sample(metrics, "extractedprism_connection_errors_total", {"upstream": A}) == 1
    assert sample(metrics, "extractedprism_upstream_bytes_total",
                          {"upstream": A, "direction": "down"}) == 200
    reg.conns.detach(A, c)  # finished connections' bytes stay with the record
    assert reg.snapshot().get(A).bytes_down == 200
    reg.membership.set_endpoints(EPS[1:])  # no connections left: removed at once
    assert sample(metrics, "extractedprism_connection_errors_total", {"upstream": A}) is None
    assert sample(metrics, "extractedprism_upstream_bytes_total",
                          {"upstream": A, "direction": "down"}) is None
    assert sample(metrics, "extractedprism_connections_total") == 1  # global: keeps counting


def test_the_registry_needs_no_metrics_object():
    import inspect

    assert "metrics" not in inspect.signature(Registry).parameters
    import extractedprism.upstreams.registry as registry_module
    assert "extractedprism.health.metrics" not in inspect.getsource(registry_module)


def _lock_free_elsewhere(reg: Registry) -> bool:
    got: list[bool] = []

    def take() -> None:
        if reg.lock.acquire(timeout=5):
            reg.lock.release()
            got.append(True)

    t = threading.Thread(name="test-lock-probe", target=take)
    t.start()
    t.join(10)
    return bool(got)


def test_changes_reach_the_one_listener_after_the_lock_is_released():
    seen: list[tuple[str, bool]] = []

    def listener(change: Change) -> None:
        seen.append((change.what, _lock_free_elsewhere(reg)))

    reg = Registry(readyz=True, on_change=listener)
    reg.membership.set_endpoints(EPS)
    reg.verdicts.record_probe(A, ready(True))
    reg.verdicts.record_dial(A, False, "refused")
    reg.verdicts.record_dial(A, False, "refused")
    reg.verdicts.record_dial(A, True)
    # The first failed dial leaves A one failure short: "recheck" (--health-recheck).
    assert seen == [("endpoints", True), ("recheck", True), ("health", True),
                    ("probe-now", True), ("health", True)]


def test_latency_issue_12_example_new_fast_upstream_shares_tier_zero():
    # A = 1.0 ms and B = 3.48 ms share a tier (B by hysteresis); C arrives at 0.4 ms.
    # The spec's tier 0 is {C, A}: new connections go to both, not to C alone.
    reg, *_ = make(selection="latency")
    reg.membership.set_endpoints(EPS[:2])
    reg.verdicts.record_probe(A, ProbeResult(True, 0.001, ""))
    reg.verdicts.record_probe(B, ProbeResult(True, 0.0029, ""))
    reg.verdicts.record_probe(B, ProbeResult(True, 0.0029 + (0.00348 - 0.0029) / 0.3, ""))
    assert reg.snapshot().get(B).rtt_seconds == pytest.approx(0.00348)
    assert (reg.snapshot().get(A).tier, reg.snapshot().get(B).tier) == (0, 0)
    reg.membership.set_endpoints(EPS)
    reg.verdicts.record_probe(C, ProbeResult(True, 0.0004, ""))
    snap = reg.snapshot()
    assert (snap.get(C).tier, snap.get(A).tier, snap.get(B).tier) == (0, 0, 1)
    assert {str(picked(reg)) for _ in range(200)} == {A, C}


def test_attaching_a_reservation_counts_its_dial_as_a_success():
    reg, *_ = make()
    reg.verdicts.record_dial(A, False, "refused")  # streak 1 of 2
    res = reg.picks.reserve(exclude=[B, C])
    assert res is not None and res.address == A
    assert reg.conns.attach(res, Conn("c"))  # the dial that carries it succeeded: streak reset
    reg.verdicts.record_dial(A, False, "refused")
    assert reg.snapshot().get(A).healthy  # 1 of 2 again, not 2 of 2
    assert reg.conns.attach(A, Conn("d"))  # a plain address records no dial
    reg.verdicts.record_dial(A, False, "refused")
    assert not reg.snapshot().get(A).healthy


def test_a_judging_connection_counts_once_it_carries_and_never_when_silent():
    """Issue 29, item 3: attach_judging tracks a connection live but counts it only on the
    upstream that carries it: once its relay moved a byte (any snapshot sees it) or it
    ended answered; a silent or left verdict detaches it uncounted."""
    reg = Registry()
    reg.membership.set_endpoints(EPS)

    def judging(addr: str) -> Conn:
        res = reg.picks.reserve(exclude=[a for a in (A, B, C) if a != addr])
        assert res is not None and res.address == addr
        c = Conn(addr)
        assert reg.conns.attach_judging(res, c)
        return c

    silent, carrying, quiet = judging(A), judging(B), judging(C)
    snap = reg.snapshot()
    assert snap.connections_active == 3 and snap.connections_total == 0
    carrying.bytes_up = 517  # the relay started: B carries it
    snap = reg.snapshot()
    assert snap.connections_total == 1 and snap.get(B).total_connections == 1
    reg.conns.detach(A, silent, carried=False)  # silent: the hedge carries it elsewhere
    reg.conns.detach(B, carrying)  # counted already: not again
    reg.conns.detach(C, quiet)  # answered with no byte either way (an EOF): counted at its end
    snap = reg.snapshot()
    assert snap.connections_active == 0
    assert [snap.get(a).total_connections for a in (A, B, C)] == [0, 1, 1]
    assert snap.connections_total == 2


def test_a_dead_upstreams_close_deadline_does_not_keep_moving_forward():
    # Issue 30: once its connections were closed, the deadline was re-armed every
    # --unready-drain-timeout and /upstreams showed a close always a few seconds away.
    reg, clock, *_ = make(readyz=True, drain=5)
    c = _unready_with_a_connection(reg, clock)
    reg.verdicts.record_probe(A, DOWN)
    reg.verdicts.record_probe(A, DOWN)
    deadline = reg.snapshot().get(A).close_deadline
    assert deadline == pytest.approx(clock.now + 5)
    clock.now += 5.1
    reg.membership.tick()
    assert c.closed
    reg.conns.detach(A, c)  # what the pipe does once it notices the close
    for _ in range(4):
        assert reg.snapshot().get(A).close_deadline is None  # nothing left to close
        clock.now += 5.1
        reg.membership.tick()


def test_reserve_hedge_avoids_stalled_upstreams_then_takes_the_fallback() -> None:
    """Issue 29: a hedge skips upstreams marked stalled while a pickable one without the
    mark is left, then goes to a static fallback; the mark stays after the dial ends
    and goes with the next success (a check or a dial)."""
    from extractedprism.upstreams.roles import Roles

    reg = Registry(rng=random.Random(0))
    reg.membership.set_endpoints(EPS, Roles(sources={A: ("kubernetes",), B: ("kubernetes",),
                                          C: ("static",)}, fallback=frozenset({C})))
    # Nothing stalled: an ordinary pick, never the fallback while a discovered one is left.
    plain = reg.picks.reserve_hedge(exclude={A})
    assert plain is not None and plain.address == B and not plain.panic
    plain.release()
    first = reg.picks.reserve()
    assert first is not None and first.address in (A, B)
    other = B if first.address == A else A
    reg.picks.stall_dial(first)
    reg.picks.stall_dial(first)  # once per dial
    assert reg.dial_stalls == 1
    hedge = reg.picks.reserve_hedge(exclude={first.address})
    assert hedge is not None and hedge.address == other and not hedge.panic
    reg.picks.stall_dial(hedge)
    hedge.release()  # the dial timed out: the mark stays
    first.release()
    assert reg.ups[A].stalled and reg.ups[B].stalled and not reg.ups[C].stalled
    assert [u.dial_stalled for u in reg.snapshot().upstreams] == [True, True, False]
    second = reg.picks.reserve_hedge(exclude={A})  # B is pickable but stalled: the fallback
    assert second is not None and second.address == C and second.panic
    second.release()
    assert all(r.dialing == 0 for r in reg.ups.values())
    reg.verdicts.record_probe(A, OK)  # a success clears the mark
    reg.verdicts.record_dial(B, True)
    assert not reg.ups[A].stalled and not reg.ups[B].stalled and reg.dial_stalls == 0
    third = reg.picks.reserve_hedge(exclude={A})
    assert third is not None and third.address == B
    third.release()


def test_new_connections_skip_upstreams_with_a_stalled_dial_while_another_is_left() -> None:
    """Issue 29: like the stall check's suspects, an upstream whose dial stalled (no
    success since) takes no new connection while another pickable one can; with every
    one marked, the pick is as before; removing a marked upstream forgets its mark."""
    reg = Registry(rng=random.Random(3))
    reg.membership.set_endpoints(EPS)
    res = reg.picks.reserve()
    assert res is not None
    marked = res.address
    reg.picks.stall_dial(res)
    res.release()
    picks = set()
    for _ in range(60):
        r = reg.picks.reserve()
        assert r is not None
        picks.add(r.address)
        r.release()
    assert picks == {a for a in (A, B, C) if a != marked}
    for _ in range(2):  # mark the other two as well: every one marked, all picked again
        r = reg.picks.reserve()
        assert r is not None
        reg.picks.stall_dial(r)
        r.release()
    assert reg.dial_stalls == 3
    picks = set()
    for _ in range(60):
        r = reg.picks.reserve()
        assert r is not None
        picks.add(r.address)
        r.release()
    assert picks == {A, B, C}
    reg.membership.set_endpoints([e for e in EPS if str(e) != marked])
    assert reg.dial_stalls == 2
