"""Merged provider: dedupe across providers, static first, never empty, apply on change."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

from extractedprism.config.endpoints import Endpoint, parse_endpoint
from extractedprism.discovery.merge import Merger
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.roles import Roles
from tests.util import sample

pytestmark = pytest.mark.timeout(30)


def eps(*texts: str) -> list[Endpoint]:
    return [parse_endpoint(t) for t in texts]


Setup = tuple[Merger, list[list[Endpoint]], Metrics]


def _appender(applied: list[list[Endpoint]]) -> Callable[[list[Endpoint], Roles], None]:
    def apply(endpoints: list[Endpoint], roles: Roles) -> None:
        applied.append(endpoints)
    return apply


@pytest.fixture
def setup() -> Setup:
    applied: list[list[Endpoint]] = []
    metrics = Metrics()
    return Merger(_appender(applied), metrics), applied, metrics


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
    m, applied, metrics = setup
    m.update("static", eps("10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.1:6443"))
    m.update("kubernetes", eps("10.0.0.1:6443"))
    assert applied == [eps("10.0.0.1:6443")]
    name = "extractedprism_discovery_updates_total"
    assert sample(metrics, name, {"provider": "kubernetes"}) == 2
    assert sample(metrics, name, {"provider": "static"}) == 1


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
    m, applied, metrics = setup
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
    assert sample(metrics, "extractedprism_discovery_updates_total",
                          {"provider": "kubernetes"}) == 801
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
