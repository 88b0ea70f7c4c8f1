"""EndpointSlice wire JSON -> endpoints: ports, readiness, address types, bad input."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extractedprism.endpoints import Endpoint
from extractedprism.slices import endpoints_from_slice, endpoints_from_slices

pytestmark = pytest.mark.timeout(30)


def make_slice(name: str = "kubernetes", addresses: list[Any] | None = None, *,
               address_type: Any = "IPv4", ports: Any = None, ready: Any = None,
               endpoints: Any = "default") -> dict[str, Any]:
    if ports is None:
        ports = [{"name": "https", "port": 6443, "protocol": "TCP"}]
    if endpoints == "default":
        ep: dict[str, Any] = {"addresses": addresses or ["10.0.0.1"]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        endpoints = [ep]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "resourceVersion": "1",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }


def test_basic_slice() -> None:
    s = make_slice(addresses=["10.0.0.2", "10.0.0.1"])
    assert sorted(endpoints_from_slice(s)) == [Endpoint("10.0.0.1", 6443),
                                               Endpoint("10.0.0.2", 6443)]


def test_port_named_https_wins_over_first() -> None:
    s = make_slice(ports=[{"name": "metrics", "port": 9000}, {"name": "https", "port": 6443}])
    assert endpoints_from_slice(s) == [Endpoint("10.0.0.1", 6443)]


def test_first_port_when_none_named_https() -> None:
    s = make_slice(ports=[{"name": "a", "port": 7000}, {"name": "b", "port": 8000}])
    assert endpoints_from_slice(s) == [Endpoint("10.0.0.1", 7000)]


@pytest.mark.parametrize("ready,included", [(None, True), (True, True), (False, False)])
def test_ready_false_excluded_only_when_explicit(ready: Any, included: bool) -> None:
    s = make_slice(ready=ready)
    assert bool(endpoints_from_slice(s)) is included


def test_conditions_without_ready_is_included() -> None:
    s = make_slice(endpoints=[{"addresses": ["10.0.0.9"], "conditions": {"serving": True}}])
    assert endpoints_from_slice(s) == [Endpoint("10.0.0.9", 6443)]


def test_ipv6_and_fqdn() -> None:
    s6 = make_slice(address_type="IPv6", addresses=["fd00:0::1"])
    assert [str(e) for e in endpoints_from_slice(s6)] == ["[fd00::1]:6443"]
    sf = make_slice(address_type="FQDN", addresses=["cp1.example.com"])
    assert [str(e) for e in endpoints_from_slice(sf)] == ["cp1.example.com:6443"]


def test_merged_across_slices_deduped_and_sorted() -> None:
    a = make_slice("a", ["10.0.0.3", "10.0.0.1"])
    b = make_slice("b", ["10.0.0.1", "10.0.0.2"])
    assert [str(e) for e in endpoints_from_slices([a, b])] == [
        "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"]


BAD: list[tuple[str, Any]] = [
    ("unknown address type", make_slice(address_type="AppleTalk")),
    ("missing address type", {k: v for k, v in make_slice().items() if k != "addressType"}),
    ("non-numeric port", make_slice(ports=[{"name": "https", "port": "6443"}])),
    ("port zero", make_slice(ports=[{"name": "https", "port": 0}])),
    ("port too big", make_slice(ports=[{"name": "https", "port": 70000}])),
    ("port bool", make_slice(ports=[{"name": "https", "port": True}])),
    ("missing port", make_slice(ports=[{"name": "https"}])),
    ("no ports", make_slice(ports=[])),
    ("ports null", make_slice(ports=None) | {"ports": None}),
    ("ports not list", make_slice() | {"ports": {"port": 1}}),
    ("port entry not object", make_slice(ports=["https"])),
    ("endpoints not list", make_slice(endpoints={"addresses": []})),
    ("endpoint not object", make_slice(endpoints=["10.0.0.1"])),
    ("addresses missing", make_slice(endpoints=[{"conditions": {"ready": True}}])),
    ("addresses null", make_slice(endpoints=[{"addresses": None}])),
    ("address not ip", make_slice(addresses=["not-an-ip"])),
    ("address wrong family", make_slice(address_type="IPv6", addresses=["10.0.0.1"])),
    ("address not string", make_slice(addresses=[1234])),
    ("not an object", "garbage"),
    ("none", None),
    ("list", [1, 2]),
]


@pytest.mark.parametrize("case,obj", BAD, ids=[c for c, _ in BAD])
def test_malformed_skipped_with_log_naming_slice(case: str, obj: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="extractedprism.slices")
    assert endpoints_from_slice(obj) == []
    assert caplog.records, f"{case}: expected a log line"
    if isinstance(obj, dict):
        assert "slice=kubernetes" in caplog.text


def test_null_endpoints_is_an_empty_slice_not_an_error() -> None:
    assert endpoints_from_slice(make_slice(endpoints=None)) == []


def test_bad_address_skips_only_that_address() -> None:
    s = make_slice(addresses=["10.0.0.1", "bogus!", "10.0.0.2"])
    assert [str(e) for e in endpoints_from_slice(s)] == ["10.0.0.1:6443", "10.0.0.2:6443"]


def test_bad_slice_does_not_hide_good_one() -> None:
    good = make_slice("good", ["10.0.0.1"])
    bad = make_slice("bad", address_type="Bogus")
    assert endpoints_from_slices([bad, good, None]) == [Endpoint("10.0.0.1", 6443)]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(["addressType", "endpoints", "ports", "addresses",
                                       "conditions", "ready", "port", "name", "metadata"]),
                      children, max_size=4),
    max_leaves=12,
)


@given(obj=json_values)
def test_never_raises_on_arbitrary_json(obj: Any) -> None:
    result = endpoints_from_slices([obj])
    assert all(isinstance(e, Endpoint) for e in result)
