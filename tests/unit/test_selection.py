"""Selection: table tests of every filter and mode, plus hypothesis properties."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extractedprism.config.table import SELECTION_MODES as MODES
from extractedprism.upstreams.eligibility import Candidate, eligible, hedge_base, ranked
from extractedprism.upstreams.policies import policy_for


def choose(cands: list[Candidate], *, mode: str, readyz: bool, rng: random.Random,
           exclude: object = ()) -> str | None:
    """The registry's pick over ``cands``: the one rule, then the policy's pick."""
    policy = policy_for(mode)
    pool = eligible(cands, readyz=readyz, policy=policy, exclude=exclude)  # type: ignore[arg-type]
    return policy.pick([x.address for x in pool], rng=rng,
                       active=[x.active for x in pool] if policy.counts_active else None)


def hedge_last_resort(cands: list[Candidate], *, readyz: bool, exclude: object = ()
                      ) -> str | None:
    best = ranked(cands, readyz=readyz, exclude=exclude, base=hedge_base)  # type: ignore[arg-type]
    return best[0].address if best else None


def c(address: str, *, healthy: bool = True, draining: bool = False, ready: bool = True,
      tier: int | None = 0, active: int = 0) -> Candidate:
    return Candidate(address, healthy, draining, ready, tier, active)


def picks(cands: list[Candidate], n: int = 2000, **kw: object) -> Counter[str | None]:
    rng = random.Random(1234)
    kw.setdefault("readyz", False)
    return Counter(choose(cands, rng=rng, **kw) for _ in range(n))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_empty_and_nothing_pickable(mode: str) -> None:
    rng = random.Random(0)
    assert choose([], mode=mode, readyz=False, rng=rng) is None
    cands = [c("a", healthy=False), c("b", draining=True), c("x")]
    assert choose(cands, mode=mode, readyz=True, rng=rng, exclude={"x"}) is None


def test_unknown_mode_rejected() -> None:
    with pytest.raises(ValueError, match="mode"):
        choose([c("a")], mode="round-robin", readyz=False, rng=random.Random(0))


TABLE = [
    # (description, mode, readyz, candidates, exclude, allowed picks)
    ("random: unhealthy/draining skipped", "random", False,
     [c("a", healthy=False), c("b", draining=True), c("c"), c("d")], (), {"c", "d"}),
    ("exclude honoured", "random", False, [c("a"), c("b")], ("a",), {"b"}),
    ("readyz ignored when off", "random", False,
     [c("a", ready=False), c("b")], (), {"a", "b"}),
    ("readyz keeps ready only", "random", True,
     [c("a", ready=False), c("b"), c("c")], (), {"b", "c"}),
    ("readyz falls back to all pickable", "random", True,
     [c("a", ready=False), c("b", ready=False), c("c", healthy=False)], (), {"a", "b"}),
    ("unhealthy ready does not count as ready", "random", True,
     [c("a", ready=False), c("b", healthy=False, ready=True)], (), {"a"}),
    ("excluded ready does not count as ready", "random", True,
     [c("a", ready=False), c("b", ready=True)], ("b",), {"a"}),
    ("latency: lowest tier", "latency", False,
     [c("a", tier=0), c("b", tier=0), c("c", tier=1)], (), {"a", "b"}),
    ("latency: no-sample joins lowest tier", "latency", False,
     [c("a", tier=1), c("b", tier=None), c("c", tier=2)], (), {"a", "b"}),
    ("latency: unhealthy tier 0 hands over to tier 1", "latency", False,
     [c("a", tier=0, healthy=False), c("b", tier=1), c("c", tier=1)], (), {"b", "c"}),
    ("latency: draining tier 0 hands over", "latency", False,
     [c("a", tier=0, draining=True), c("b", tier=2)], (), {"b"}),
    ("latency: only unsampled", "latency", False,
     [c("a", tier=None), c("b", tier=None)], (), {"a", "b"}),
    ("latency+readyz: ready farther tier wins", "latency", True,
     [c("a", tier=0, ready=False), c("b", tier=1), c("c", tier=2)], (), {"b"}),
    ("latency+readyz: none ready -> tiers over all", "latency", True,
     [c("a", tier=0, ready=False), c("b", tier=1, ready=False)], (), {"a"}),
    ("latency+readyz: pending new upstream waits", "latency", True,
     [c("a", tier=1), c("b", tier=None, ready=False)], (), {"a"}),
    ("least-conn: fewest", "least-conn", False,
     [c("a", active=3), c("b", active=1), c("c", active=2)], (), {"b"}),
    ("least-conn: ties", "least-conn", False,
     [c("a", active=1), c("b", active=1), c("c", active=2)], (), {"a", "b"}),
    ("least-conn: unhealthy idle ignored", "least-conn", False,
     [c("a", active=0, healthy=False), c("b", active=5)], (), {"b"}),
    ("least-conn+readyz: ready busier wins", "least-conn", True,
     [c("a", active=0, ready=False), c("b", active=9)], (), {"b"}),
    ("least-conn ignores tiers", "least-conn", False,
     [c("a", tier=0, active=4), c("b", tier=3, active=0)], (), {"b"}),
    ("random ignores tiers and load", "random", False,
     [c("a", tier=0, active=4), c("b", tier=3, active=0)], (), {"a", "b"}),
]


@pytest.mark.parametrize(("mode", "readyz", "cands", "exclude", "allowed"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_table(mode: str, readyz: bool, cands: list[Candidate], exclude: tuple[str, ...],
               allowed: set[str]) -> None:
    got = picks(cands, n=400, mode=mode, readyz=readyz, exclude=exclude)
    assert set(got) == allowed  # every allowed address is reached, nothing else


def test_random_is_uniform() -> None:
    got = picks([c("a"), c("b"), c("c", tier=5), c("d", healthy=False)], n=30000,
                mode="random")
    for addr in "abc":
        assert abs(got[addr] - 10000) < 600, got


def test_latency_new_unreachable_upstream_gets_equal_share_of_its_tier() -> None:
    # b has no sample yet (unreachable until the failure threshold excludes it): it shares
    # tier 0's picks equally with a, and tier 1 (c) gets nothing.
    got = picks([c("a", tier=0), c("b", tier=None), c("c", tier=1)], n=20000,
                mode="latency")
    assert set(got) == {"a", "b"}
    assert abs(got["a"] - 10000) < 500


def test_least_conn_tie_break_is_uniform() -> None:
    got = picks([c("a", active=2), c("b", active=2), c("c", active=2)], n=30000,
                mode="least-conn")
    for addr in "abc":
        assert abs(got[addr] - 10000) < 600, got


def test_least_conn_balances_long_lived_connections() -> None:
    rng = random.Random(7)
    active = {"a": 0, "b": 5, "c": 0}
    for _ in range(300):
        cands = [c(k, active=v) for k, v in active.items()]
        active[choose(cands, mode="least-conn", readyz=False, rng=rng)] += 1  # type: ignore[index]
    assert max(active.values()) - min(active.values()) <= 1


def test_seeded_rng_is_deterministic() -> None:
    cands = [c("a"), c("b"), c("c")]
    a = [choose(cands, mode="random", readyz=False, rng=random.Random(3)) for _ in range(5)]
    assert len(set(a)) == 1


# --- properties ---------------------------------------------------------------

cand_st = st.builds(
    Candidate,
    address=st.sampled_from([f"u{i}" for i in range(8)]),
    healthy=st.booleans(), draining=st.booleans(), ready=st.booleans(),
    tier=st.one_of(st.none(), st.integers(0, 3)), active=st.integers(0, 5),
)


def _unique(cands: list[Candidate]) -> list[Candidate]:
    seen: dict[str, Candidate] = {}
    for cand in cands:
        seen.setdefault(cand.address, cand)
    return list(seen.values())


@settings(max_examples=400, deadline=None)
@given(cands=st.lists(cand_st, max_size=8).map(_unique), mode=st.sampled_from(MODES),
       readyz=st.booleans(), exclude=st.sets(st.sampled_from([f"u{i}" for i in range(8)])),
       seed=st.integers(0, 2**32))
def test_properties(cands: list[Candidate], mode: str, readyz: bool, exclude: set[str],
                    seed: int) -> None:
    got = choose(cands, mode=mode, readyz=readyz, rng=random.Random(seed), exclude=exclude)
    pickable = [x for x in cands if x.healthy and not x.draining and x.address not in exclude]
    if not pickable:
        assert got is None
        return
    assert got is not None
    chosen = next(x for x in pickable if x.address == got)  # never unpickable or excluded
    considered = pickable
    if readyz and any(x.ready for x in pickable):
        assert chosen.ready  # readiness filters first
        considered = [x for x in pickable if x.ready]
    if mode == "latency" and chosen.tier is not None:
        assert chosen.tier == min(x.tier for x in considered if x.tier is not None)
    if mode == "least-conn":
        assert chosen.active == min(x.active for x in considered)


# -- the hedge's last resort (issue 29): where a hedge goes when no pickable upstream
# without a stalled dial is left ---------------------------------------------------------


def h(address: str, *, stalled: bool = False, last: float = 0.0, fallback: bool = False,
      healthy: bool = True, ready: bool = True, draining: bool = False,
      admin: bool = False) -> Candidate:
    return Candidate(address, healthy, draining, ready, None, 0, fallback=fallback,
                     admin_drained=admin, marked=stalled, last_success=last)


HEDGE_TABLE = [
    # (candidates, readyz, exclude, expected)
    ([], False, (), None),
    # a static fallback without a stalled dial beats stalled discovered ones, however
    # fresh their last success
    ([h("d1", stalled=True, last=9), h("d2", stalled=True, last=8), h("s", fallback=True, last=1)],
     False, (), "s"),
    # every one stalled: the most recently successful
    ([h("d1", stalled=True, last=5), h("d2", stalled=True, last=7)], False, (), "d2"),
    # readyz: a ready one first among those without a stall
    ([h("u", ready=False, last=9), h("r", last=1)], True, (), "r"),
    # readiness does not count without readyz
    ([h("u", ready=False, last=9), h("r", last=1)], False, (), "u"),
    # never an unhealthy, draining or operator-drained one, nor one already tried
    ([h("x", healthy=False), h("y", draining=True), h("z", admin=True), h("t")],
     False, ("t",), None),
    ([h("x", healthy=False, last=9), h("f", fallback=True, stalled=True, last=1)],
     False, (), "f"),
]


@pytest.mark.parametrize(("cands", "readyz", "exclude", "want"), HEDGE_TABLE)
def test_hedge_last_resort(cands: list[Candidate], readyz: bool, exclude: tuple[str, ...],
                           want: str | None) -> None:
    assert hedge_last_resort(cands, readyz=readyz, exclude=exclude) == want
