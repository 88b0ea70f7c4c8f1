"""--keep-last-ready with an injected clock: a slow answer (a readyz probe or a client's
first answer past --health-timeout) does not take the last upstream serving out of
service; every other failure, and a slow answer while another upstream serves, counts as
the spec says."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from extractedprism.health.document import upstream_entry
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.unit.test_registry import DOWN, EPS, A, B, C, Clock, ready

SLOW = ProbeResult(True, 0.001, "", ready=False, ready_reason="timeout")
SLOW_DIAL = "no answer within 1s to the client's TLS ClientHello"


def make(keep: bool = True, readyz: bool = True) -> Registry:
    reg = Registry(clock=Clock(), readyz=readyz, keep_last_ready=keep,
                   unready_drain_timeout=1.0)
    reg.set_endpoints(EPS)
    for addr in (A, B, C):
        reg.record_probe(addr, ready(True) if readyz else ProbeResult(True, 0.001, ""))
    return reg


def exclude(reg: Registry, addr: str, result: ProbeResult) -> None:
    reg.record_probe(addr, result)
    reg.record_probe(addr, result)


def metrics_text(reg: Registry) -> str:
    m = Metrics()
    m.attach_state(reg.snapshot)
    return generate_latest(m.registry).decode()


def test_the_last_ready_upstream_answering_slowly_stays_in_service(caplog):
    reg = make()
    exclude(reg, A, SLOW)  # frozen: excluded, B and C still serve
    assert not reg.snapshot().get(A).ready
    exclude(reg, B, SLOW)  # overloaded: excluded, C still serves
    assert not reg.snapshot().get(B).ready
    with caplog.at_level(logging.INFO, logger="extractedprism.upstreams.registry"):
        assert reg.record_probe(C, SLOW) is True  # one failure: the recheck is due
        assert reg.record_probe(C, SLOW) is False  # held: no recheck storm on it either
        reg.record_probe(C, SLOW)
    view = reg.snapshot().get(C)
    assert view.ready and view.state == "healthy"
    assert view.kept_last == 2 and view.last_check_error == "timeout"
    assert not reg.snapshot().panic
    lines = [r.getMessage() for r in caplog.records]
    assert sum("slow answer not counted upstream=10.0.0.3:6443" in m for m in lines) == 2
    assert not any("ready->unready upstream=10.0.0.3" in m for m in lines)
    # New connections keep going to it, not to the frozen or the other unready one.
    for _ in range(30):
        res = reg.reserve()
        assert res is not None and res.address == C
        res.release()
    text = metrics_text(reg)
    assert 'extractedprism_kept_last_total{upstream="10.0.0.3:6443"} 2.0' in text
    assert upstream_entry(view, lambda t: t)["kept_last"] == 2
    # Once another serves again, the held one's next slow answers count as usual.
    reg.record_probe(B, ready(True))
    exclude(reg, C, SLOW)
    assert not reg.snapshot().get(C).ready


@pytest.mark.parametrize("result", [ready(False), DOWN,
                                    ProbeResult(True, 0.001, "", ready=False,
                                                ready_reason="TLS verify failed: x")],
                         ids=["http-500", "refused", "tls"])
def test_an_answer_that_says_no_still_counts_on_the_last_one(result):
    reg = make()
    exclude(reg, A, SLOW)
    exclude(reg, B, SLOW)
    exclude(reg, C, result)
    view = reg.snapshot().get(C)
    assert not (view.ready and view.healthy)
    assert view.kept_last == 0


def test_a_slow_answer_counts_while_another_upstream_serves():
    reg = make()
    exclude(reg, A, SLOW)
    assert not reg.snapshot().get(A).ready
    assert reg.snapshot().get(A).kept_last == 0


def test_off_the_spec_counts_every_timeout():
    reg = make(keep=False)
    for addr in (A, B, C):
        exclude(reg, addr, SLOW)
    snap = reg.snapshot()
    assert not any(u.ready for u in snap.upstreams)
    assert snap.get(C).kept_last is None
    assert "kept_last_total" not in metrics_text(reg)
    assert upstream_entry(snap.get(C), lambda t: t)["kept_last"] is None


@pytest.mark.parametrize("readyz", [True, False], ids=["readyz", "tcp"])
def test_a_clients_first_answer_past_the_timeout_does_not_exclude_the_last_one(readyz):
    reg = make(readyz=readyz)
    for addr in (A, B):  # connection refused: gone
        exclude(reg, addr, DOWN)
    for _ in range(3):
        reg.record_dial(C, False, SLOW_DIAL, slow=True)
    view = reg.snapshot().get(C)
    assert view.healthy and (view.ready or not readyz)
    assert view.kept_last == 2 and view.last_error_source == "dial"  # the 2nd and 3rd
    # A reset without an answer is an answer of sorts: it counts.
    reg.record_dial(C, False, "closed the connection without answering", slow=False)
    reg.record_dial(C, False, "closed the connection without answering", slow=False)
    assert not reg.snapshot().get(C).healthy
