"""``extractedprism status``: where this node's API traffic goes, as a table.

Runs in its own short-lived process (``kubectl exec ... extractedprism status`` in the
distroless image). It reads the local health server, found from the same flags and
``EP_`` variables as the server (``--health-bind-address``, falling back to
``--bind-address`` as the server does, and ``--health-port``; no ``--endpoints``
needed), and prints one line per upstream and one summary line. ``--json`` prints the
``/upstreams`` document as it came; ``--watch [INTERVAL]`` redraws until Ctrl-C.

Exit status: 0 when the proxy is ready (``/readyz`` answers 200), 1 when it answers but
is not ready, 2 when it cannot be reached (or the arguments are wrong).

The table renders what the document holds and shows ``-`` for what it lacks, so an
older or newer server still gives a readable table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from extractedprism.config.flags import format_duration, parse_duration
from extractedprism.config.table import FLAG_BY_NAME
from extractedprism.errors import Error

READY, NOT_READY, UNREACHABLE = 0, 1, 2
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # an /upstreams document is a few KiB per upstream
COLUMNS = ("ADDRESS", "SOURCE", "STATE", "READY", "TIER", "RTT", "CONNS", "SHARE", "STALLS",
           "SINCE", "ADMIN", "LAST ERROR")
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class Unreachable(Error):
    """The health server did not answer usefully; the message says why."""


def _setting(name: str, given: str | None, environ: Mapping[str, str]) -> str | None:
    """A flag's value: the command line, else its EP_ variable (empty counts as unset)."""
    if given is not None and given.strip():
        return given.strip()
    env = environ.get(FLAG_BY_NAME[name].env, "").strip()
    return env or None


def health_address(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, int]:
    """Where the server's health port is, resolved as the server resolves it."""
    host = (_setting("health-bind-address", args.health_bind_address, environ)
            or _setting("bind-address", args.bind_address, environ)
            or str(FLAG_BY_NAME["bind-address"].default))
    port_text = (_setting("health-port", args.health_port, environ)
                 or str(FLAG_BY_NAME["health-port"].default))
    try:
        port = int(port_text)
    except ValueError:
        raise SystemExit(f"extractedprism status: --health-port ({port_text}) is not a "
                         "whole number") from None
    if not 1 <= port <= 65535:
        raise SystemExit(f"extractedprism status: --health-port ({port}) must be in the "
                         "range 1-65535")
    host = _WILDCARDS.get(host, host)  # a wildcard listener answers on loopback
    return host.strip("[]"), port


def _get(address: tuple[str, int], path: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one GET to the health server. HTTP/1.0 over a plain socket
    rather than http.client: this command is run in loops by scripts, and http.client
    (with the email parser and ssl it imports) would be a third of its start-up; the
    server is our own, and answers with a Content-Length and closes."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {_hostport(address)}\r\n"
                     "Accept: application/json\r\nConnection: close\r\n\r\n".encode())
        data = bytearray()
        while len(data) <= MAX_ANSWER_BYTES:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and len(body) >= _content_length(bytes(head), MAX_ANSWER_BYTES):
                break
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split(None, 2)
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/") \
            or not parts[1].isdigit():
        raise ValueError("not an HTTP answer")
    return int(parts[1]), body[:_content_length(head, len(body))]


def _content_length(head: bytes, otherwise: int) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return otherwise


def fetch(address: tuple[str, int], timeout: float) -> tuple[dict[str, Any], bool, bytes]:
    """(the /upstreams document, whether /readyz said 200, the document's raw bytes)."""
    url = f"http://{_hostport(address)}"
    try:
        status, body = _get(address, "/upstreams", timeout)
        ready_status, _ = _get(address, "/readyz", timeout)
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise Unreachable(f"cannot reach the health server at {url} ({why.lower()})") \
            from None
    if status != 200:
        raise Unreachable(f"{url}/upstreams answered {status}, not 200")
    try:
        doc = json.loads(body)
    except ValueError:
        raise Unreachable(f"{url}/upstreams did not answer JSON") from None
    if not isinstance(doc, dict):
        raise Unreachable(f"{url}/upstreams did not answer a JSON object")
    return doc, ready_status == 200, body


def _hostport(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- rendering -------------------------------------------------------------------------


def _dash(value: object) -> str:
    if value is None or value == "" or value == []:
        return "-"
    return str(value)


def _yes_no(value: object) -> str:
    if value is None:
        return "-"
    return "yes" if value else "no"


def parse_time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        stamp = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.UTC)


def age(text: object, now: datetime.datetime) -> str:
    """``2026-12-01T18:25:55.148+00:00`` -> ``4m12s`` (how long ago), or ``-``."""
    stamp = parse_time(text)
    if stamp is None:
        return _dash(text) if not isinstance(text, str) else "-"
    secs = max(0, int((now - stamp).total_seconds()))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    if secs < 86400:
        return f"{secs // 3600}h{secs % 3600 // 60:02d}m"
    return f"{secs // 86400}d{secs % 86400 // 3600:02d}h"


def state_word(u: Mapping[str, Any]) -> str:
    if u.get("state"):
        return str(u["state"])
    if "healthy" not in u:
        return "-"
    if u.get("draining"):
        return "draining"
    return "healthy" if u["healthy"] else "unhealthy"


def _rtt(value: object) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    ms = value * 1000
    return f"{ms:.1f}ms" if ms < 100 else f"{ms:.0f}ms"


def conns_text(u: Mapping[str, Any]) -> str:
    active = u.get("active", u.get("active_connections"))
    total = u.get("total", u.get("total_connections"))
    if active is None and total is None:
        return "-"
    return f"{_dash(active)}/{_dash(total)}"


def share_text(u: Mapping[str, Any]) -> str:
    """Its part of the live connections, with its fair share (a count) when rebalancing
    or slow start computes one, and slow start's weight while it ramps:
    ``25% (fair 2.7) w0.40``; ``-`` from a server without the field."""
    share = u.get("connection_share")
    if not isinstance(share, (int, float)) or isinstance(share, bool):
        return "-"
    text = f"{share * 100:.0f}%"
    fair = u.get("fair_share")
    if isinstance(fair, (int, float)) and not isinstance(fair, bool):
        text += f" (fair {fair:.1f})"
    weight = u.get("weight")
    if isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight < 1:
        text += f" w{weight:.2f}"
    return text


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stalls_text(u: Mapping[str, Any]) -> str:
    """The stall check's column: stalls seen, those stalled now, and how many of the
    checks they asked for failed: ``3 (1 now) checks 1/2 failed``; ``-`` when the stall
    check is off or the server has no such field."""
    stalls = _count(u.get("stalls"))
    if stalls is None:
        return "-"
    text = str(stalls)
    now = _count(u.get("stalled_connections"))
    if now:
        text += f" ({now} now)"
    checks = u.get("stall_checks")
    if isinstance(checks, dict):
        failed, passed = _count(checks.get("failed")) or 0, _count(checks.get("passed")) or 0
        if failed + passed:
            text += f" checks {failed}/{failed + passed} failed"
    return text


def rebalance_text(doc: Mapping[str, Any], now: datetime.datetime) -> str | None:
    """``rebalance: last close 4m12s ago, last round: no skew`` (None when off or absent)."""
    r = doc.get("rebalance")
    if not isinstance(r, dict) or not r.get("enabled"):
        return None
    acted = r.get("last_acted_at")
    text = f"rebalance: {r.get('closes', 0)} closes"
    if parse_time(acted) is not None:
        text += f", last {age(acted, now)} ago"
    result = r.get("last_result")
    if result:
        detail = r.get("last_detail")
        text += f", last round: {result}" + (f" ({detail})" if detail and result != "acted"
                                             else "")
    return text


def _last_error(u: Mapping[str, Any]) -> str:
    error = u.get("last_check_error") or u.get("last_error")
    if not error:
        return "-"
    source = u.get("last_error_source")
    return f"{error} ({source})" if source else str(error)


def _source(u: Mapping[str, Any]) -> str:
    src = u.get("source")
    if isinstance(src, list):
        return ",".join(str(s) for s in src) or "-"
    return _dash(src)


def _admin(u: Mapping[str, Any]) -> str:
    """An operator's admin action on the upstream: ``drain(uid=0)``, or ``-``."""
    admin = u.get("admin")
    if not isinstance(admin, dict) or not admin.get("action"):
        return "-"
    uid = admin.get("uid")
    return f"{admin['action']}(uid={uid})" if uid is not None else str(admin["action"])


def row(u: Mapping[str, Any], now: datetime.datetime) -> list[str]:
    ready = u.get("ready")
    if ready is None and u.get("readiness") not in (None, "n/a"):
        ready = u.get("readiness") == "ready"
    return [_dash(u.get("address")), _source(u), state_word(u), _yes_no(ready),
            _dash(u.get("tier")), _rtt(u.get("rtt_seconds")), conns_text(u), share_text(u),
            stalls_text(u), age(u.get("since"), now), _admin(u), _last_error(u)]


def _healthy(u: Mapping[str, Any]) -> bool:
    """Its health check passes (whatever its readiness or drain); from the state word
    when the document has no ``healthy`` field."""
    if isinstance(u.get("healthy"), bool):
        return bool(u["healthy"])
    return state_word(u) in ("healthy", "closing-unready")


def summary(doc: Mapping[str, Any], ready: bool,
            now: datetime.datetime | None = None) -> str:
    ups = [u for u in doc.get("upstreams") or [] if isinstance(u, dict)]
    # Health, readiness and draining are counted apart: a drained upstream is still
    # healthy and ready (it only takes no new connections), and counting it out of
    # "healthy" but into "ready" read as "1/3 healthy, 2/3 ready".
    healthy = sum(1 for u in ups if _healthy(u))
    parts = [f"{'ready' if ready else 'NOT READY'}: {healthy}/{len(ups)} upstreams healthy"]
    readies = [u.get("ready") for u in ups if u.get("ready") is not None]
    if readies:
        parts.append(f"{sum(1 for r in readies if r)}/{len(ups)} ready")
    drained = sum(1 for u in ups if state_word(u) in ("draining", "admin-drain"))
    if drained:
        parts.append(f"{drained} drained (no new connections)")
    active = doc.get("connections_active")
    if active is not None:
        limit = doc.get("max_connections")
        parts.append(f"{active} connections" + (f" (max {limit})" if limit else ""))
    if doc.get("panic"):
        parts.append("PANIC: no upstream healthy, new connections try every upstream")
    disc = doc.get("discovery")
    if isinstance(disc, dict):
        if disc.get("enabled") is False:
            parts.append("discovery off")
        elif "connected" in disc:
            parts.append("discovery " + ("connected" if disc["connected"] else
                                         "DISCONNECTED"))
            if disc.get("last_error"):
                parts[-1] += f" ({disc['last_error']})"
    balanced = rebalance_text(doc, now or datetime.datetime.now(datetime.UTC))
    if balanced:
        parts.append(balanced)
    stall = doc.get("stall_check")
    if isinstance(stall, dict) and stall.get("enabled"):
        timeout = stall.get("timeout_seconds")
        parts.append("stall check on" + (f" ({timeout:g}s)" if isinstance(timeout, (int, float))
                                         else ""))
    for key in ("relay", "version"):
        if doc.get(key):
            parts.append(f"{key} {doc[key]}")
    if parse_time(doc.get("started")) is not None:
        parts.append(f"up {age(doc['started'], now or datetime.datetime.now(datetime.UTC))}")
    return ", ".join(parts)


def render(doc: Mapping[str, Any], ready: bool, now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    rows = [list(COLUMNS)] + [row(u, now) for u in doc.get("upstreams") or []
                              if isinstance(u, dict)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip()
             for r in rows]
    if len(rows) == 1:
        lines.append("(no upstreams)")
    lines.append(summary(doc, ready, now))
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # Exit 2 (unreachable's status, as for every bad argument), in one line.
        print(f"{self.prog}: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(UNREACHABLE)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="extractedprism status",
        allow_abbrev=False,
        description="Show where this node's API server traffic goes: one line per "
        "upstream, then a summary. Reads the local health server. Exit status: 0 ready, "
        "1 answering but not ready, 2 unreachable.")
    ap.add_argument("--health-bind-address", metavar="STR",
                    help="health server address (default: EP_HEALTH_BIND_ADDRESS, else "
                    "--bind-address)")
    ap.add_argument("--bind-address", metavar="STR",
                    help="the proxy's --bind-address (default: EP_BIND_ADDRESS, else "
                    "127.0.0.1)")
    ap.add_argument("--health-port", metavar="INT",
                    help="health server port (default: EP_HEALTH_PORT, else 7446)")
    ap.add_argument("--json", action="store_true",
                    help="print the /upstreams document as it came")
    ap.add_argument("--watch", nargs="?", const="2s", metavar="INTERVAL",
                    help="redraw every INTERVAL (default 2s) until Ctrl-C")
    ap.add_argument("--timeout", default="3s", metavar="DURATION",
                    help="how long to wait for the health server (default: 3s)")
    return ap


def _duration(flag: str, text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise SystemExit(f"extractedprism status: {flag} ({text}) is invalid: {exc}") \
            from None
    if not 0 < value < float("inf"):
        raise SystemExit(f"extractedprism status: {flag} ({text}) must be positive")
    return value


def once(address: tuple[str, int], as_json: bool, timeout: float) -> tuple[int, str]:
    """(exit status, text to print) for one look."""
    try:
        doc, ready, raw = fetch(address, timeout)
    except Unreachable as exc:
        return UNREACHABLE, f"extractedprism status: {exc}"
    text = raw.decode("utf-8", "replace").rstrip("\n") if as_json else render(doc, ready)
    return (READY if ready else NOT_READY), text


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = os.environ if environ is None else environ
    try:
        address = health_address(args, env)
        timeout = _duration("--timeout", args.timeout)
        interval = _duration("--watch", args.watch) if args.watch is not None else 0.0
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return UNREACHABLE
    if not interval:
        status, text = once(address, args.json, timeout)
        print(text, file=sys.stderr if status == UNREACHABLE else sys.stdout)
        return status
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    status = UNREACHABLE
    # "Ctrl-C stops" holds however we were started: Python leaves SIGINT ignored when it
    # inherits it ignored (a script's background job, `nohup`), and then only SIGKILL
    # would end the loop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            status, text = once(address, args.json, timeout)
            stamp = time.strftime("%H:%M:%S")
            # With its unit: `--watch 1` is a second, and says so.
            print(f"{clear}{stamp}  {_hostport(address)}  (every {format_duration(interval)}; "
                  f"Ctrl-C stops)\n{text}\n", flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return status
