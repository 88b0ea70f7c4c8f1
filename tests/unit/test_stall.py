"""The stall check's rules with an injected clock: the per-connection rule
(upstreams/activity.py) and the registry's (when a stall asks for a check, the rate
limit, how a stall check's result counts, which connections go at the exclusion)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.activity import Activity
from extractedprism.upstreams.effects import Change
from extractedprism.upstreams.registry import Registry
from tests.unit.test_registry import DOWN, EPS, A, B, C, Clock, Conn, ready

T = 2.0  # --stall-timeout


# --- the per-connection rule -------------------------------------------------------------


def test_unanswered_bytes_are_asked_from_the_first_sample_that_sees_them():
    act = Activity(0.0, up=100, down=500, answered=100)  # answered so far
    assert act.asked is None
    act.sample(1.0, up=160, down=500, answered=100)  # a request, nothing back
    assert act.asked == 1.0
    act.sample(2.0, up=200, down=500, answered=100)  # more of it: the clock keeps running
    assert act.asked == 1.0
    assert not act.is_stalled(2.9, T) and act.is_stalled(3.0, T)
    assert act.stalled_for(3.5) == 2.5
    act.sample(3.5, up=200, down=900, answered=200)  # the answer
    assert act.asked is None and not act.is_stalled(10.0, T)


def test_a_request_after_the_answer_in_the_same_sample_period_is_timed():
    act = Activity(0.0, up=100, down=500, answered=100)
    # Between two samples: the answer to an older request came, then a new request.
    act.sample(1.0, up=180, down=800, answered=120)
    assert act.asked == 1.0


def test_an_answer_in_the_same_sample_period_answers():
    act = Activity(0.0, up=100, down=500, answered=100)
    act.sample(1.0, up=180, down=800, answered=180)  # request and answer, 3 ms apart
    assert act.asked is None


def test_the_preface_case_the_first_request_is_answered_by_the_servers_first_frames():
    # ClientHello out, ServerHello back; Finished + preface + SETTINGS + the first request
    # out; the server's SETTINGS / WINDOW_UPDATE / SETTINGS ACK back within a millisecond:
    # the relay read them after the request, so the request counts as answered ...
    act = Activity(0.0, up=300, down=2000, answered=300)
    act.sample(0.25, up=700, down=2150, answered=700)
    assert act.asked is None
    # ... and the client's next bytes (its next request, a PING, an RST_STREAM) are timed.
    act.sample(10.0, up=760, down=2150, answered=700)
    assert act.asked == 10.0 and act.is_stalled(12.0, T)


def test_a_clienthello_nothing_answers_is_asked_from_the_first_sample():
    act = Activity(5.0, up=517, down=0, answered=0)  # a frozen server accepted TCP
    assert act.asked == 5.0 and act.is_stalled(7.0, T)


def test_a_stall_is_counted_and_checked_once_per_unanswered_stretch():
    act = Activity(0.0, up=100, down=10, answered=100)
    act.sample(1.0, up=150, down=10, answered=100)
    act.stalled, act.checks = True, 1
    act.sample(4.0, up=170, down=10, answered=100)  # the client sends more: same stretch
    assert act.stalled and act.checks == 1
    act.sample(5.0, up=170, down=90, answered=170)  # answered: the next stretch is new
    assert not act.stalled and act.checks == 0


def test_off_never_stalls():
    act = Activity(0.0, up=517, down=0, answered=0)
    assert not act.is_stalled(1e6, 0.0)


# --- the registry ------------------------------------------------------------------------


class Rig:
    def __init__(self, *, stall: float = T, readyz: bool = True,
                 selection: str = "random", overload_guard: bool = False) -> None:
        self.clock = Clock()
        self.changes: list[Change] = []
        self.reg = Registry(clock=self.clock, readyz=readyz, stall_timeout=stall,
                            selection=selection, unready_drain_timeout=30.0,
                            on_change=self.changes.append, overload_guard=overload_guard)
        self.reg.membership.set_endpoints(EPS)
        for addr in (str(e) for e in EPS):
            self.reg.verdicts.record_probe(addr, ready(True))
        self.changes.clear()

    def conn(self, addr: str, name: str) -> Conn:
        c = Conn(name)
        assert self.reg.conns.attach(addr, c)
        return c

    def stalled(self, addr: str, name: str) -> Conn:
        """A connection on ``addr`` whose request has gone unanswered for T."""
        c = self.conn(addr, name)
        answer(c)
        self.sample()
        ask(c)
        self.sample(0.1)
        self.sample(T)
        return c

    def sample(self, after: float = 0.0) -> list[Change]:
        self.clock.now += after
        self.changes.clear()
        self.reg.stalls.sample_activity()
        return [c for c in self.changes if c.what == "stall-check"]


def metrics_text(reg: Registry) -> str:
    m = Metrics()
    m.attach_state(reg.snapshot)
    return generate_latest(m.registry).decode()


def ask(c: Conn, n: int = 50) -> None:
    c.bytes_up += n


def answer(c: Conn, n: int = 200) -> None:
    c.bytes_down += n
    c.up_answered = c.bytes_up


def test_a_stall_asks_for_a_check_of_its_upstream_once_the_stall_timeout_has_passed():
    rig = Rig()
    c = rig.conn(A, "kubelet")
    answer(c)
    assert rig.sample() == []
    ask(c)
    assert rig.sample(0.25) == []  # asked from here (times exact in binary)
    assert rig.sample(T - 0.25) == []
    assert rig.sample(0.25) == [Change("stall-check", A)]
    assert rig.sample(0.25) == []  # within the rate limit
    view = rig.reg.snapshot().get(A)
    assert (view.stalls, view.stalled_connections) == (1, 1)
    assert rig.reg.snapshot().get(B).stalls == 0


def test_a_stretch_still_unanswered_gets_one_second_look_and_no_more():
    # A kube-apiserver's readyz lags an etcd cut by seconds: the first look may pass.
    rig = Rig()
    c = rig.conn(A, "kubelet")
    answer(c)
    rig.sample()
    ask(c)
    rig.sample(0.25)
    assert rig.sample(T) == [Change("stall-check", A)]
    rig.reg.verdicts.record_probe(A, ready(True), stall=True)  # the first look passed
    assert rig.sample(2 * T - 0.25) == []  # an answer within 3 T costs one probe
    assert rig.sample(0.25) == [Change("stall-check", A)]  # the second look
    rig.reg.verdicts.record_probe(A, ready(True), stall=True)
    for _ in range(10):  # a LIST that takes a minute costs no more probes
        assert rig.sample(T) == []
    assert rig.reg.snapshot().get(A).stalls == 1
    answer(c)  # the answer ends the stretch; the next request starts another
    rig.sample(0.25)
    ask(c)
    rig.sample(0.25)
    assert rig.sample(T) == [Change("stall-check", A)]
    assert rig.reg.snapshot().get(A).stalls == 2


def test_the_rate_limit_is_one_stall_check_per_upstream_per_stall_timeout():
    rig = Rig()
    conns = [rig.conn(A, f"c{i}") for i in range(3)]
    rig.sample()
    ask(conns[0])
    rig.sample(0.1)
    asked = []
    for c in conns[1:]:
        ask(c)
        rig.sample(0.5)
    asked += rig.sample(T - 1.0)  # conns[0] stalled: a check
    assert asked == [Change("stall-check", A)]
    assert rig.sample(0.5) == []  # conns[1] stalled, within the limit: waits
    assert rig.sample(T - 0.5) == [Change("stall-check", A)]  # the limit is over
    assert rig.reg.snapshot().get(A).stalls == 3
    # Another upstream is not held back by A's limit.
    b = rig.conn(B, "b")
    rig.sample()
    ask(b)
    rig.sample(0.1)
    assert Change("stall-check", B) in rig.sample(T)  # (beside A's second looks)


def test_no_stall_check_of_an_excluded_upstream_or_without_client_bytes():
    rig = Rig()
    idle, watch = rig.conn(A, "idle"), rig.conn(A, "watch")
    answer(idle)
    rig.sample()
    for _ in range(10):
        answer(watch)  # only the upstream sends
        assert rig.sample(T) == []
    c = rig.conn(B, "c")
    rig.reg.verdicts.record_probe(B, ready(False))
    rig.reg.verdicts.record_probe(B, ready(False))  # unready: excluded already
    rig.sample()
    ask(c)
    rig.sample(0.1)
    assert rig.sample(T) == []
    assert rig.reg.snapshot().get(B).stalls == 1  # counted, not checked


def test_a_stall_checks_result_counts_like_any_other_and_is_counted_and_logged(caplog):
    rig = Rig()
    c = rig.conn(A, "kubelet")
    rig.sample()
    ask(c)
    rig.sample(0.1)
    assert rig.sample(T)
    with caplog.at_level(logging.INFO, logger="extractedprism.upstreams.registry"):
        assert rig.reg.verdicts.record_probe(A, ready(False), stall=True) is True  # confirm soon
    lines = [r.getMessage() for r in caplog.records if "stall check" in r.getMessage()]
    assert len(lines) == 1
    assert f"stall check upstream={A} result=failed reason='HTTP 500'" in lines[0]
    assert "stalled_connections=1 stalled_for=2.0s client=kubelet" in lines[0]
    view = rig.reg.snapshot().get(A)
    assert view.ready and dict(view.stall_checks) == {"failed": 1}  # one failure: not yet
    rig.reg.verdicts.record_probe(A, ready(True), stall=False)  # an ordinary check clears it
    assert rig.reg.snapshot().get(A).ready
    assert dict(rig.reg.snapshot().get(A).stall_checks) == {"failed": 1}
    text = metrics_text(rig.reg)
    assert (f'extractedprism_stall_checks_total{{result="failed",upstream="{A}"}} 1.0'
            in text or f'extractedprism_stall_checks_total{{upstream="{A}",result="failed"}}'
            ' 1.0' in text)


@pytest.mark.parametrize("readyz", [True, False], ids=["readyz", "tcp"])
def test_a_failed_check_closes_its_stalled_connections_and_the_others_stay(readyz):
    rig = Rig(readyz=readyz)
    stalled, quiet, fresh = rig.conn(A, "stalled"), rig.conn(A, "quiet"), rig.conn(A, "fresh")
    for c in (stalled, quiet, fresh):
        answer(c)
    rig.sample()
    ask(stalled)
    rig.sample(0.1)
    rig.sample(T)
    ask(fresh)  # unanswered, but not for a stall timeout yet
    fail = ready(False) if readyz else DOWN
    # The first failed check: what waits on an answer goes now (the client reconnects
    # elsewhere); the upstream itself stays in service until the confirming check.
    rig.reg.verdicts.record_probe(A, fail, stall=True)
    assert stalled.closed and not quiet.closed and not fresh.closed
    view = rig.reg.snapshot().get(A)
    assert view.ready if readyz else view.healthy
    rig.reg.conns.detach(A, stalled)
    rig.reg.verdicts.record_probe(A, fail)
    view = rig.reg.snapshot().get(A)
    assert (not view.ready) if readyz else (not view.healthy)
    assert not quiet.closed and not fresh.closed  # they keep --unready-drain-timeout


def test_a_passed_check_closes_nothing():
    rig = Rig()
    c = rig.stalled(A, "slow-list")
    rig.reg.verdicts.record_probe(A, ready(True), stall=True)
    rig.sample(2 * T)  # the second look
    rig.reg.verdicts.record_probe(A, ready(True), stall=True)
    assert not c.closed and rig.reg.snapshot().get(A).ready


@pytest.mark.parametrize("selection", ["random", "least-conn"])
def test_after_a_failed_check_closed_its_stalled_connections_picks_avoid_it_until_the_next(
        selection):
    # The reconnect of a connection just closed must not land on the upstream it left:
    # with least-conn that one now has the fewest connections.
    rig = Rig(selection=selection)
    others = {B, C}
    for i, addr in enumerate(sorted(others)):
        answer(rig.conn(addr, f"busy{i}"))
    c = rig.stalled(A, "kubelet")
    rig.reg.verdicts.record_probe(A, ready(False), stall=True)
    assert c.closed
    rig.reg.conns.detach(A, c)
    for _ in range(3):  # samples come and go: still avoided, no check has decided
        rig.sample(T / 8)
        assert picks(rig.reg) == others
    rig.reg.verdicts.record_probe(A, ready(True))  # the next check passes: back in the picks
    rig.sample(T / 8)
    assert A in picks(rig.reg)


def picks(reg: Registry, n: int = 60) -> set[str]:
    out = set()
    for _ in range(n):
        res = reg.picks.reserve()
        assert res is not None
        out.add(res.address)
        res.release()
    return out


def test_no_close_at_the_exclusion_when_no_other_upstream_serves():
    rig = Rig()
    for addr in (B, str(EPS[2])):
        rig.reg.verdicts.record_probe(addr, ready(False))
        rig.reg.verdicts.record_probe(addr, ready(False))
    c = rig.conn(A, "kubelet")
    rig.sample()
    ask(c)
    rig.sample(0.1)
    rig.sample(T)
    rig.reg.verdicts.record_probe(A, ready(False))
    rig.reg.verdicts.record_probe(A, ready(False))
    assert not c.closed


def test_off_tracks_nothing_and_shows_nulls():
    rig = Rig(stall=0.0)
    c = rig.conn(A, "kubelet")
    ask(c)
    rig.sample()
    assert rig.sample(10 * T) == []
    view = rig.reg.snapshot().get(A)
    assert (view.stalls, view.stalled_connections, view.stall_checks) == (None, None, ())
    rig.reg.verdicts.record_probe(A, ready(False))
    rig.reg.verdicts.record_probe(A, ready(False))
    assert not c.closed
    assert "stall_checks_total" not in metrics_text(rig.reg)


@pytest.mark.parametrize("selection", ["random", "least-conn"])
def test_new_connections_avoid_a_suspect_while_another_upstream_can_take_them(selection):
    rig = Rig(selection=selection)
    others = {str(e) for e in EPS} - {A}

    def picks(n: int = 60) -> set[str]:
        out = set()
        for _ in range(n):
            res = rig.reg.picks.reserve()
            assert res is not None
            out.add(res.address)
            res.release()
        return out

    c = rig.conn(A, "kubelet")
    for i, addr in enumerate(sorted(others)):  # one each: least-conn ties
        answer(rig.conn(addr, f"idle{i}"))
    answer(c)
    rig.sample()
    assert A in picks()
    ask(c)
    rig.sample(0.25)
    assert A in picks()  # unanswered, not yet stalled
    rig.sample(T)  # stalled: suspect until answered or excluded
    assert picks() == others
    answer(c)
    rig.sample(0.25)
    assert A in picks()
    # Every upstream suspect: the picks go on as before rather than nowhere.
    conns = [rig.conn(str(e), f"c{i}") for i, e in enumerate(EPS)]
    rig.sample()
    for x in conns:
        ask(x)
    rig.sample(0.25)
    rig.sample(T)
    assert picks() == {str(e) for e in EPS}


@pytest.mark.parametrize("selection", ["random", "least-conn"])
def test_a_retry_or_hedge_avoids_a_suspect_while_another_upstream_is_left(selection):
    """Issue 29: the pick of a retry or of the first answer's hedge (a pick with
    upstreams already tried) follows the first pick's rule: a suspect takes it only when
    nothing else is left."""
    rig = Rig(selection=selection)
    b, c3 = sorted({str(e) for e in EPS} - {A})

    def picks(exclude: set[str], n: int = 60) -> set[str]:
        out = set()
        for _ in range(n):
            res = rig.reg.picks.reserve(exclude=exclude)
            assert res is not None
            out.add(res.address)
            res.release()
        return out

    kubelet = rig.conn(A, "kubelet")
    answer(kubelet)
    answer(rig.conn(c3, "idle"))  # least-conn ties A and c3
    rig.sample()
    assert picks({b}) == {A, c3}
    ask(kubelet)
    rig.sample(0.25)
    rig.sample(T)  # stalled: A is suspect
    assert picks({b}) == {c3}
    assert picks({b, c3}) == {A}  # nothing else left: the suspect rather than nothing
    answer(kubelet)
    rig.sample(0.25)
    assert picks({b}) == {A, c3}


def test_a_retry_avoids_an_upstream_whose_dial_stalled():
    reg = Registry(readyz=False)
    reg.membership.set_endpoints(EPS)
    b, c3 = sorted({str(e) for e in EPS} - {A})
    while True:  # a dial to A, marked stalled by the Dialer
        first = reg.picks.reserve()
        assert first is not None
        if first.address == A:
            break
        first.release()
    reg.picks.stall_dial(first)
    seen = set()
    for _ in range(60):
        res = reg.picks.reserve(exclude={b})
        assert res is not None
        seen.add(res.address)
        res.release()
    assert seen == {c3}
    first.release()


def test_off_has_no_suspects():
    rig = Rig(stall=0.0)
    c = rig.conn(A, "kubelet")
    rig.sample()
    ask(c)
    rig.sample(0.25)
    rig.sample(10 * T)
    assert A in {rig.reg.picks.reserve().address for _ in range(60)}  # type: ignore[union-attr]
