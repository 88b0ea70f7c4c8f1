"""--overload-guard with an injected clock: a slow answer (a readyz probe or a client's
first answer past --health-timeout) counts only against a faster peer, another upstream
in service whose latest check passed and that has no stalled connection. When every
upstream serving is slow (the survivors of a failure, or the last one left) it is not
counted, and closes nothing; every other failure counts as the spec says."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from extractedprism.health.document import upstream_entry
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.unit.test_registry import DOWN, EPS, A, B, C, Clock, ready
from tests.unit.test_stall import Rig

SLOW = ProbeResult(True, 0.001, "", ready=False, ready_reason="timeout")
SLOW_DIAL = "no answer within 1s to the client's TLS ClientHello"


def make(guard: bool = True, readyz: bool = True) -> Registry:
    reg = Registry(clock=Clock(), readyz=readyz, overload_guard=guard,
                   unready_drain_timeout=1.0)
    reg.membership.set_endpoints(EPS)
    for addr in (A, B, C):
        reg.verdicts.record_probe(addr, ready(True) if readyz else ProbeResult(True, 0.001, ""))
    return reg


def exclude(reg: Registry, addr: str, result: ProbeResult) -> None:
    reg.verdicts.record_probe(addr, result)
    reg.verdicts.record_probe(addr, result)


def metrics_text(reg: Registry) -> str:
    m = Metrics()
    m.attach_state(reg.snapshot)
    return generate_latest(m.registry).decode()


def test_a_frozen_upstream_beside_healthy_ones_counts_at_once():
    reg = make()
    assert reg.verdicts.record_probe(A, SLOW) is True  # B and C answer in time: the recheck is due
    reg.verdicts.record_probe(A, SLOW)
    view = reg.snapshot().get(A)
    assert not view.ready and view.slow_not_counted == 0


def test_survivors_all_answering_slowly_stay_in_service(caplog):
    """The kill at 100 nodes: A is gone, B and C take its clients and both answer late."""
    reg = make()
    exclude(reg, A, DOWN)
    with caplog.at_level(logging.INFO, logger="extractedprism.upstreams.registry"):
        # B is slow while C answers in time: B's own slowness, counted (its first failure).
        assert reg.verdicts.record_probe(B, SLOW) is True
        # C is slow too, and B's latest check failed: nobody is faster, not counted.
        assert reg.verdicts.record_probe(C, SLOW) is False
        # B's confirming check: C's latest was slow too (shown, not counted): held.
        assert reg.verdicts.record_probe(B, SLOW) is False
        for _ in range(3):
            reg.verdicts.record_probe(B, SLOW)
            reg.verdicts.record_probe(C, SLOW)
    snap = reg.snapshot()
    for addr in (B, C):
        view = snap.get(addr)
        assert view.ready and view.state == "healthy", addr
        assert view.last_check_error == "timeout"
    assert (snap.get(B).slow_not_counted, snap.get(C).slow_not_counted) == (4, 4)
    assert not snap.panic
    lines = [r.getMessage() for r in caplog.records]
    assert sum("slow answer not counted upstream=10.0.0.2:6443" in m for m in lines) == 4
    assert not any("ready->unready upstream=10.0.0.2" in m or "ready->unready upstream=10.0.0.3"
                   in m or "closing connections" in m for m in lines)
    # New connections keep going to the two survivors.
    seen = set()
    for _ in range(40):
        res = reg.picks.reserve()
        assert res is not None and res.address in (B, C)
        seen.add(res.address)
        res.release()
    assert seen == {B, C}
    text = metrics_text(reg)
    assert 'extractedprism_slow_not_counted_total{upstream="10.0.0.3:6443"} 4.0' in text
    assert upstream_entry(snap.get(C), lambda t: t)["slow_not_counted"] == 4
    # C answers in time again: against it, B's next slow answers count as usual.
    reg.verdicts.record_probe(C, ready(True))
    exclude(reg, B, SLOW)
    assert not reg.snapshot().get(B).ready


def test_the_last_upstream_serving_answering_slowly_stays_in_service():
    reg = make()
    exclude(reg, A, SLOW)  # frozen beside healthy ones: excluded
    exclude(reg, B, ready(False))  # cut from etcd: HTTP 500, excluded
    for _ in range(3):
        reg.verdicts.record_probe(C, SLOW)
    view = reg.snapshot().get(C)
    assert view.ready and view.slow_not_counted == 3


def test_a_peer_with_a_stalled_connection_does_not_vouch():
    """An upstream whose own requests go unanswered is no faster peer, whatever its last
    check said: the stalls are the overload's first sign."""
    rig = Rig(overload_guard=True)
    reg = rig.reg
    a, b, c = (str(e) for e in EPS)
    exclude(reg, a, DOWN)
    rig.stalled(c, "c1")  # c's latest check passed, but a request on it waits
    for _ in range(3):
        reg.verdicts.record_probe(b, SLOW)
    view = reg.snapshot().get(b)
    assert view.ready and view.slow_not_counted == 3
    # The same without the stall: c vouches, b's slowness counts.
    rig2 = Rig(overload_guard=True)
    exclude(rig2.reg, a, DOWN)
    exclude(rig2.reg, b, SLOW)
    assert not rig2.reg.snapshot().get(b).ready


def test_a_slow_answer_not_counted_closes_no_stalled_connection():
    rig = Rig(overload_guard=True)
    reg = rig.reg
    a, b, c = (str(e) for e in EPS)
    exclude(reg, a, DOWN)
    on_b = rig.stalled(b, "b1")
    rig.stalled(c, "c1")
    reg.verdicts.record_probe(b, SLOW)  # c has a stalled connection: no faster peer
    assert not on_b.closed and reg.snapshot().get(b).slow_not_counted == 1
    # Without the guard the same check closes it (the failed-check rule).
    rig2 = Rig()
    exclude(rig2.reg, a, DOWN)
    on_b2 = rig2.stalled(b, "b1")
    rig2.stalled(c, "c1")
    rig2.reg.verdicts.record_probe(b, SLOW)
    assert on_b2.closed


@pytest.mark.parametrize("result", [ready(False), DOWN,
                                    ProbeResult(True, 0.001, "", ready=False,
                                                ready_reason="TLS verify failed: x")],
                         ids=["http-500", "refused", "tls"])
def test_an_answer_that_says_no_still_counts_when_every_one_is_slow(result):
    reg = make()
    exclude(reg, A, DOWN)
    reg.verdicts.record_probe(B, SLOW)  # counted (C was in time), then C slow: not counted
    reg.verdicts.record_probe(C, SLOW)
    exclude(reg, C, result)
    view = reg.snapshot().get(C)
    assert not (view.ready and view.healthy)


def test_off_the_spec_counts_every_timeout():
    reg = make(guard=False)
    for addr in (A, B, C):
        exclude(reg, addr, SLOW)
    snap = reg.snapshot()
    assert not any(u.ready for u in snap.upstreams)
    assert snap.get(C).slow_not_counted is None
    assert "slow_not_counted_total" not in metrics_text(reg)
    assert upstream_entry(snap.get(C), lambda t: t)["slow_not_counted"] is None


@pytest.mark.parametrize("readyz", [True, False], ids=["readyz", "tcp"])
def test_a_clients_first_answer_past_the_timeout_counts_only_against_a_faster_peer(readyz):
    reg = make(readyz=readyz)
    reg.verdicts.record_dial(A, False, SLOW_DIAL, slow=True)  # B and C answer in time: counted
    reg.verdicts.record_dial(A, False, SLOW_DIAL, slow=True)
    assert not reg.snapshot().get(A).healthy
    exclude(reg, B, DOWN)  # C is the last one
    for _ in range(3):
        reg.verdicts.record_dial(C, False, SLOW_DIAL, slow=True)
    view = reg.snapshot().get(C)
    assert view.healthy and (view.ready or not readyz)
    assert view.slow_not_counted == 3 and view.last_error_source == "dial"
    # A reset without an answer is an answer of sorts: it counts.
    reg.verdicts.record_dial(C, False, "closed the connection without answering", slow=False)
    reg.verdicts.record_dial(C, False, "closed the connection without answering", slow=False)
    assert not reg.snapshot().get(C).healthy
