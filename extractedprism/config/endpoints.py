"""Endpoint value type and host:port parsing (pure).

An endpoint is what the spec calls a "host:port pair where the host is a valid IP
address or RFC 1123 hostname and port is a number in the range 1-65535". IPv6
literals are written in brackets (``[fd00::1]:6443``) so the string form is
unambiguous and round-trips through :func:`parse_endpoint`.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

# RFC 1123 label: letters, digits and hyphens, not starting or ending with a hyphen,
# at most 63 characters; the whole name at most 253 characters.
# \Z, not $: "$" also matches before a final newline, which no hostname has.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
# A URL's scheme: "https://10.0.0.1:6443" is a common paste from a kubeconfig.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_rfc1123_hostname(text: str) -> bool:
    if not text or len(text) > 253:
        return False
    name = text[:-1] if text.endswith(".") else text
    return bool(name) and all(_LABEL.match(label) for label in name.split("."))


def looks_numeric(name: str) -> bool:
    """True when the top label is all digits: "10.0.0.256", "1.2.3", "167772161".

    RFC 1123 2.1: a host name never has the dotted-decimal form, since its highest-level
    label is alphabetic. Such a name is a mistyped address, and the resolver
    (inet_aton) would read "1.2.3" or "167772161" as one anyway.
    """
    return name.rstrip(".").rsplit(".", 1)[-1].isdigit()


def is_valid_host(text: str) -> bool:
    """True for an IP address (v4 or v6, without brackets) or an RFC 1123 hostname."""
    return is_ip(text) or (is_rfc1123_hostname(text) and not looks_numeric(text))


def canonical_host(host: str) -> str:
    """One spelling per host, so one upstream is one upstream wherever it came from.

    Hostnames compare case-insensitively and without the root dot (DNS does), so
    ``CP1.example.com`` from --endpoints and ``cp1.example.com.`` from an EndpointSlice
    are one upstream, not two that split the picks and double the series. IPv6 gets
    its RFC 5952 form (lower case, "::" compression).
    """
    if ":" in host:
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            return host
    name = host.lower()
    return name[:-1] if name.endswith(".") and len(name) > 1 else name


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str
    port: int

    def __post_init__(self) -> None:
        host = canonical_host(self.host)
        if host != self.host:
            object.__setattr__(self, "host", host)

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @functools.cached_property
    def is_hostname(self) -> bool:
        # Cached: the dial path asks on every new connection.
        return not is_ip(self.host)


def parse_port(text: str) -> int:
    """Parse a TCP port in 1-65535; raises ValueError with a reason."""
    if not text.isdigit():
        raise ValueError(f"port {text!r} is not a number")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1-65535")
    return port


def parse_endpoint(text: str) -> Endpoint:
    """Parse ``host:port`` / ``[v6]:port``; raises ValueError naming what is wrong."""
    raw = text.strip()
    if not raw:
        raise ValueError("empty endpoint")
    scheme = _SCHEME.match(raw)
    if scheme:
        # Before the IPv6 rule, which "https://h:6443" would otherwise trip over.
        rest = raw[scheme.end():].split("/", 1)[0]
        hint = f", e.g. {rest}" if rest else ""
        raise ValueError(f"{raw!r}: a URL scheme ({scheme.group(1)}://) is not allowed: "
                         f"write host:port{hint}")
    if raw.startswith("["):
        close = raw.find("]")
        if close == -1 or not raw[close + 1 :].startswith(":"):
            raise ValueError(f"{raw!r} is not host:port (expected [ipv6]:port)")
        # Brackets are how IPv6 is written, but like Go's SplitHostPort any host may
        # be bracketed; it must still be an IP address or an RFC 1123 hostname.
        host, port_text = raw[1:close], raw[close + 2 :]
        if not is_valid_host(host):
            raise ValueError(f"{raw!r}: host {host!r} is not an IP address or RFC 1123 "
                             "hostname")
    else:
        host, sep, port_text = raw.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{raw!r} is not host:port")
        if ":" in host:
            raise ValueError(f"{raw!r}: an IPv6 address must be written in brackets, [addr]:port")
        if not is_valid_host(host):
            raise ValueError(f"{raw!r}: host {host!r} is not an IP address or RFC 1123 hostname")
    try:
        port = parse_port(port_text)
    except ValueError as exc:
        raise ValueError(f"{raw!r}: {exc}") from None
    return Endpoint(host, port)  # which spells the host canonically


def parse_endpoint_list(text: str) -> tuple[list[Endpoint], list[str]]:
    """Parse a comma-separated list; returns (endpoints, problems), deduplicated in order."""
    endpoints: list[Endpoint] = []
    problems: list[str] = []
    items = text.split(",")
    if not any(item.strip() for item in items):
        return endpoints, problems  # nothing at all: the caller says "must not be empty"
    for n, item in enumerate(items, 1):
        if not item.strip():
            # Each entry must be a host:port pair; a stray comma usually means a value
            # went missing from a template, which deserves a look rather than silence.
            problems.append(f"entry {n} is empty")
            continue
        try:
            ep = parse_endpoint(item)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if ep not in endpoints:
            endpoints.append(ep)
    return endpoints, problems
