"""The invariants of one proxy's ``/upstreams``, checked every second by scripts/chaos (pure).

:class:`Checker` is fed one observation per second per node: the ``/upstreams`` document,
``extractedprism_connections_total`` read from ``/metrics`` right after it, and the
established TCP connections of the node's network namespace to API-server addresses (in a
node's namespace only the proxy talks to API servers: the kubelet and the extra clients
talk to 127.0.0.1:7445). It returns the violations that observation shows, each a
:class:`Violation` with the time and what was seen. The rules:

* ``sum``: the upstreams' ``active_connections`` add up to ``connections_active`` (one
  snapshot, taken under the registry lock: exact);
* ``share``: ``connection_share`` adds up to 1 while any connection is live (each is rounded
  to 4 places);
* ``active>total``: no upstream has more live connections than it ever had;
* ``total-decreased``: an upstream's ``total_connections`` never goes down while it stays
  listed by the same process;
* ``counter``: the metric ``connections_total`` read between two documents of the same
  process listing the same upstreams lies between their sums of ``total_connections``
  (both are counted at the same attach: a difference is drift);
* ``reservation``: an upstream's ``dials_in_flight`` does not stay above 0 for
  ``leak_s`` (a dial ends within its timeout; a count that never returns to 0 is a
  reservation left behind);
* ``removed-after-drain``: an upstream removed from the endpoint list
  (``draining_reason`` ``removed``) holds no connection ``slack_s`` after its
  ``close_deadline``;
* ``socket-on-removed``: no connection to an API-server address the proxy does not list,
  seen in two observations at least ``slack_s`` apart (a probe or a dial in flight when
  the upstream left lasts at most one timeout).

A process is told apart by its ``started`` time, so a restart or a handover (two processes
answering the health port for a moment) never compares two processes' counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

SHARE_TOLERANCE = 0.0005  # per upstream: each share is rounded to 4 places


@dataclass(frozen=True)
class Violation:
    t: float  # time.time() of the observation
    node: str
    rule: str
    detail: str

    def line(self) -> str:
        from time import gmtime, strftime

        return (f"{strftime('%H:%M:%S', gmtime(self.t))}.{int(self.t % 1 * 1000):03d} "
                f"{self.node} {self.rule}: {self.detail}")


def wall(text: str | None) -> float | None:
    """An RFC 3339 time of the document -> epoch seconds."""
    if not text:
        return None
    return datetime.fromisoformat(text).timestamp()


@dataclass
class Checker:
    node: str
    leak_s: float = 5.0
    slack_s: float = 2.0
    observations: int = 0
    violations: list[Violation] = field(default_factory=list)
    # The previous observation: process, totals by address, metric read after it.
    _prev_started: str | None = None
    _prev_totals: dict[str, int] = field(default_factory=dict)
    _prev_metric: float | None = None
    _dials_since: dict[str, tuple[float, int]] = field(default_factory=dict)
    _leak_reported: set[str] = field(default_factory=set)
    _unlisted_since: dict[str, float] = field(default_factory=dict)
    _socket_reported: set[str] = field(default_factory=set)
    _removed_reported: set[tuple[str, str | None]] = field(default_factory=set)

    def _add(self, t: float, rule: str, detail: str) -> None:
        self.violations.append(Violation(t, self.node, rule, detail))

    def observe(self, t: float, doc: dict[str, Any], metric_total: float | None,
                sockets: dict[str, int]) -> list[Violation]:
        """One observation; returns the violations it adds. ``sockets``: established
        connections by peer ``ip:port`` (API-server addresses only)."""
        n0 = len(self.violations)
        self.observations += 1
        ups = {u["address"]: u for u in doc.get("upstreams") or []}
        started = doc.get("started")
        same = started == self._prev_started
        active = {a: int(u.get("active_connections") or 0) for a, u in ups.items()}
        totals = {a: int(u.get("total_connections") or 0) for a, u in ups.items()}
        live = int(doc.get("connections_active") or 0)
        if sum(active.values()) != live:
            self._add(t, "sum", f"connections_active {live} but the upstreams hold "
                      f"{sum(active.values())} ({active})")
        if live:
            share = sum(float(u.get("connection_share") or 0) for u in ups.values())
            if abs(share - 1.0) > SHARE_TOLERANCE * max(1, len(ups)):
                self._add(t, "share", f"connection_share adds up to {share:.4f} with "
                          f"{live} live connections")
        for a in ups:
            if active[a] > totals[a]:
                self._add(t, "active>total", f"{a}: {active[a]} live, {totals[a]} in total")
            if same and a in self._prev_totals and totals[a] < self._prev_totals[a]:
                self._add(t, "total-decreased", f"{a}: total_connections "
                          f"{self._prev_totals[a]} -> {totals[a]}")
        # The metric read after the previous document, between it and this one.
        if (same and self._prev_metric is not None
                and set(self._prev_totals) == set(totals)):
            low, high = sum(self._prev_totals.values()), sum(totals.values())
            if not low <= self._prev_metric <= high:
                self._add(t, "counter", f"extractedprism_connections_total "
                          f"{self._prev_metric:g} outside the upstreams' totals before "
                          f"and after it [{low}, {high}]")
        self._check_dials(t, ups, same)
        self._check_removed(t, ups, started)
        self._check_sockets(t, ups, sockets)
        self._prev_started = started
        self._prev_totals = totals
        self._prev_metric = metric_total
        return self.violations[n0:]

    def _check_dials(self, t: float, ups: dict[str, Any], same: bool) -> None:
        if not same:
            self._dials_since.clear()
        for a, u in ups.items():
            n = int(u.get("dials_in_flight") or 0)
            if n <= 0:
                self._dials_since.pop(a, None)
                self._leak_reported.discard(a)
                continue
            since, peak = self._dials_since.get(a, (t, 0))
            self._dials_since[a] = (since, max(peak, n))
            if t - since >= self.leak_s and a not in self._leak_reported:
                self._leak_reported.add(a)
                self._add(t, "reservation", f"{a}: dials_in_flight above 0 for "
                          f"{t - since:.1f}s (up to {max(peak, n)}; state {u.get('state')})")
        for a in list(self._dials_since):
            if a not in ups:
                del self._dials_since[a]

    def _check_removed(self, t: float, ups: dict[str, Any], started: str | None) -> None:
        for a, u in ups.items():
            if u.get("draining_reason") != "removed":
                continue
            deadline = wall(u.get("close_deadline"))
            n = int(u.get("active_connections") or 0)
            key = (a, started)
            if (deadline is not None and t > deadline + self.slack_s and n > 0
                    and key not in self._removed_reported):
                self._removed_reported.add(key)
                self._add(t, "removed-after-drain", f"{a}: {n} connections "
                          f"{t - deadline:.1f}s after its close_deadline "
                          f"{u.get('close_deadline')}")

    def _check_sockets(self, t: float, ups: dict[str, Any], sockets: dict[str, int]) -> None:
        unlisted = {p: n for p, n in sockets.items() if n > 0 and p not in ups}
        for p in list(self._unlisted_since):
            if p not in unlisted:
                del self._unlisted_since[p]
                self._socket_reported.discard(p)
        for p, n in unlisted.items():
            since = self._unlisted_since.setdefault(p, t)
            if t - since >= self.slack_s and p not in self._socket_reported:
                self._socket_reported.add(p)
                self._add(t, "socket-on-removed", f"{n} established connections to {p}, "
                          f"which /upstreams has not listed for {t - since:.1f}s")


def parse_proc_net_tcp(text: str, port: int) -> dict[str, int]:
    """Established IPv4 connections to remote ``port`` by ``ip:port``, from
    ``/proc/<pid>/net/tcp`` (the namespace of whoever reads it)."""
    out: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != "01":  # TCP_ESTABLISHED
            continue
        ip_hex, port_hex = parts[2].split(":")
        if int(port_hex, 16) != port:
            continue
        raw = bytes.fromhex(ip_hex)[::-1]  # little-endian on the hosts this runs on
        peer = f"{'.'.join(str(b) for b in raw)}:{port}"
        out[peer] = out.get(peer, 0) + 1
    return out


def metric_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            try:
                return float(line.rsplit(None, 1)[1])
            except (IndexError, ValueError):
                return None
    return None
