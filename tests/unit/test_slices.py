"""EndpointSlice wire JSON -> endpoints: ports, readiness, address types, bad input."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extractedprism.config.endpoints import Endpoint
from extractedprism.discovery.slices import endpoints_from_slice, endpoints_from_slices, parse_slice
from tests.fakes.fake_apiserver import make_slice as fake_make_slice

pytestmark = pytest.mark.timeout(30)


# The parser's view of a slice: every address in one endpoint entry.
make_slice = functools.partial(fake_make_slice, grouped=True)


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
    caplog.set_level(logging.DEBUG, logger="extractedprism.discovery.slices")
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


# --- parse_slice: unusable slice (None) vs bad entry (skipped), each naming its field ---


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


UNUSABLE: list[tuple[str, Any, str]] = [
    ("ports null", make_slice() | {"ports": None}, "field=ports "),
    ("ports missing", {k: v for k, v in make_slice().items() if k != "ports"}, "field=ports "),
    ("ports empty", make_slice(ports=[]), "field=ports "),
    ("ports a string", make_slice() | {"ports": "https"}, "field=ports "),
    ("port without number", make_slice(ports=[{"name": "https", "protocol": "TCP"}]),
     "field=ports[0].port "),
    ("port null", make_slice(ports=[{"name": "https", "port": None}]), "field=ports[0].port "),
    ("port out of range", make_slice(ports=[{"name": "https", "port": 65536}]),
     "field=ports[0].port "),
    ("https port bad, another good",
     make_slice(ports=[{"name": "metrics", "port": 9000}, {"name": "https", "port": -1}]),
     "field=ports[1].port "),
    ("endpoints a string", make_slice(endpoints="10.0.0.1"), "field=endpoints "),
    ("address type FQDN-ish typo", make_slice(address_type="fqdn"), "field=addressType "),
    ("every endpoint malformed",
     make_slice(endpoints=[{"addresses": None}, {"addresses": ["300.1.1.1"]}]),
     "field=endpoints "),
]


@pytest.mark.parametrize("case,obj,field", UNUSABLE, ids=[c for c, _, _ in UNUSABLE])
def test_unusable_slice_is_none_and_the_log_names_slice_and_field(
        case: str, obj: Any, field: str, caplog: pytest.LogCaptureFixture) -> None:
    assert parse_slice(obj) is None
    lines = [m for m in warnings(caplog) if "unusable" in m]
    assert len(lines) == 1, warnings(caplog)
    assert "slice=kubernetes" in lines[0] and field in lines[0], lines[0]


@pytest.mark.parametrize("endpoints", [None, []])
@pytest.mark.parametrize("ports", [None, []])
def test_slice_without_endpoints_is_valid_and_silent(
        endpoints: Any, ports: Any, caplog: pytest.LogCaptureFixture) -> None:
    # The API server's endpoint reconciler writes "endpoints": null, "ports": null
    # when no API server is left: a real, empty slice, not an error.
    obj = make_slice(endpoints=endpoints) | {"ports": ports}
    assert parse_slice(obj) == []
    assert warnings(caplog) == []


def test_bad_entries_are_skipped_and_the_good_ones_of_the_slice_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    obj = make_slice(endpoints=[
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": None},
        "10.0.0.9",
        {"addresses": []},
        {"addresses": ["bogus!", "10.0.0.2"]},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": None}},
        {"addresses": ["10.0.0.4"]},
        {"addresses": ["10.0.0.5"], "conditions": {"ready": False}},
    ])
    assert sorted(str(e) for e in parse_slice(obj) or []) == [
        "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443", "10.0.0.4:6443"]
    fields = sorted(m.split("field=")[1].split()[0] for m in warnings(caplog))
    assert fields == ["endpoints[1].addresses", "endpoints[2]", "endpoints[3].addresses",
                      "endpoints[4].addresses[0]"]
    assert all("slice=kubernetes" in m for m in warnings(caplog))


@pytest.mark.parametrize("conditions", ["ready", ["ready"], {"ready": "false"}, {"ready": 0}])
def test_malformed_readiness_counts_as_ready_and_is_logged(
        conditions: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Only an explicit boolean false excludes (spec); anything else is noted.
    obj = make_slice(endpoints=[{"addresses": ["10.0.0.1"], "conditions": conditions}])
    assert parse_slice(obj) == [Endpoint("10.0.0.1", 6443)]
    assert len(warnings(caplog)) == 1 and "field=endpoints[0].conditions" in warnings(caplog)[0]


def test_ipv6_is_normalised_and_a_zone_or_ipv4_is_rejected() -> None:
    obj = make_slice(address_type="IPv6",
                     addresses=["FD00:0:0::1", "fe80::1%eth0", "10.0.0.1", "::ffff:10.0.0.1"])
    assert [str(e) for e in parse_slice(obj) or []] == ["[fd00::1]:6443",
                                                       "[::ffff:a00:1]:6443"]


def test_ipv4_slice_rejects_ipv6_and_leading_zeros() -> None:
    obj = make_slice(addresses=["10.0.0.1", "fd00::1", "010.0.0.2", "10.0.0.3/32"])
    assert parse_slice(obj) == [Endpoint("10.0.0.1", 6443)]


def test_fqdn_addresses_are_used_as_given_lowercased() -> None:
    obj = make_slice(address_type="FQDN",
                     addresses=["CP1.Example.com", "cp1.example.com", "-bad-.example.com",
                                "10.0.0.1"])
    # an IPv4 literal is a valid RFC 1123 name too; it is used as given, like the Go original
    assert sorted(str(e) for e in endpoints_from_slices([obj])) == [
        "10.0.0.1:6443", "cp1.example.com:6443"]


def test_several_ports_https_wins_else_the_first() -> None:
    two = [{"name": "metrics", "port": 9000}, {"name": "https", "port": 6443}]
    assert parse_slice(make_slice(ports=two)) == [Endpoint("10.0.0.1", 6443)]
    unnamed = [{"port": 443, "protocol": "TCP"}]
    assert parse_slice(make_slice(ports=unnamed)) == [Endpoint("10.0.0.1", 443)]


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
