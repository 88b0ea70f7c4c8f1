"""The one table of --endpoints values: what the program rejects (with its exact message) and
what it accepts (with the upstreams it makes of them).

Used by the program's tests (tests/unit/test_endpoint_cases.py: validate() on each value)
and by the chart's render test (tests/deploy/test_chart_endpoints.py: the chart fails its
render with the same message, in the comma-separated string form and the list form, and
renders what the program accepts). A case added here is checked on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUIRED = "--endpoints is required: give a comma-separated list of API server host:port pairs"
# What the chart adds to the required message: how to give the value to helm.
CHART_REQUIRED_HINT = (" (values: endpoints is required, e.g. --set "
                       "'endpoints={10.0.0.1:6443,10.0.0.2:6443,10.0.0.3:6443}')")


@dataclass(frozen=True)
class Case:
    """``value`` as EP_ENDPOINTS / --endpoints carries it (the chart's string form; the
    list form is ``value.split(",")``); ``problem``: the program's one line about it, or
    None when it is accepted; ``upstreams``: then the endpoints it makes, in order."""

    id: str
    value: str
    problem: str | None = None
    upstreams: tuple[str, ...] = ()


def _bad(id: str, value: str, *reasons: str) -> Case:
    return Case(id, value, f"--endpoints ({value}) is invalid: {'; '.join(reasons)}")


LABEL_63 = "a" * 63
NAME_253 = ".".join([LABEL_63, LABEL_63, LABEL_63, "a" * 61])  # 63*3 + 61 + 3 dots = 253

INVALID: tuple[Case, ...] = (
    Case("empty", "", REQUIRED),
    Case("blank", "   ", REQUIRED),
    Case("only-a-comma", ",", "--endpoints (,) must not be empty"),
    Case("only-commas-and-blanks", " , ", "--endpoints ( , ) must not be empty"),
    _bad("trailing-comma", "10.0.0.1:6443,", "entry 2 is empty"),
    _bad("leading-comma", ",10.0.0.1:6443", "entry 1 is empty"),
    _bad("double-comma", "10.0.0.1:6443,,10.0.0.2:6443", "entry 2 is empty"),
    _bad("no-port", "10.0.0.1", "'10.0.0.1' is not host:port"),
    _bad("one-of-two-without-port", "10.0.0.1,10.0.0.2:6443", "'10.0.0.1' is not host:port"),
    _bad("hostname-no-port", "cp1.example.com", "'cp1.example.com' is not host:port"),
    _bad("no-host", ":6443", "':6443' is not host:port"),
    _bad("port-0", "10.0.0.1:0", "'10.0.0.1:0': port 0 is outside 1-65535"),
    _bad("port-65536", "10.0.0.1:65536", "'10.0.0.1:65536': port 65536 is outside 1-65535"),
    _bad("port-99999", "10.0.0.1:99999", "'10.0.0.1:99999': port 99999 is outside 1-65535"),
    _bad("port-long-with-zeros", "10.0.0.1:0000000000000070000",
         "'10.0.0.1:0000000000000070000': port 70000 is outside 1-65535"),
    _bad("port-huge", "10.0.0.1:123456789012345678901234567890",
         "'10.0.0.1:123456789012345678901234567890': port 123456789012345678901234567890 "
         "is outside 1-65535"),
    _bad("port-name", "10.0.0.1:http", "'10.0.0.1:http': port 'http' is not a number"),
    _bad("port-empty", "10.0.0.1:", "'10.0.0.1:': port '' is not a number"),
    _bad("port-negative", "10.0.0.1:-1", "'10.0.0.1:-1': port '-1' is not a number"),
    _bad("port-with-space", "10.0.0.1: 6443", "'10.0.0.1: 6443': port ' 6443' is not a number"),
    _bad("underscore-host", "bad_host:6443",
         "'bad_host:6443': host 'bad_host' is not an IP address or RFC 1123 hostname"),
    _bad("ipv6-without-brackets", "fd00::1:6443",
         "'fd00::1:6443': an IPv6 address must be written in brackets, [addr]:port"),
    _bad("https-scheme", "https://10.0.0.1:6443",
         "'https://10.0.0.1:6443': a URL scheme (https://) is not allowed: write host:port, "
         "e.g. 10.0.0.1:6443"),
    _bad("scheme-and-path", "https://cp1.example.com:6443/readyz",
         "'https://cp1.example.com:6443/readyz': a URL scheme (https://) is not allowed: "
         "write host:port, e.g. cp1.example.com:6443"),
    _bad("tcp-scheme-only", "tcp://", "'tcp://': a URL scheme (tcp://) is not allowed: "
         "write host:port"),
    _bad("brackets-no-port", "[fd00::1]", "'[fd00::1]' is not host:port (expected [ipv6]:port)"),
    _bad("brackets-no-colon", "[fd00::1]6443",
         "'[fd00::1]6443' is not host:port (expected [ipv6]:port)"),
    _bad("bracket-not-closed", "[fd00::1:6443",
         "'[fd00::1:6443' is not host:port (expected [ipv6]:port)"),
    _bad("brackets-bad-host", "[not_valid]:6443",
         "'[not_valid]:6443': host 'not_valid' is not an IP address or RFC 1123 hostname"),
    _bad("brackets-empty", "[]:6443",
         "'[]:6443': host '' is not an IP address or RFC 1123 hostname"),
    _bad("brackets-bad-port", "[fd00::1]:0", "'[fd00::1]:0': port 0 is outside 1-65535"),
    _bad("ipv6-two-double-colons", "[fd00::1::2]:6443",
         "'[fd00::1::2]:6443': host 'fd00::1::2' is not an IP address or RFC 1123 hostname"),
    _bad("ipv6-long-hextet", "[fd00::12345]:6443",
         "'[fd00::12345]:6443': host 'fd00::12345' is not an IP address or RFC 1123 hostname"),
    _bad("ipv6-nine-hextets", "[1:2:3:4:5:6:7:8:9]:6443",
         "'[1:2:3:4:5:6:7:8:9]:6443': host '1:2:3:4:5:6:7:8:9' is not an IP address or "
         "RFC 1123 hostname"),
    _bad("ipv6-seven-hextets", "[1:2:3:4:5:6:7]:6443",
         "'[1:2:3:4:5:6:7]:6443': host '1:2:3:4:5:6:7' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("ipv6-double-colon-for-nothing", "[1:2:3:4::5:6:7:8]:6443",
         "'[1:2:3:4::5:6:7:8]:6443': host '1:2:3:4::5:6:7:8' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("ipv6-single-leading-colon", "[:1:2:3:4:5:6:7]:6443",
         "'[:1:2:3:4:5:6:7]:6443': host ':1:2:3:4:5:6:7' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("ipv6-empty-scope", "[fe80::1%]:6443",
         "'[fe80::1%]:6443': host 'fe80::1%' is not an IP address or RFC 1123 hostname"),
    _bad("ipv6-bad-ipv4-tail", "[::ffff:10.0.0.256]:6443",
         "'[::ffff:10.0.0.256]:6443': host '::ffff:10.0.0.256' is not an IP address or "
         "RFC 1123 hostname"),
    _bad("ipv6-not-hex", "[fd00::g]:6443",
         "'[fd00::g]:6443': host 'fd00::g' is not an IP address or RFC 1123 hostname"),
    _bad("octet-above-255", "10.0.0.256:6443",
         "'10.0.0.256:6443': host '10.0.0.256' is not an IP address or RFC 1123 hostname"),
    _bad("three-octets", "1.2.3:6443",
         "'1.2.3:6443': host '1.2.3' is not an IP address or RFC 1123 hostname"),
    _bad("address-as-integer", "167772161:6443",
         "'167772161:6443': host '167772161' is not an IP address or RFC 1123 hostname"),
    _bad("address-with-root-dot", "1.2.3.4.:6443",
         "'1.2.3.4.:6443': host '1.2.3.4.' is not an IP address or RFC 1123 hostname"),
    _bad("octet-leading-zero", "010.0.0.1:6443",
         "'010.0.0.1:6443': host '010.0.0.1' is not an IP address or RFC 1123 hostname"),
    _bad("label-leading-hyphen", "-cp1.example.com:6443",
         "'-cp1.example.com:6443': host '-cp1.example.com' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("label-trailing-hyphen", "cp1-.example.com:6443",
         "'cp1-.example.com:6443': host 'cp1-.example.com' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("empty-label", "cp1..example.com:6443",
         "'cp1..example.com:6443': host 'cp1..example.com' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("two-root-dots", "cp1.example.com..:6443",
         "'cp1.example.com..:6443': host 'cp1.example.com..' is not an IP address or RFC 1123 "
         "hostname"),
    _bad("label-64", f"{'a' * 64}.example.com:6443",
         f"'{'a' * 64}.example.com:6443': host '{'a' * 64}.example.com' is not an IP address "
         "or RFC 1123 hostname"),
    _bad("name-254", f"{NAME_253}a:6443",
         f"'{NAME_253}a:6443': host '{NAME_253}a' is not an IP address or RFC 1123 hostname"),
    _bad("space-inside-host", "cp 1:6443",
         "'cp 1:6443': host 'cp 1' is not an IP address or RFC 1123 hostname"),
    _bad("tab-inside-host", "cp\t1:6443",
         "'cp\\t1:6443': host 'cp\\t1' is not an IP address or RFC 1123 hostname"),
    _bad("quote-in-host", "it's:6443",
         "\"it's:6443\": host \"it's\" is not an IP address or RFC 1123 hostname"),
    _bad("backslash-in-host", "a\\b:6443",
         "'a\\\\b:6443': host 'a\\\\b' is not an IP address or RFC 1123 hostname"),
    _bad("several-problems", "10.0.0.1,bad_host:6443,,10.0.0.2:0,10.0.0.3:6443",
         "'10.0.0.1' is not host:port",
         "'bad_host:6443': host 'bad_host' is not an IP address or RFC 1123 hostname",
         "entry 3 is empty", "'10.0.0.2:0': port 0 is outside 1-65535"),
)

VALID: tuple[Case, ...] = (
    Case("one", "10.0.0.1:6443", upstreams=("10.0.0.1:6443",)),
    Case("three", "10.0.0.1:6443,10.0.0.2:6443,10.0.0.3:6443",
         upstreams=("10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443")),
    Case("spaces-around-entries", " 10.0.0.1:6443 , 10.0.0.2:443 ",
         upstreams=("10.0.0.1:6443", "10.0.0.2:443")),
    Case("port-bounds", "10.0.0.1:1,10.0.0.2:65535", upstreams=("10.0.0.1:1", "10.0.0.2:65535")),
    Case("port-leading-zeros", "10.0.0.1:06443", upstreams=("10.0.0.1:6443",)),
    Case("hostnames", "cp-1.example.com:6443,10-0-0-1.nip.io:6443,k8s.1a:6443,localhost:6443",
         upstreams=("cp-1.example.com:6443", "10-0-0-1.nip.io:6443", "k8s.1a:6443",
                    "localhost:6443")),
    Case("hostname-case-and-root-dot", "CP1.Example.COM.:6443",
         upstreams=("cp1.example.com:6443",)),
    Case("label-63-and-name-253", f"{LABEL_63}.example.com:6443,{NAME_253}:6443",
         upstreams=(f"{LABEL_63}.example.com:6443", f"{NAME_253}:6443")),
    Case("ipv6", "[fd00::1]:6443,[::1]:7445,[::]:6443",
         upstreams=("[fd00::1]:6443", "[::1]:7445", "[::]:6443")),
    Case("ipv6-canonical", "[FD00:0:0::1]:6443,[0:0:0:0:0:0:0:1]:6443",
         upstreams=("[fd00::1]:6443", "[::1]:6443")),
    Case("ipv6-full-and-edges", "[1:2:3:4:5:6:7:8]:1,[1:2:3:4:5:6:7::]:2,[::2:3:4:5:6:7:8]:3",
         upstreams=("[1:2:3:4:5:6:7:8]:1", "[1:2:3:4:5:6:7:0]:2", "[0:2:3:4:5:6:7:8]:3")),
    # Not ::ffff:a.b.c.d: how Python prints an IPv4-mapped address changed in 3.13.
    Case("ipv6-ipv4-tail", "[64:ff9b::192.0.2.1]:6443,[::10.0.0.1]:6443",
         upstreams=("[64:ff9b::c000:201]:6443", "[::a00:1]:6443")),
    Case("ipv6-scope", "[fe80::1%eth0]:6443", upstreams=("[fe80::1%eth0]:6443",)),
    Case("bracketed-ipv4-and-name", "[127.0.0.1]:6443,[cp1.example.com]:6443",
         upstreams=("127.0.0.1:6443", "cp1.example.com:6443")),
    Case("duplicates-are-one-upstream", "10.0.0.1:6443,10.0.0.1:6443,10.0.0.2:6443",
         upstreams=("10.0.0.1:6443", "10.0.0.2:6443")),
    Case("duplicates-by-spelling", "[fd00::1]:6443,[FD00:0::1]:6443,cp1.example.com:6443,"
         "CP1.example.com.:6443", upstreams=("[fd00::1]:6443", "cp1.example.com:6443")),
)

CASES: tuple[Case, ...] = INVALID + VALID
