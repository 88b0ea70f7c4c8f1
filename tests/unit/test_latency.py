"""Latency EWMA and tiers: every rule from the spec with constructed samples."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extractedprism.upstreams.latency import ALPHA, HYSTERESIS, LatencyTiers, smooth, tier_limit

MS = 0.001


def tiers_from(samples: dict[str, float]) -> LatencyTiers:
    t = LatencyTiers()
    for key, rtt in samples.items():
        t.observe(key, rtt)
    return t


def groups(t: LatencyTiers) -> list[set[str]]:
    """The tiers as sets, tier 0 first."""
    out: list[set[str]] = []
    for key, n in sorted(t.tier_map.items(), key=lambda kv: kv[1]):
        while len(out) <= n:
            out.append(set())
        out[n].add(key)
    return out


# --- smoothing ---------------------------------------------------------------

def test_first_sample_is_the_average() -> None:
    t = LatencyTiers()
    assert t.average("a") is None and t.tier("a") is None
    t.observe("a", 5 * MS)
    assert t.average("a") == pytest.approx(5 * MS)
    assert t.tier("a") == 0


def test_ewma_step_uses_alpha() -> None:
    t = tiers_from({"a": 10 * MS})
    t.observe("a", 20 * MS)
    assert t.average("a") == pytest.approx(10 * MS + ALPHA * 10 * MS)


def test_sample_capped_at_four_times_average() -> None:
    t = tiers_from({"a": 10 * MS})
    t.observe("a", 1.0)  # a retransmitted SYN
    assert t.average("a") == pytest.approx(10 * MS + ALPHA * (40 * MS - 10 * MS))


def test_cap_never_below_two_ms() -> None:
    t = tiers_from({"a": 0.1 * MS})
    t.observe("a", 1.0)
    # 4 x 0.1 ms = 0.4 ms is below the floor: the cap is 2 ms.
    assert t.average("a") == pytest.approx(0.1 * MS + ALPHA * (2 * MS - 0.1 * MS))


def test_sample_below_a_quarter_replaces_average() -> None:
    t = tiers_from({"a": 1.0})  # the first check took a retransmission
    t.observe("a", 1 * MS)
    assert t.average("a") == pytest.approx(1 * MS)


def test_sample_at_exactly_a_quarter_is_smoothed_not_replaced() -> None:
    t = tiers_from({"a": 40 * MS})
    t.observe("a", 10 * MS)
    assert t.average("a") == pytest.approx(40 * MS + ALPHA * (10 * MS - 40 * MS))


def test_lasting_increase_shows_within_a_few_checks() -> None:
    t = tiers_from({"a": 1 * MS})
    for _ in range(8):
        t.observe("a", 100 * MS)
    assert t.average("a") > 50 * MS


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_nonsense_samples_do_not_poison_the_average(bad: float) -> None:
    assert smooth(None, bad) == 0.0
    assert smooth(1 * MS, bad) == 0.0  # below a quarter: replaces
    assert math.isfinite(smooth(None, math.inf))


@given(avg=st.floats(1e-6, 10.0), sample=st.floats(0.0, 100.0))
def test_smooth_bounded(avg: float, sample: float) -> None:
    new = smooth(avg, sample)
    if sample < avg / 4:
        assert new == sample
    else:
        cap = max(4 * avg, 0.002)
        assert min(avg, sample) - 1e-12 <= new <= max(avg, min(sample, cap)) + 1e-12


# --- tier limit --------------------------------------------------------------

@pytest.mark.parametrize(("base", "limit"), [
    (0.0, 2 * MS), (0.5 * MS, 2.5 * MS), (2 * MS, 4 * MS), (10 * MS, 20 * MS),
])
def test_tier_limit(base: float, limit: float) -> None:
    assert tier_limit(base) == pytest.approx(limit)


# --- tiers -------------------------------------------------------------------

def test_within_two_ms_of_best_is_tier_zero() -> None:
    t = tiers_from({"a": 0.3 * MS, "b": 0.9 * MS, "c": 2.2 * MS})
    assert t.tier_map == {"a": 0, "b": 0, "c": 0}


def test_tiers_by_double_the_best() -> None:
    t = tiers_from({"a": 10 * MS, "b": 19 * MS, "c": 25 * MS, "d": 45 * MS, "e": 200 * MS})
    # tier 0: <= 20 ms; tier 1: best 25 -> <= 50 ms; tier 2: 200 ms.
    assert t.tier_map == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2}


def test_entry_uses_strict_limit() -> None:
    t = tiers_from({"a": 1 * MS, "b": 3.5 * MS})  # limit 3 ms, band 3.75 ms
    assert t.tier_map == {"a": 0, "b": 1}


def test_hysteresis_keeps_member_up_to_plus_25_percent() -> None:
    t = tiers_from({"a": 1 * MS, "b": 2.9 * MS})
    assert t.tier_map == {"a": 0, "b": 0}
    t.observe("b", 3.7 * MS)  # smoothed: 2.9 + 0.3 * 0.8 = 3.14 ms > limit, < band
    assert 3 * MS < t.average("b") <= 3.75 * MS
    assert t.tier("b") == 0
    while t.average("b") <= HYSTERESIS * tier_limit(1 * MS):
        assert t.tier("b") == 0
        t.observe("b", 3.9 * MS)
    assert t.tier_map == {"a": 0, "b": 1}


def test_member_at_exactly_band_stays_and_just_above_leaves() -> None:
    band = HYSTERESIS * tier_limit(1 * MS)  # 3.75 ms
    t = tiers_from({"a": 1 * MS, "b": 2 * MS})
    t._avg["b"] = band  # constructed state: exactly on the band edge
    t.observe("a", 1 * MS)
    assert t.tier("b") == 0
    t._avg["b"] = band * 1.0001
    t.observe("a", 1 * MS)
    assert t.tier("b") == 1


def test_upstream_rejoins_better_tier_when_inside_its_limit() -> None:
    t = tiers_from({"a": 1 * MS, "b": 5 * MS})
    assert t.tier("b") == 1
    t.observe("b", 1.2 * MS)  # below a quarter: replaces -> 1.2 ms
    assert t.tier_map == {"a": 0, "b": 0}


def test_group_limit_follows_its_lowest_member() -> None:
    t = tiers_from({"a": 1 * MS, "b": 2.9 * MS})
    assert groups(t) == [{"a", "b"}]
    # a gets faster: the group's limit tightens to max(0.2 + 2, 0.4) = 2.2 ms, band 2.75.
    t.observe("a", 0.2 * MS)
    assert groups(t) == [{"a"}, {"b"}]


def test_slowing_best_member_raises_limit_not_splits() -> None:
    t = tiers_from({"a": 10 * MS, "b": 19 * MS})
    assert groups(t) == [{"a", "b"}]
    t.observe("a", 14 * MS)  # a smooths to 11.2 ms: base rises, b stays
    assert groups(t) == [{"a", "b"}]


def test_tier_appearing_above_does_not_split_a_group() -> None:
    t = tiers_from({"b": 10 * MS, "c": 22 * MS})  # c enters? 22 > 20: no
    assert t.tier_map == {"b": 0, "c": 1}
    t = tiers_from({"b": 10 * MS, "c": 19 * MS})
    t.observe("c", 22 * MS)  # c -> 19.9 ms... keep pushing inside the band
    for _ in range(5):
        t.observe("c", 24 * MS)
    assert 20 * MS < t.average("c") <= 25 * MS
    assert groups(t) == [{"b", "c"}]  # kept by hysteresis
    t.observe("a", 1 * MS)  # a new, much closer upstream
    # From scratch the rule would give {a}, {b}, {c}; the group stays whole instead.
    assert groups(t) == [{"a"}, {"b", "c"}]
    assert t.tier_map == {"a": 0, "b": 1, "c": 1}


def test_tier_disappearing_above_keeps_group_whole() -> None:
    t = tiers_from({"b": 10 * MS, "c": 19 * MS})
    for _ in range(5):
        t.observe("c", 24 * MS)
    t.observe("a", 1 * MS)
    assert t.tier_map == {"a": 0, "b": 1, "c": 1}
    t.remove("a")
    assert t.tier_map == {"b": 0, "c": 0}
    assert t.average("a") is None and t.tier("a") is None


def test_new_upstream_close_to_a_group_joins_it_whole() -> None:
    t = tiers_from({"b": 10 * MS, "c": 19 * MS})
    for _ in range(5):
        t.observe("c", 24 * MS)  # c ~ 22.5 ms, held by hysteresis
    t.observe("d", 9.5 * MS)  # limit 19 ms, band 23.75 ms: b and c fit
    assert groups(t) == [{"b", "c", "d"}]


def test_new_upstream_takes_everyone_within_its_limit_into_tier_zero() -> None:
    t = tiers_from({"b": 2 * MS, "c": 3.9 * MS})  # limit 4 ms
    assert groups(t) == [{"b", "c"}]
    # limit 2.5 ms: b is within it, so b is tier 0 (the spec's rule, literally); c, a
    # member of b's group, is beyond the 3.125 ms band and leaves.
    t.observe("a", 0.5 * MS)
    assert groups(t) == [{"a", "b"}, {"c"}]


def test_issue_12_example_a_b_then_c() -> None:
    # A = 1.0 ms and B = 3.48 ms in one tier (B kept by hysteresis: limit 3 ms, band
    # 3.75 ms), then C arrives at 0.4 ms: tier 0 = {C, A} since A <= max(2.4, 0.8) ms,
    # and B leaves since 3.48 > 1.25 * 2.4 ms. (The old code gave {C}, {A, B}.)
    t = tiers_from({"A": 1.0 * MS, "B": 2.9 * MS})
    t._avg["B"] = 3.48 * MS  # constructed: B drifted up inside the band
    t.observe("A", 1.0 * MS)
    assert groups(t) == [{"A", "B"}]
    t.observe("C", 0.4 * MS)
    assert groups(t) == [{"C", "A"}, {"B"}]
    assert t.tier_map == {"C": 0, "A": 0, "B": 1}


def test_a_pair_apart_at_first_rejoins_as_soon_as_averages_are_within_the_limit() -> None:
    # Two loopback upstreams; b's first check was slow (3 ms against 0.3 ms): separate
    # tiers. Every later sample of b is normal.
    t = tiers_from({"a": 0.3 * MS, "b": 3 * MS})
    assert t.tier_map == {"a": 0, "b": 1}
    t.observe("b", 0.5 * MS)  # below a quarter of 3 ms: replaces the average
    assert t.tier_map == {"a": 0, "b": 0}
    # Without the replacement (a sample just above a quarter), b rejoins on the very
    # sample that brings its average within a's limit of 2.3 ms, not later.
    t = tiers_from({"a": 0.3 * MS, "b": 3 * MS})
    while t.average("b") > tier_limit(0.3 * MS):
        assert t.tier("b") == 1
        t.observe("a", 0.3 * MS)
        t.observe("b", 0.8 * MS)
    assert t.tier_map == {"a": 0, "b": 0}


def test_hysteresis_holds_a_member_near_the_boundary_and_keeps_a_leaver_out() -> None:
    t = tiers_from({"near": 10 * MS, "edge": 15 * MS})
    for _ in range(50):  # join limit 20 ms, leave limit 25 ms
        t.observe("edge", 22 * MS)
        assert t.tier("edge") == 0
    for _ in range(50):
        t.observe("edge", 30 * MS)
    assert t.tier("edge") == 1
    for _ in range(50):
        t.observe("edge", 22 * MS)
        assert t.tier("edge") == 1  # a non-member between the limits stays out
    for _ in range(50):
        t.observe("edge", 15 * MS)
    assert t.tier("edge") == 0


def _held(t: LatencyTiers) -> None:
    t.observe("anchor", 10 * MS)
    t.observe("edge", 15 * MS)
    for _ in range(50):
        t.observe("edge", 24 * MS)
    assert 20 * MS < t.average("edge") <= 25 * MS and t.tier("edge") == t.tier("anchor")


def test_a_new_best_in_the_same_group_keeps_its_hysteresis_member() -> None:
    t = LatencyTiers()
    _held(t)
    t.observe("new", 9.9 * MS)  # limit 19.8 ms, band 24.75 ms
    assert groups(t) == [{"anchor", "edge", "new"}]


def test_merging_groups_do_not_pull_in_each_others_members() -> None:
    t = tiers_from({"anchor": 10 * MS, "joiner": 21 * MS, "outsider": 24 * MS})
    assert t.tier_map == {"anchor": 0, "joiner": 1, "outsider": 1}
    for _ in range(50):
        t.observe("joiner", 19 * MS)
    assert t.tier_map == {"anchor": 0, "joiner": 0, "outsider": 1}


def test_an_upstream_hovering_at_a_boundary_does_not_flap_the_others() -> None:
    t = tiers_from({"dead": 1 * MS, "edge": 2.5 * MS, "mid": 6 * MS, "far": 50 * MS})
    seen = []
    for sample in [6 * MS, 6 * MS] + [3.6 * MS, 3.9 * MS] * 20:
        t.observe("edge", sample)
        seen.append(t.tier("mid") == t.tier("edge"))
    assert sum(1 for x, y in itertools.pairwise(seen) if x != y) <= 1


def test_removed_upstream_rebuilds_tiers() -> None:
    t = tiers_from({"a": 1 * MS, "b": 10 * MS, "c": 15 * MS, "d": 50 * MS})
    assert t.tier_map == {"a": 0, "b": 1, "c": 1, "d": 2}
    t.remove("a")
    assert t.tier_map == {"b": 0, "c": 0, "d": 1}
    t.remove("zzz")  # unknown: no-op
    assert set(t.tier_map) == {"b", "c", "d"} and t.average("a") is None


def test_removing_group_base_rechecks_remaining_members() -> None:
    t = tiers_from({"a": 1 * MS, "b": 2.9 * MS, "c": 10 * MS})
    assert t.tier_map == {"a": 0, "b": 0, "c": 1}
    t.remove("a")
    # b is now the base (limit 5.8 ms); c (10 ms) still a tier of its own.
    assert t.tier_map == {"b": 0, "c": 1}


def test_tier_map_is_replaced_never_changed() -> None:
    # The registry's pick cache keeps the map it computed its list from and compares it
    # with the current one: a change must come as a new dict, the old one left as it was.
    t = tiers_from({"a": 1 * MS})
    before = t.tier_map
    t.observe("b", 50 * MS)
    assert t.tier_map is not before and before == {"a": 0}
    assert t.tier_map == {"a": 0, "b": 1}
    before = t.tier_map
    t.remove("b")
    assert t.tier_map is not before and before == {"a": 0, "b": 1}


def test_alpha_validated() -> None:
    with pytest.raises(ValueError):
        LatencyTiers(alpha=0)
    LatencyTiers(alpha=1.0)


# --- properties --------------------------------------------------------------

keys = st.sampled_from(["a", "b", "c", "d", "e", "f"])
events = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), keys, st.floats(0.0, 2.0)),
        st.tuples(st.just("remove"), keys, st.just(0.0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_tier_invariants(evs: list[tuple[str, str, float]]) -> None:
    t = LatencyTiers()
    for kind, key, rtt in evs:
        if kind == "observe":
            t.observe(key, rtt)
        else:
            t.remove(key)
        tiers = t.tier_map
        # every upstream with a sample has exactly one tier; removed ones have none
        assert set(tiers) == {k for k in "abcdef" if t.average(k) is not None}
        gs = groups(t)
        assert sorted(k for g in gs for k in g) == sorted(tiers)
        assert all(gs), "no empty tiers"
        assert sorted(set(tiers.values())) == list(range(len(gs)))
        bases = [min(t.average(k) for k in g) for g in gs]
        # tier order follows latency
        assert bases == sorted(bases)
        # the overall best is tier 0
        if tiers:
            best = min(t.average(k) for k in tiers)
            assert bases[0] == best
        for g, base in zip(gs, bases, strict=True):
            for k in g:
                # nobody is beyond the hysteresis band of its own tier
                assert t.average(k) <= HYSTERESIS * tier_limit(base) * (1 + 1e-12)
        # the spec's rule, literally: every upstream within a tier's strict limit that
        # is not in a tier above is in that tier
        for i, base in enumerate(bases):
            for k, n in tiers.items():
                if n >= i and t.average(k) <= tier_limit(base):
                    assert n == i, (k, n, i)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, st.floats(0.0, 2.0), min_size=1))
def test_tiers_without_history_match_the_spec_rule(samples: dict[str, float]) -> None:
    """Fed fastest first (nobody moves, so no hysteresis is involved), the tiers are
    exactly the spec's greedy rule: tier 0 <= limit(best), tier 1 the same on the rest."""
    t = LatencyTiers()
    for key, rtt in sorted(samples.items(), key=lambda kv: (kv[1], kv[0])):
        t.observe(key, rtt)
    rest = dict(samples)
    expected: dict[str, int] = {}
    tier = 0
    while rest:
        limit = tier_limit(min(rest.values()))
        for k in [k for k, v in rest.items() if v <= limit]:
            expected[k] = tier
            del rest[k]
        tier += 1
    assert t.tier_map == expected
