"""Merging providers: the pure merge from tables; the Merger dedupes across providers,
static first, never empty, applies on change."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

from extractedprism.config.endpoints import Endpoint, parse_endpoint
from extractedprism.discovery.merge import Merger, merge
from extractedprism.upstreams.roles import Roles

pytestmark = pytest.mark.timeout(30)


def eps(*texts: str) -> list[Endpoint]:
    return [parse_endpoint(t) for t in texts]


A, B, C = "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"


@pytest.mark.parametrize(("lists", "mode", "merged", "sources", "fallback"), [
    ({}, "always", [], {}, set()),
    ({"static": [A, B]}, "fallback", [A, B],
     {A: ("static",), B: ("static",)}, set()),
    # Static first whatever the order the providers reported in; first place kept.
    ({"kubernetes": [C, A], "static": [B, A]}, "always", [B, A, C],
     {B: ("static",), A: ("static", "kubernetes"), C: ("kubernetes",)}, set()),
    ({"cache": [C], "kubernetes": [A]}, "always", [C, A],
     {C: ("cache",), A: ("kubernetes",)}, set()),
    # Sources in provider order (static, kubernetes, cache), whatever the list order.
    ({"static": [A], "cache": [C, A], "kubernetes": [C]}, "always", [A, C],
     {A: ("static", "cache"), C: ("kubernetes", "cache")}, set()),
    # Fallback: static endpoints discovery does not list, once it lists any.
    ({"static": [A, B], "kubernetes": [A, C]}, "fallback", [A, B, C],
     {A: ("static", "kubernetes"), B: ("static",), C: ("kubernetes",)}, {B}),
    ({"static": [A, B], "kubernetes": []}, "fallback", [A, B],
     {A: ("static",), B: ("static",)}, set()),
    ({"static": [A, B], "kubernetes": [A, C]}, "always", [A, B, C],
     {A: ("static", "kubernetes"), B: ("static",), C: ("kubernetes",)}, set()),
    # The cache does not demote: only a list from discovery itself does.
    ({"static": [A, B], "cache": [C]}, "fallback", [A, B, C],
     {A: ("static",), B: ("static",), C: ("cache",)}, set()),
])
def test_merge_table(lists: dict[str, list[str]], mode: str, merged: list[str],
                     sources: dict[str, tuple[str, ...]], fallback: set[str]) -> None:
    got, roles = merge({p: eps(*texts) for p, texts in lists.items()}, static_mode=mode)
    assert [str(e) for e in got] == merged
    assert dict(roles.sources) == sources
    assert roles.fallback == frozenset(fallback)


# The merger, the lists it applied, and the provider of every update it was told of.
Setup = tuple[Merger, list[list[Endpoint]], list[str]]


def _appender(applied: list[list[Endpoint]]) -> Callable[[list[Endpoint], Roles], None]:
    def apply(endpoints: list[Endpoint], roles: Roles) -> None:
        applied.append(endpoints)
    return apply


@pytest.fixture
def setup() -> Setup:
    applied: list[list[Endpoint]] = []
    updates: list[str] = []
    return Merger(_appender(applied), updates.append), applied, updates


def test_static_then_kubernetes_deduped(setup: Setup) -> None:
    m, applied, _ = setup
    m.update("static", eps("10.0.0.2:6443", "10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.1:6443", "10.0.0.3:6443"))
    assert applied == [eps("10.0.0.2:6443", "10.0.0.1:6443"),
                       eps("10.0.0.2:6443", "10.0.0.1:6443", "10.0.0.3:6443")]


def test_static_first_even_if_kubernetes_arrives_first(setup: Setup) -> None:
    m, applied, _ = setup
    m.update("kubernetes", eps("10.0.0.3:6443"))
    m.update("static", eps("10.0.0.1:6443"))
    assert applied[-1] == eps("10.0.0.1:6443", "10.0.0.3:6443")


def test_unchanged_merge_not_applied_but_counted(setup: Setup) -> None:
    m, applied, updates = setup
    m.update("static", eps("10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.1:6443"))
    assert applied == [eps("10.0.0.1:6443")]
    assert updates == ["static", "kubernetes", "kubernetes"]


def test_empty_merge_is_skipped(setup: Setup) -> None:
    m, applied, _ = setup
    m.update("kubernetes", [])
    assert applied == []
    m.update("kubernetes", eps("10.0.0.3:6443"))
    m.update("kubernetes", [])  # would be empty: keep routing to the last list
    assert applied == [eps("10.0.0.3:6443")]
    assert applied[-1] == eps("10.0.0.3:6443")  # still what the registry has


def test_removing_every_discovered_endpoint_leaves_static(setup: Setup) -> None:
    m, applied, _ = setup
    m.update("static", eps("10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.5:6443"))
    m.update("kubernetes", [])
    assert applied[-1] == eps("10.0.0.1:6443")


def test_thread_safe_updates_end_consistent(setup: Setup) -> None:
    m, applied, updates = setup
    m.update("static", eps("10.0.0.1:6443"))

    def worker() -> None:
        for i in range(200):
            m.update("kubernetes", eps(f"10.0.1.{i % 7 + 1}:6443"))

    threads = [threading.Thread(target=worker, name=f"merge-worker-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    m.update("kubernetes", eps("10.0.2.1:6443"))
    assert applied[-1] == eps("10.0.0.1:6443", "10.0.2.1:6443")
    assert updates.count("kubernetes") == 801
    for a, b in itertools.pairwise(applied):
        assert a != b


def test_hostnames_dedupe_case_insensitively_and_without_the_root_dot(setup: Setup) -> None:
    # --endpoints CP1.example.com:6443 and an EndpointSlice FQDN cp1.example.com. are one
    # upstream: not two with a doubled share of the picks and duplicated series.
    from extractedprism.discovery.slices import endpoints_from_slices
    from tests.fakes.fake_apiserver import make_slice

    m, applied, _ = setup
    m.update("static", eps("CP1.example.com:6443", "10.0.0.2:6443"))
    discovered = endpoints_from_slices([make_slice(
        "kubernetes", ["cp1.example.com.", "Cp1.Example.Com"], address_type="FQDN")])
    m.update("kubernetes", discovered)
    assert [str(e) for e in applied[-1]] == ["cp1.example.com:6443", "10.0.0.2:6443"]
    assert len(applied) == 1  # the discovered list changed nothing


@pytest.mark.parametrize("a,b", [
    ("CP1.example.com:6443", "cp1.example.com:6443"),
    ("cp1.example.com.:6443", "cp1.example.com:6443"),
    ("[FD00:0::1]:6443", "[fd00::1]:6443"),
])
def test_one_spelling_per_endpoint(a: str, b: str) -> None:
    assert parse_endpoint(a) == parse_endpoint(b)
    assert Endpoint(parse_endpoint(a).host.upper(), 6443) == parse_endpoint(b)
    assert str(parse_endpoint(a)) == b
