"""The registry keeps the eligible upstreams between state changes (Registry._choose_locked):
after any sequence of changes, every pick is one the selection rules allow for the state
the snapshot shows, and every allowed upstream is picked."""

from __future__ import annotations

import random

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.actions import AdminActions
from extractedprism.upstreams.eligibility import Candidate, eligible
from extractedprism.upstreams.policies import policy_for
from extractedprism.upstreams.registry import Registry
from extractedprism.upstreams.state import ProbeResult
from tests.unit.test_registry import Clock, Conn, picked

EPS = [Endpoint(f"10.0.0.{i}", 6443) for i in range(1, 5)]


def allowed(reg: Registry, mode: str, readyz: bool) -> set[str]:
    """What the rules allow, from the public snapshot alone (no cache involved)."""
    views = reg.snapshot().upstreams
    pool = eligible([Candidate(address=v.address, healthy=v.healthy, draining=v.draining,
                               ready=v.ready, tier=v.tier, active=v.active_connections,
                               fallback=v.fallback, admin_drained=v.admin_drained)
                     for v in views], policy=policy_for(mode), readyz=readyz)
    if mode == "least-conn" and pool:
        fewest = min(c.active for c in pool)
        pool = [c for c in pool if c.active == fewest]
    return {c.address for c in pool}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("readyz", [False, True])
@pytest.mark.parametrize("mode", ["random", "latency", "least-conn"])
def test_picks_follow_every_state_change(mode: str, readyz: bool) -> None:
    rnd = random.Random(f"{mode}-{readyz}")
    reg = Registry(selection=mode, readyz=readyz, clock=Clock(), rng=random.Random(7))
    reg.membership.set_endpoints(EPS)
    live: list[tuple[str, Conn]] = []
    for step in range(400):
        addr = str(rnd.choice(EPS))
        op = rnd.randrange(9)
        if op == 0:
            reg.verdicts.record_probe(addr, ProbeResult(False, None, "connection refused"))
        elif op == 1:
            up = rnd.random() < 0.6
            reg.verdicts.record_probe(addr, ProbeResult(True, rnd.choice((0.001, 0.004, 0.03)), "",
                                               ready=up if readyz else None,
                                               ready_reason="" if up else "HTTP 500"))
        elif op == 2:
            reg.verdicts.record_dial(addr, rnd.random() < 0.5, "refused")
        elif op == 3:
            AdminActions(reg).drain(addr, 0)
        elif op == 4:
            AdminActions(reg).undrain(addr, 0)
        elif op == 5:
            reg.membership.set_endpoints(rnd.sample(EPS, rnd.randint(1, len(EPS))))
        elif op == 6:  # a connection: least-conn's counts move without a state change
            res = reg.picks.reserve()
            if res is not None:
                conn = Conn(f"c{step}")
                if reg.conns.attach(res, conn):
                    live.append((res.address, conn))
        elif op == 7 and live:
            reg.conns.detach(*live.pop(rnd.randrange(len(live))))
        else:
            reg.membership.tick()
        want = allowed(reg, mode, readyz)
        got = {picked(reg) for _ in range(60)}
        if not want:
            assert got == {None}, f"step {step}: picked {got} with nothing pickable"
            continue
        got_addrs = {str(ep) for ep in got if ep is not None}
        assert None not in got and got_addrs <= want, f"step {step}: {got_addrs} not in {want}"
        assert got_addrs == want, f"step {step}: {want - got_addrs} never picked"


def test_reservation_says_whether_another_upstream_could_take_the_connection() -> None:
    """Reservation.alone (the silent-upstream check is skipped when it is True) counts every
    pickable upstream, the readyz rule's unready ones included, minus the excluded."""
    a, b, c = (str(ep) for ep in EPS[:3])
    reg = Registry(readyz=True, clock=Clock(), rng=random.Random(3))
    reg.membership.set_endpoints(EPS[:3])
    res = reg.picks.reserve()
    assert res is not None and not res.alone
    res.release()
    assert reg.picks.reserve(exclude={a, b}).alone  # type: ignore[union-attr]
    assert not reg.picks.reserve(exclude={a}).alone  # type: ignore[union-attr]
    down = ProbeResult(False, None, "connection refused")
    for _ in range(2):  # two failures exclude
        reg.verdicts.record_probe(b, down)
        reg.verdicts.record_probe(c, down)
    res = reg.picks.reserve()
    assert res is not None and res.address == a and res.alone
    reg.verdicts.record_probe(b, ProbeResult(True, 0.001, "", ready=False, ready_reason="HTTP 500"))
    reg.verdicts.record_probe(a, ProbeResult(True, 0.001, "", ready=True))
    # b is healthy but unready: never picked while a is ready, yet it could take the
    # connection if a stays silent, so a is not alone.
    res = reg.picks.reserve()
    assert res is not None and res.address == a and not res.alone
