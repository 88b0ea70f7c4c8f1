"""Issue 37: the signals combined. Each test is one of the findings in the registry's
rooms, with an injected clock, and fails on the registry before the one eligibility rule
(upstreams/eligibility.py)."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from extractedprism.upstreams import balance
from extractedprism.upstreams.activity import SECOND_LOOK
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.reservation import Reservation
from extractedprism.upstreams.state import ProbeResult
from extractedprism.upstreams.verdicts import GUARD_INTERVALS
from tests.unit.test_balance import Conn as RoundConn
from tests.unit.test_registry import DOWN, EPS, A, B, C, Clock, ready
from tests.unit.test_stall import Rig, T, answer, ask

pytestmark = pytest.mark.timeout(60)

SLOW = ProbeResult(True, 0.001, "", ready=False, ready_reason="timeout")


def tally(reg: Registry, n: int = 200, exclude: frozenset[str] = frozenset()) -> Counter[str]:
    """Where ``n`` picks (``exclude``: a retry's or a hedge's) go, each reservation then
    released as after a failed dial."""
    out: Counter[str] = Counter()
    for _ in range(n):
        res = reg.picks.reserve(exclude)
        assert res is not None
        out[res.address] += 1
        res.release()
    return out


def reserve_on(reg: Registry, addr: str) -> Reservation:
    """A first pick that landed on ``addr`` (the others released as after a failed dial)."""
    while True:
        res = reg.picks.reserve()
        assert res is not None
        if res.address == addr:
            return res
        res.release()


def dial_stalled(reg: Registry, addr: str) -> None:
    """A dial to ``addr`` in flight past --dial-hedge-delay (the Dialer's stall_dial),
    its reservation still held."""
    reg.picks.stall_dial(reserve_on(reg, addr))


# -- finding 1: readiness first, marks only a preference among the ready ---------------


@pytest.mark.parametrize("mark", ["dial stall", "suspect"])
def test_a_retry_never_goes_to_an_unready_upstream_while_a_ready_one_exists(mark):
    rig = Rig(readyz=True)
    reg = rig.reg
    for _ in range(2):  # B: cut from etcd, TCP accepting, readyz 500
        reg.verdicts.record_probe(B, ready(False))
    assert not reg.snapshot().get(B).ready
    if mark == "dial stall":
        dial_stalled(reg, A)
    else:
        rig.stalled(A, "kubelet")
    assert A in (reg.suspect | {a for a, r in reg.ups.items() if r.stalled})
    # A retry that tried C (the drain race, the first answer's hedge): A, never B.
    assert tally(reg, exclude=frozenset({C})) == Counter({A: 200})
    # The dial hedge: the same rule.
    for _ in range(50):
        res = reg.picks.reserve_hedge(exclude={C})
        assert res is not None and res.address == A
        res.release()


# -- finding 6: the marks before the latency tiers ---------------------------------------


@pytest.mark.parametrize("mark", ["dial stall", "suspect"])
def test_latency_a_marked_upstream_alone_in_the_fastest_tier_does_not_take_everything(mark):
    rig = Rig(readyz=False, selection="latency")
    reg = rig.reg
    for _ in range(5):  # A fastest, B and C an order of magnitude slower
        reg.verdicts.record_probe(A, ProbeResult(True, 0.001, ""))
        reg.verdicts.record_probe(B, ProbeResult(True, 0.050, ""))
        reg.verdicts.record_probe(C, ProbeResult(True, 0.050, ""))
    assert tally(reg) == Counter({A: 200})  # the tier rule alone
    if mark == "dial stall":
        dial_stalled(reg, A)
    else:
        rig.stalled(A, "kubelet")
    got = tally(reg)
    assert A not in got and set(got) == {B, C}


# -- finding 7: fair shares over what new picks may take -----------------------------------


def test_rebalancing_does_not_count_a_suspect_in_the_fair_share():
    clock = Clock()
    reg = Registry(clock=clock, rng=random.Random(1), rebalance_interval=10.0,
                   rebalance_quiet=5.0, stall_timeout=T)
    reg.membership.set_endpoints(EPS)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ProbeResult(True, 0.001, ""))
    stuck = RoundConn("stuck")
    assert reg.conns.attach(A, stuck)
    others = []
    for addr in (B, C):
        for i in range(5):
            c = RoundConn(f"{addr}#{i}")
            assert reg.conns.attach(addr, c)
            answer(c)
            others.append(c)
    answer(stuck)
    reg.stalls.sample_activity()
    ask(stuck)
    clock.now += 0.25
    reg.stalls.sample_activity()
    clock.now += T
    reg.stalls.sample_activity()
    assert A in reg.suspect
    for _ in range(5):  # every round while the stall lasts
        clock.now += 20
        view = reg.rounds.rebalance()
        assert view.last_reason == balance.NO_SKEW, view
    assert not any(c.finished for c in others)
    shares = {u.address: u.fair_share for u in reg.snapshot().upstreams}
    assert shares[A] is None and shares[B] == shares[C] == 5.0


# -- finding 5: a harmless stall on the only peer does not keep a frozen one ready --------


def test_overload_guard_a_peers_harmless_stall_checked_and_passed_vouches_again():
    rig = Rig(overload_guard=True)
    reg = rig.reg
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)  # one peer left: B
    rig.stalled(B, "quiet-watch")  # a WINDOW_UPDATE nothing answers
    both_looks_pass(rig, B)
    assert B not in reg.suspect
    reg.verdicts.record_probe(A, SLOW)
    reg.verdicts.record_probe(A, SLOW)
    assert not reg.snapshot().get(A).ready


def test_overload_guard_an_upstream_answering_no_check_is_excluded_within_a_bound():
    interval, timeout = 2.0, 1.0
    clock = Clock()
    reg = Registry(clock=clock, readyz=True, overload_guard=True, stall_timeout=T,
                   health_interval=interval, health_timeout=timeout)
    reg.membership.set_endpoints(EPS)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(True))
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)
    # B keeps a stall that began after its latest check: suspect for as long as it lasts.
    from tests.unit.test_registry import Conn
    c = Conn("watch")
    assert reg.conns.attach(B, c)
    answer(c)
    reg.stalls.sample_activity()
    clock.now += 0.1
    ask(c)
    reg.stalls.sample_activity()
    bound = GUARD_INTERVALS * (interval + timeout)
    waited = 0.0
    while reg.snapshot().get(A).ready:
        assert waited <= bound + 2 * (interval + timeout), "A stayed ready past the bound"
        clock.now += interval + timeout
        waited += interval + timeout
        reg.stalls.sample_activity()
        reg.verdicts.record_probe(A, SLOW)
    assert B in reg.suspect  # the peer never vouched: the bound did it


# -- finding 11: a held stall check is not a failed one ---------------------------------


def test_a_stall_check_the_guard_did_not_count_is_not_recorded_as_failed(caplog):
    rig = Rig(overload_guard=True)
    reg = rig.reg
    for _ in range(2):
        reg.verdicts.record_probe(C, DOWN)
    rig.stalled(A, "a1")
    rig.stalled(B, "b1")  # no faster peer for A
    with caplog.at_level(logging.INFO, logger="extractedprism.upstreams.registry"):
        reg.verdicts.record_probe(A, SLOW, stall=True)
    view = reg.snapshot().get(A)
    assert view.slow_not_counted == 1
    assert dict(view.stall_checks).get("failed", 0) == 0
    lines = [r.getMessage() for r in caplog.records if "stall check" in r.getMessage()]
    assert len(lines) == 1 and "result=not_counted" in lines[0], lines
    assert all(r.levelno < logging.WARNING for r in caplog.records
               if "stall check" in r.getMessage())


# -- finding 13: a suspect mark ends -----------------------------------------------------


def both_looks_pass(rig: Rig, addr: str) -> None:
    """The stall's two looks (at once, and SECOND_LOOK stall timeouts later) both pass:
    suspect until the second one."""
    reg = rig.reg
    reg.verdicts.record_probe(addr, ready(True), stall=True)  # the first look's check
    assert addr in reg.suspect  # one look passed: a cut server's /readyz lags, so not yet
    assert [c.address for c in rig.sample(SECOND_LOOK * T)] == [addr]
    assert addr in reg.suspect
    reg.verdicts.record_probe(addr, ready(True), stall=True)  # the second look's check


def test_a_suspect_mark_ends_when_both_looks_of_its_stall_pass():
    rig = Rig(readyz=True)
    reg = rig.reg
    c = rig.stalled(A, "quiet-watch")  # a client byte nothing answers (WINDOW_UPDATE)
    assert A in reg.suspect and A not in tally(reg)
    both_looks_pass(rig, A)
    assert A not in reg.suspect and A in tally(reg)
    rig.sample(0.25)
    assert A not in reg.suspect  # the same stretch, still unanswered: harmless now
    # A new request left unanswered after that marks it again.
    answer(c)
    rig.sample(0.25)
    ask(c)
    rig.sample(0.25)
    rig.sample(T)
    assert A in reg.suspect


def test_a_stall_whose_second_look_fails_stays_suspect():
    """The etcd cut: /readyz lags, the first look passes, the second fails."""
    rig = Rig(readyz=True)
    reg = rig.reg
    rig.stalled(A, "kubelet")
    reg.verdicts.record_probe(A, ready(True), stall=True)
    rig.sample(SECOND_LOOK * T)
    reg.verdicts.record_probe(A, ready(False), stall=True)
    rig.sample(0.25)
    assert A in reg.suspect and A not in tally(reg)


def test_a_dial_stall_mark_ends_when_that_dial_completes():
    reg = Registry(rng=random.Random(5))
    reg.membership.set_endpoints(EPS)
    res = reserve_on(reg, A)
    reg.picks.stall_dial(res)
    assert A not in tally(reg, 60)
    from tests.unit.test_registry import Conn
    res.dial_seconds = 1.2
    assert reg.conns.attach(res, Conn("slow-but-fine"))  # the stalled dial connected
    assert not reg.ups[A].stalled and reg.dial_stalls == 0
    assert A in tally(reg, 60)
