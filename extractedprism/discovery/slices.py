"""EndpointSlice JSON -> API server endpoints (pure).

Owns the translation of ``discovery.k8s.io/v1`` EndpointSlice objects, in their wire
(JSON dict) form, into :class:`~extractedprism.config.endpoints.Endpoint` values. Called on the
watcher thread by :mod:`extractedprism.watch`, once for every new content of a slice
(the watcher remembers the result, so each problem is logged once, not on every event of
every other slice). Input comes from the network, so nothing here raises.

Two kinds of bad input, told apart because the watcher treats them differently:

* a bad *entry* (an endpoint that is not an object, an address that is not valid for
  the slice's ``addressType``): that entry is skipped with one log line naming the slice
  and the field (``endpoints[1].addresses[0]``); the good endpoints of the same slice
  are kept;
* an unusable *slice* (not an object, unknown ``addressType``, ``endpoints`` or
  ``ports`` of the wrong JSON type, no usable port, or every endpoint malformed):
  :func:`parse_slice` returns None, with one log line naming the slice and the field,
  and the watcher keeps what it last knew of that slice. The API server validates
  slices, so this is corruption or a bug somewhere, not a control-plane change, and
  must not drain live connections.

A slice whose ``endpoints`` is missing, null or empty is valid and has no endpoints (the
API server writes ``endpoints: null`` when no API server is left).

Choices an operator may want to know:

* port: the entry named ``https`` (the ``kubernetes`` service's port name); without
  one, the first entry, as long as it has a usable number. A port with no number means
  "all ports" in the API and gives nothing to dial.
* readiness: only an explicit ``conditions.ready: false`` excludes an endpoint (spec);
  missing conditions, ``ready: null`` or a non-boolean ``ready`` (logged) count as ready.
* ``addressType: FQDN``: the addresses are used as given, like the Go original and like
  a hostname in ``--endpoints``: each must be an RFC 1123 hostname; it is lowercased
  (DNS is case-insensitive, so ``CP1.example.com`` and ``cp1.example.com`` are one
  upstream) and resolved when dialled and probed.
* IPv4 / IPv6 addresses must parse as an address of that family, without a zone
  (``fe80::1%eth0``), which the API rejects too; IPv6 is normalised (``fd00:0::1`` ->
  ``fd00::1``) and written in brackets downstream (``[fd00::1]:6443``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from extractedprism.config.endpoints import Endpoint, canonical_host, is_rfc1123_hostname

log = logging.getLogger(__name__)

ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
PREFERRED_PORT_NAME = "https"
SERVICE_LABEL = "kubernetes.io/service-name"
SERVICE_NAME = "kubernetes"


def slice_name(obj: Any) -> str:
    """Best-effort ``metadata.name`` for log lines; never raises."""
    if isinstance(obj, Mapping):
        meta = obj.get("metadata")
        if isinstance(meta, Mapping):
            name = meta.get("name")
            if isinstance(name, str) and name:
                return name
    return "<unnamed>"


def service_label(obj: Any) -> Any:
    """The slice's ``kubernetes.io/service-name`` label (None when absent); never raises."""
    if isinstance(obj, Mapping):
        meta = obj.get("metadata")
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        if isinstance(labels, Mapping):
            return labels.get(SERVICE_LABEL)
    return None


def slice_content(obj: Any) -> Any:
    """What :func:`parse_slice` reads from a slice: equal contents parse the same."""
    if not isinstance(obj, Mapping):
        return obj
    return (obj.get("addressType"), obj.get("endpoints"), obj.get("ports"))


def _unusable(name: str, field: str, reason: str, value: Any = None) -> None:
    log.warning("endpointslice unusable slice=%s field=%s reason=%r value=%.80r",
                name, field, reason, value)


def _skipped(name: str, field: str, reason: str, value: Any) -> None:
    log.warning("endpointslice entry skipped slice=%s field=%s reason=%r value=%.80r",
                name, field, reason, value)


def _pick_port(obj: Mapping[str, Any], name: str) -> int | None:
    ports = obj.get("ports")
    if ports is None or ports == []:
        _unusable(name, "ports", "no ports (nothing to dial)", ports)
        return None
    if not isinstance(ports, list):
        _unusable(name, "ports", "not a list", ports)
        return None
    index = next((i for i, p in enumerate(ports)
                  if isinstance(p, Mapping) and p.get("name") == PREFERRED_PORT_NAME), 0)
    chosen = ports[index]
    field = f"ports[{index}]"
    if not isinstance(chosen, Mapping):
        _unusable(name, field, "not an object", chosen)
        return None
    port = chosen.get("port")
    if port is None:
        _unusable(name, f"{field}.port", "no port number (means all ports)", port)
        return None
    # bool is an int subclass; JSON true is not a port.
    if not isinstance(port, int) or isinstance(port, bool):
        _unusable(name, f"{field}.port", "not a number", port)
        return None
    if not 1 <= port <= 65535:
        _unusable(name, f"{field}.port", "outside 1-65535", port)
        return None
    return port


def _valid_address(address: Any, address_type: str) -> str | None:
    if not isinstance(address, str) or not address:
        return None
    if address_type in ("IPv4", "IPv6"):
        family = ipaddress.IPv4Address if address_type == "IPv4" else ipaddress.IPv6Address
        try:
            ip = family(address)
        except ValueError:
            return None
        # A zone index (fe80::1%eth0) names an interface of the API server's host,
        # meaningless here; the API rejects it as well.
        return None if getattr(ip, "scope_id", None) else str(ip)
    return canonical_host(address) if is_rfc1123_hostname(address) else None


def _ready(entry: Mapping[str, Any], name: str, field: str) -> bool:
    conditions = entry.get("conditions")
    if conditions is None:
        return True
    if not isinstance(conditions, Mapping):
        _skipped(name, f"{field}.conditions", "not an object; counted as ready", conditions)
        return True
    ready = conditions.get("ready")
    if ready is not None and not isinstance(ready, bool):
        _skipped(name, f"{field}.conditions.ready", "not a boolean; counted as ready", ready)
        return True
    return ready is not False


def parse_slice(obj: Any) -> list[Endpoint] | None:
    """Endpoints of one slice (unsorted, may repeat), or None when the slice is unusable.

    Every problem is logged once per call, naming the slice and the field; never raises.
    """
    name = slice_name(obj)
    if not isinstance(obj, Mapping):
        _unusable(name, "-", "not an object", obj)
        return None
    address_type = obj.get("addressType")
    if address_type not in ADDRESS_TYPES:
        _unusable(name, "addressType", "not IPv4, IPv6 or FQDN", address_type)
        return None
    endpoints = obj.get("endpoints")
    if endpoints is None or endpoints == []:
        return []
    if not isinstance(endpoints, list):
        _unusable(name, "endpoints", "not a list", endpoints)
        return None
    port = _pick_port(obj, name)
    if port is None:
        return None
    out: list[Endpoint] = []
    readable = 0
    for i, entry in enumerate(endpoints):
        field = f"endpoints[{i}]"
        if not isinstance(entry, Mapping):
            _skipped(name, field, "not an object", entry)
            continue
        addresses = entry.get("addresses")
        if not isinstance(addresses, list) or not addresses:
            _skipped(name, f"{field}.addresses", "no addresses list", addresses)
            continue
        hosts: list[str] = []
        for j, address in enumerate(addresses):
            host = _valid_address(address, address_type)
            if host is None:
                _skipped(name, f"{field}.addresses[{j}]",
                         f"not a valid {address_type} address", address)
            else:
                hosts.append(host)
        if not hosts:
            continue
        readable += 1
        if _ready(entry, name, field):
            out.extend(Endpoint(h, port) for h in hosts)
    if not readable:
        _unusable(name, "endpoints", "no endpoint could be read", len(endpoints))
        return None
    return out


def endpoints_from_slice(obj: Any) -> list[Endpoint]:
    """Endpoints of one slice (unsorted, may repeat); [] when unusable; never raises."""
    return parse_slice(obj) or []


def union(endpoint_lists: Iterable[Iterable[Endpoint]]) -> list[Endpoint]:
    """The endpoints of several slices, deduplicated and sorted (the provider's update)."""
    return sorted({e for endpoints in endpoint_lists for e in endpoints})


def endpoints_from_slices(objs: Iterable[Any]) -> list[Endpoint]:
    """Deduplicated, sorted endpoints of every slice; never raises."""
    return union(endpoints_from_slice(obj) for obj in objs)
