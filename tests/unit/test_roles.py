"""The merger's roles (sources per endpoint, --static-endpoints=fallback demotions) and
the FALLBACK lifecycle of the upstream state machine (pure)."""

from __future__ import annotations

from extractedprism.config.endpoints import Endpoint, parse_endpoint
from extractedprism.discovery.merge import Merger
from extractedprism.upstreams import state as sm
from extractedprism.upstreams.eligibility import Candidate
from extractedprism.upstreams.roles import Roles
from tests.unit.test_selection import choose
from tests.util import FixedRandom


def eps(*texts: str) -> list[Endpoint]:
    return [parse_endpoint(t) for t in texts]


class Recorder:
    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.roles: list[Roles] = []

    def apply(self, endpoints: list[Endpoint], roles: Roles) -> None:
        self.lists.append([str(e) for e in endpoints])
        self.roles.append(roles)

    def apply_roles(self, roles: Roles) -> None:
        self.roles.append(roles)


def merger(mode: str) -> tuple[Merger, Recorder]:
    r = Recorder()
    return Merger(r.apply, lambda provider: None, static_mode=mode,
                  apply_roles=r.apply_roles), r


def test_sources_in_provider_order():
    m, r = merger("always")
    m.update("static", eps("10.0.0.1:6443", "10.0.0.2:6443"))
    m.update("cache", eps("10.0.0.3:6443", "10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.3:6443", "10.0.0.1:6443"))
    assert dict(r.roles[-1].sources) == {
        "10.0.0.1:6443": ("static", "kubernetes", "cache"),
        "10.0.0.2:6443": ("static",),
        "10.0.0.3:6443": ("kubernetes", "cache"),
    }
    assert r.roles[-1].fallback == frozenset()


def test_fallback_only_once_discovery_has_a_non_empty_list():
    m, r = merger("fallback")
    m.update("static", eps("10.0.0.1:6443", "10.0.0.2:6443"))
    assert r.roles[-1].fallback == frozenset()
    m.update("kubernetes", [])
    assert r.roles[-1].fallback == frozenset()
    m.update("kubernetes", eps("10.0.0.1:6443", "10.0.0.9:6443"))
    assert r.roles[-1].fallback == frozenset({"10.0.0.2:6443"})
    assert r.lists[-1] == ["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.9:6443"]
    # Listed again: no longer a fallback; the list is the same, so only roles apply.
    n = len(r.lists)
    m.update("kubernetes", eps("10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.9:6443"))
    m.update("kubernetes", eps("10.0.0.2:6443", "10.0.0.1:6443", "10.0.0.9:6443"))
    assert r.roles[-1].fallback == frozenset()
    assert len(r.lists) == n  # the same merged list: roles only, no endpoint update


def test_drop_applies_in_the_same_step():
    m, r = merger("always")
    m.update("static", eps("10.0.0.1:6443"))
    m.update("cache", eps("10.0.0.2:6443", "10.0.0.3:6443"))
    m.update("kubernetes", eps("10.0.0.3:6443"), drop=("cache",))
    # Never a list without 10.0.0.3 in between.
    assert r.lists == [["10.0.0.1:6443"], ["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"],
                       ["10.0.0.1:6443", "10.0.0.3:6443"]]
    assert r.roles[-1].sources["10.0.0.3:6443"] == ("kubernetes",)


def test_fallback_lifecycle():
    s = sm.listed(sm.UpstreamState(), fallback=True)
    assert s.fallback and not s.draining and not s.pickable
    assert s.lifecycle in sm.TAKES_CHECKS  # still probed
    assert sm.listed(s, fallback=False).pickable
    assert sm.drain(s).draining
    assert sm.listed(sm.drain(s), fallback=True).fallback


def test_selection_never_picks_a_fallback():
    def cand(addr: str, fallback: bool) -> Candidate:
        return Candidate(address=addr, healthy=True, draining=False, ready=False, tier=None,
                         active=0, fallback=fallback)

    for value in (0.0, 0.5, 0.999):
        got = choose([cand("s", True), cand("d", False)], mode="random", readyz=False,
                     rng=FixedRandom(value))
        assert got == "d"
    assert choose([cand("s", True)], mode="least-conn", readyz=False,
                  rng=FixedRandom(0.0)) is None
