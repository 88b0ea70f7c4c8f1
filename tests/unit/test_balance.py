"""Rebalancing and slow start, pure parts (upstreams/balance.py) from tables, and the
registry's rules over them with an injected clock and fake connections."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.config.table import ConfigError, validate
from extractedprism.upstreams import balance
from extractedprism.upstreams.balance import Load, Quiet
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.roles import Roles
from extractedprism.upstreams.state import ProbeResult
from tests.unit.test_registry import Clock
from tests.unit.test_registry import Conn as RegistryConn

A, B, C = "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"
EPS = [Endpoint("10.0.0.1", 6443), Endpoint("10.0.0.2", 6443), Endpoint("10.0.0.3", 6443)]
OK = ProbeResult(True, 0.001, "")
DOWN = ProbeResult(False, None, "connection refused")


@pytest.mark.parametrize(("elapsed", "window", "weight"), [
    (0.0, 60.0, 0.1),
    (-5.0, 60.0, 0.1),  # a clock step back: still the start
    (30.0, 60.0, 0.55),
    (54.0, 60.0, 0.91),
    (60.0, 60.0, 1.0),
    (600.0, 60.0, 1.0),
    (0.0, 0.0, 1.0),  # off
])
def test_ramp_weight(elapsed, window, weight):
    assert balance.ramp_weight(elapsed, window) == pytest.approx(weight)


@pytest.mark.parametrize(("loads", "shares"), [
    ([Load(A, 6), Load(B, 3), Load(C, 0)], {A: 3.0, B: 3.0, C: 3.0}),
    ([Load(A, 10), Load(B, 0, 0.25)], {A: 8.0, B: 2.0}),
    ([Load(A, 0), Load(B, 0)], {A: 0.0, B: 0.0}),
    ([Load(A, 3, 0.1), Load(B, 3, 0.1)], {A: 3.0, B: 3.0}),
])
def test_fair_shares(loads, shares):
    assert balance.fair_shares(loads) == pytest.approx(shares)


@pytest.mark.parametrize(("loads", "over", "reason"), [
    # the roll's aftermath: the last one restarted holds nothing
    ([Load(A, 6), Load(B, 6), Load(C, 0)], B, balance.ACTED),
    ([Load(A, 4), Load(B, 4), Load(C, 4)], None, balance.NO_SKEW),
    # over 1.25 x its share (3 > 2.5) but only 1 more than the least: no close
    ([Load(A, 3), Load(B, 2), Load(C, 2)], None, balance.NO_SKEW),
    # 2 more than the least but not over 1.25 x its share (5 <= 1.25 * 4.33)
    ([Load(A, 5), Load(B, 5), Load(C, 3)], None, balance.NO_SKEW),
    ([Load(A, 5), Load(B, 3), Load(C, 1)], A, balance.ACTED),
    ([Load(A, 9)], None, balance.TOO_FEW),
    ([], None, balance.TOO_FEW),
    # a ramping upstream (weight 0.1) with 1 connection holds its share: A is the one over
    ([Load(A, 8), Load(B, 2), Load(C, 1, 0.1)], A, balance.ACTED),
    # ... and a ramping one over its small share is the most loaded, but needs the gap
    ([Load(A, 4), Load(B, 4), Load(C, 3, 0.1)], None, balance.NO_SKEW),
    ([Load(A, 2), Load(B, 2), Load(C, 4, 0.1)], C, balance.ACTED),
])
def test_judge(loads, over, reason):
    verdict = balance.judge(loads)
    assert (verdict.over, verdict.reason) == (over, reason)


@pytest.mark.parametrize(("conns", "chosen"), [
    ([Quiet(1, 100, 10), Quiet(2, 100, 30), Quiet(3, 100, 20)], 2),  # longest quiet
    ([Quiet(1, 100, 30), Quiet(2, 200, 30)], 2),  # equal quiet: the older
    ([Quiet(1, 100, 4.9), Quiet(2, 100, 1)], None),  # none quiet enough
    ([Quiet(1, 9.9, 9.9), Quiet(2, 50, 6)], 2),  # 1 is younger than one interval
    ([Quiet(1, 9.9, 9.9)], None),
    ([], None),
])
def test_choose_quiet(conns, chosen):
    got = balance.choose_quiet(conns, quiet=5.0, min_age=10.0)
    assert (got.key if got else None) == chosen


def test_pick_weighted_random_follows_the_weights():
    rng = random.Random(7)
    n = 20000
    got = Counter(balance.pick_weighted([A, B, C], [1.0, 1.0, 0.1], rng=rng) for _ in range(n))
    for addr, weight in ((A, 1.0), (B, 1.0), (C, 0.1)):
        assert got[addr] / n == pytest.approx(weight / 2.1, abs=0.01)


@pytest.mark.parametrize(("active", "weights", "want"), [
    ([4, 4, 0], [1.0, 1.0, 0.1], {C}),  # empty wins whatever its weight
    ([4, 4, 1], [1.0, 1.0, 0.1], {A, B}),  # 1 / 0.1 = 10 > 4
    ([4, 4, 1], [1.0, 1.0, 0.5], {C}),  # 2 < 4
    ([2, 2, 2], [1.0, 1.0, 1.0], {A, B, C}),
])
def test_pick_weighted_least_conn(active, weights, want):
    rng = random.Random(3)
    got = {balance.pick_weighted([A, B, C], weights, rng=rng, active=active)
           for _ in range(200)}
    assert got == want


# -- the registry's rules ------------------------------------------------------------


class Conn(RegistryConn):
    """A fake live connection that also notes a rebalance close (a FIN, not a reset)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.finished = False

    def finish(self) -> None:
        self.finished = True


def make(interval: float = 10.0, quiet: float = 5.0, slow: float = 0.0, **kw: object
         ) -> tuple[Registry, Clock]:
    clock = Clock()
    reg = Registry(clock=clock, rng=random.Random(1), rebalance_interval=interval,
                   rebalance_quiet=quiet, slow_start=slow, **kw)  # type: ignore[arg-type]
    reg.membership.set_endpoints(EPS)
    return reg, clock


def attach(reg: Registry, addr: str, n: int) -> list[Conn]:
    conns = [Conn(f"{addr}#{i}") for i in range(n)]
    for c in conns:
        assert reg.conns.attach(addr, c)
    reg.stalls.sample_activity()  # the rebalancer thread's sampling sees them from now
    return conns


def finished(conns: list[Conn]) -> list[Conn]:
    return [c for c in conns if c.finished]


def test_a_round_closes_one_quiet_connection_of_the_most_loaded():
    reg, clock = make()
    a, b = attach(reg, A, 6), attach(reg, B, 6)
    clock.now += 20
    view = reg.rounds.rebalance()
    assert view.last_reason == balance.ACTED and view.closes == 1
    gone = finished(a) + finished(b)
    assert len(gone) == 1 and not any(c.closed for c in a + b)  # a FIN, never a reset
    # a second round right away: the chosen one is not chosen again
    reg.rounds.rebalance()
    assert len(finished(a) + finished(b)) == 2


def test_busy_and_young_connections_are_never_chosen():
    reg, clock = make()
    a = attach(reg, A, 6)
    clock.now += 9  # younger than one interval
    assert reg.rounds.rebalance().last_reason == balance.NOTHING_QUIET
    clock.now += 20
    for c in a:  # every one moved a byte since the last sample
        c.bytes_down += 1
    assert reg.rounds.rebalance().last_reason == balance.NOTHING_QUIET
    clock.now += 4.9  # quiet 4.9 s < 5 s
    assert reg.rounds.rebalance().last_reason == balance.NOTHING_QUIET
    a[3].bytes_up += 1  # a[3] busy again
    clock.now += 0.2
    reg.stalls.sample_activity()
    clock.now += 4.9
    view = reg.rounds.rebalance()
    assert view.last_reason == balance.ACTED
    assert [c for c in a if c.finished] != [a[3]] and not a[3].finished


@pytest.mark.parametrize("why", ["removed", "unready", "admin close", "panic"])
def test_no_round_acts_while_connections_move_otherwise(why):
    reg, clock = make(readyz=why == "unready")
    if why == "unready":
        for addr in (A, B, C):
            reg.verdicts.record_probe(addr, ProbeResult(True, 0.001, "", ready=True))
    conns = attach(reg, A, 6) + attach(reg, C, 2)
    want = {"removed": balance.DRAINING, "unready": balance.CLOSING_UNREADY,
            "admin close": balance.ADMIN_CLOSE, "panic": balance.PANIC}[why]
    if why == "removed":
        reg.membership.set_endpoints(EPS[:2])
    elif why == "unready":
        for _ in range(2):
            reg.verdicts.record_probe(
                C, ProbeResult(True, 0.001, "", ready=False, ready_reason="500"))
    elif why == "admin close":
        reg.membership.set_admin(C, "close", 0)
    else:
        for addr in (A, B, C):
            for _ in range(2):
                reg.verdicts.record_probe(addr, DOWN)
    clock.now += 1  # before any of those deadlines
    assert reg.rounds.rebalance().last_reason == want
    assert not finished(conns)
    assert reg.snapshot().rebalance.closes == 0


def test_fewer_than_two_pickable_never_acts():
    reg, clock = make()
    attach(reg, A, 8)
    for addr in (B, C):
        for _ in range(2):
            reg.verdicts.record_probe(addr, DOWN)
    clock.now += 30
    assert reg.rounds.rebalance().last_reason == balance.TOO_FEW


def test_off_by_default_tracks_nothing_and_never_acts():
    reg = Registry(rng=random.Random(1))
    reg.membership.set_endpoints(EPS)
    conns = attach(reg, A, 8)
    assert reg.rounds.rebalance().last_reason == "off"
    assert not finished(conns)
    snap = reg.snapshot()
    assert snap.rebalance is None
    assert all(u.weight is None and u.fair_share is None for u in snap.upstreams)


def test_slow_start_ramps_a_recovered_upstream_and_sets_its_share():
    reg, clock = make(interval=0.0, slow=100.0, selection="random")
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)
    clock.now += 50
    reg.verdicts.record_probe(C, OK)  # healthy again: ramps from 0.1
    assert reg.snapshot().get(C).weight == pytest.approx(0.1)
    picks = Counter(str(reg.picks.reserve().endpoint) for _ in range(6000))
    assert picks[C] / 6000 == pytest.approx(0.1 / 2.1, abs=0.015)
    clock.now += 50
    assert reg.snapshot().get(C).weight == pytest.approx(0.55)
    clock.now += 50
    assert reg.snapshot().get(C).weight == 1.0
    assert not reg.ramping  # the ramp is over: picks are unweighted again


def test_slow_start_leaves_the_first_list_and_the_weights_off_alone():
    reg, _clock = make(interval=0.0, slow=100.0)
    assert [u.weight for u in reg.snapshot().upstreams] == [1.0, 1.0, 1.0]
    reg.membership.set_endpoints([*EPS, Endpoint("10.0.0.4", 6443)])  # added later: ramps
    assert reg.snapshot().get("10.0.0.4:6443").weight == pytest.approx(0.1)
    reg.membership.set_admin(A, "drain", 0)
    reg.membership.set_admin(A, "", 0)  # undrained: ramps
    assert reg.snapshot().get(A).weight == pytest.approx(0.1)


def test_slow_start_ramps_a_first_list_server_that_was_not_ready_at_start():
    # With readyz, nothing serves before its first probe: the servers ready at start take
    # their full weight, one a probe found not ready ramps when it comes up later.
    reg, clock = make(interval=0.0, slow=100.0, readyz=True)
    ready = ProbeResult(True, 0.001, "", ready=True)
    for addr in (A, B):
        reg.verdicts.record_probe(addr, ready)
    reg.verdicts.record_probe(C, ProbeResult(True, 0.001, "", ready=False, ready_reason="HTTP 500"))
    assert [u.weight for u in reg.snapshot().upstreams] == [1.0, 1.0, 1.0]
    clock.now += 30
    reg.verdicts.record_probe(C, ready)
    assert reg.snapshot().get(C).weight == pytest.approx(0.1)
    assert reg.snapshot().get(A).weight == 1.0


def test_slow_start_with_least_conn_divides_by_weight():
    reg, _clock = make(interval=0.0, slow=90.0, selection="least-conn")
    attach(reg, A, 4)
    attach(reg, B, 4)
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)
    reg.verdicts.record_probe(C, OK)
    first = reg.picks.reserve()
    assert first is not None and first.address == C  # empty wins
    assert reg.conns.attach(first, Conn("c1"))
    # 1 / 0.1 = 10 connections per unit of weight against 4: the others now
    assert {reg.picks.reserve().address for _ in range(4)} <= {A, B}


def test_rebalancing_shares_by_weight():
    reg, clock = make(interval=10.0, slow=100.0)
    attach(reg, A, 5)
    attach(reg, B, 5)
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)
    reg.verdicts.record_probe(C, OK)  # weight 0.1: its share of 10 is 10 * 0.1 / 2.1 = 0.48
    clock.now += 20  # weight 0.28: share 1.23; A and B hold 5 of 4.39: under 1.25 x
    assert reg.rounds.rebalance().last_reason == balance.NO_SKEW
    snap = reg.snapshot()
    assert snap.get(C).fair_share == pytest.approx(10 * 0.28 / 2.28)
    clock.now += 60  # weight 0.82: share 2.9; 5 > 1.25 * 3.55 = 4.4
    assert reg.rounds.rebalance().last_reason == balance.ACTED


def test_slow_start_ramps_a_fallback_listed_again():
    reg, clock = make(interval=0.0, slow=100.0)
    reg.membership.set_roles(Roles(fallback=frozenset({C})))  # a static endpoint discovery lacks
    assert not reg.snapshot().get(C).pickable
    clock.now += 10
    reg.membership.set_roles(Roles())  # listed by discovery again: it serves again, from 0.1
    assert reg.snapshot().get(C).weight == pytest.approx(0.1)


def test_slow_start_with_latency_weighs_inside_the_tier():
    reg, _clock = make(interval=0.0, slow=100.0, selection="latency")
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, OK)  # one tier: every connect took 1 ms
    reg.membership.set_admin(C, "drain", 0)
    reg.membership.set_admin(C, "", 0)  # back: 0.1 of A's or B's weight inside the tier
    picks = Counter(str(reg.picks.reserve().endpoint) for _ in range(6000))
    assert picks[C] / 6000 == pytest.approx(0.1 / 2.1, abs=0.015)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("rebalance_interval", "50ms", "--rebalance-interval (50ms) must be 0 (off) or at least "
     "100ms"),
    ("rebalance_quiet", "-1s", "--rebalance-quiet (-1s) must not be negative"),
    ("slow_start", "soon", "--slow-start (soon) is invalid"),
    ("stall_timeout", "100ms", "--stall-timeout (100ms) must be 0 (off) or at least 500ms"),
    ("stall_timeout", "-2s", "--stall-timeout (-2s) must be 0 (off) or at least 500ms"),
    ("stall_timeout", "2 s", "--stall-timeout (2 s) is invalid"),
])
def test_bad_values_are_named(flag, value, message):
    with pytest.raises(ConfigError) as err:
        validate({"endpoints": "10.0.0.1:6443", flag: value})
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


def test_the_defaults_are_off():
    cfg = validate({"endpoints": "10.0.0.1:6443"})
    assert (cfg.rebalance_interval, cfg.rebalance_quiet, cfg.slow_start) == (0.0, 5.0, 0.0)
    assert cfg.stall_timeout == 0.0
    assert validate({"endpoints": "10.0.0.1:6443", "stall_timeout": "2s"}).stall_timeout == 2.0
