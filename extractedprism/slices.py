"""EndpointSlice JSON -> API server endpoints (pure).

Owns the translation of ``discovery.k8s.io/v1`` EndpointSlice objects, in their wire
(JSON dict) form, into :class:`~extractedprism.endpoints.Endpoint` values. Called on the
watcher thread by :mod:`extractedprism.watch` for every cached slice whenever the cache
changes. Input comes from the network, so nothing here raises: every malformed piece
(a missing field, a null list, a non-numeric or out-of-range port, an unknown address
type, an address that is not a valid host) is skipped with one log line naming the slice.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from extractedprism.endpoints import Endpoint, is_rfc1123_hostname

log = logging.getLogger(__name__)

ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
PREFERRED_PORT_NAME = "https"


def slice_name(obj: Any) -> str:
    """Best-effort ``metadata.name`` for log lines; never raises."""
    if isinstance(obj, Mapping):
        meta = obj.get("metadata")
        if isinstance(meta, Mapping):
            name = meta.get("name")
            if isinstance(name, str) and name:
                return name
    return "<unnamed>"


def _pick_port(obj: Mapping[str, Any], name: str) -> int | None:
    ports = obj.get("ports")
    if not isinstance(ports, list) or not ports:
        log.warning("endpointslice skipped slice=%s reason=%r", name, "no ports")
        return None
    chosen: Any = None
    for entry in ports:
        if isinstance(entry, Mapping) and entry.get("name") == PREFERRED_PORT_NAME:
            chosen = entry
            break
    if chosen is None:
        chosen = ports[0]
    if not isinstance(chosen, Mapping):
        log.warning("endpointslice skipped slice=%s reason=%r", name, "malformed port entry")
        return None
    port = chosen.get("port")
    # bool is an int subclass; JSON true is not a port.
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        log.warning("endpointslice skipped slice=%s reason=%r port=%r", name, "bad port", port)
        return None
    return port


def _valid_address(address: Any, address_type: str) -> str | None:
    if not isinstance(address, str) or not address:
        return None
    if address_type == "IPv4":
        try:
            return str(ipaddress.IPv4Address(address))
        except ValueError:
            return None
    if address_type == "IPv6":
        try:
            return str(ipaddress.IPv6Address(address))
        except ValueError:
            return None
    return address if is_rfc1123_hostname(address) else None


def endpoints_from_slice(obj: Any) -> list[Endpoint]:
    """Endpoints of one slice (unsorted, may contain duplicates); never raises."""
    name = slice_name(obj)
    if not isinstance(obj, Mapping):
        log.warning("endpointslice skipped slice=%s reason=%r", name, "not an object")
        return []
    address_type = obj.get("addressType")
    if address_type not in ADDRESS_TYPES:
        log.warning(
            "endpointslice skipped slice=%s reason=%r address_type=%r",
            name,
            "unsupported address type",
            address_type,
        )
        return []
    endpoints = obj.get("endpoints")
    if endpoints is None:
        # A slice with no endpoints (e.g. every API server gone) is valid and empty.
        return []
    if not isinstance(endpoints, list):
        log.warning("endpointslice skipped slice=%s reason=%r", name, "endpoints is not a list")
        return []
    if not endpoints:
        return []
    port = _pick_port(obj, name)
    if port is None:
        return []
    out: list[Endpoint] = []
    for entry in endpoints:
        if not isinstance(entry, Mapping):
            log.warning("endpoint skipped slice=%s reason=%r", name, "not an object")
            continue
        conditions = entry.get("conditions")
        if isinstance(conditions, Mapping) and conditions.get("ready") is False:
            continue
        addresses = entry.get("addresses")
        if not isinstance(addresses, list):
            log.warning("endpoint skipped slice=%s reason=%r", name, "no addresses list")
            continue
        for address in addresses:
            host = _valid_address(address, address_type)
            if host is None:
                log.warning(
                    "endpoint address skipped slice=%s reason=%r address=%r",
                    name,
                    "invalid address",
                    address,
                )
                continue
            out.append(Endpoint(host, port))
    return out


def endpoints_from_slices(objs: Iterable[Any]) -> list[Endpoint]:
    """Deduplicated, sorted endpoints of every slice; never raises."""
    seen: set[Endpoint] = set()
    for obj in objs:
        seen.update(endpoints_from_slice(obj))
    return sorted(seen)
