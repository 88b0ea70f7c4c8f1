"""Watching a fleet from the outside: Node readiness, Lease renewals, connections.

Everything here asks an API server directly over the run's bridge with the admin token
(never through a node's balancer, so what is measured never depends on what measures
it), and the caller names the API servers to avoid (the one under fault).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from epscripts.controlplane import host as cphost

MAX_RUN_S = 900.0  # hard cap on a sampler, on top of its stop event
LEASE_NS = "kube-node-lease"


def parse_time(value: str) -> float:
    """RFC 3339 (Lease renewTime has microseconds, Node conditions seconds) -> epoch."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _get(cp: Any, path: str, avoid: set[str]) -> dict[str, Any] | None:
    # The three, then a spare that runs (a test whose three are all down asks it).
    for api in (*cphost.APISERVERS, *cphost.SPARE_APISERVERS):
        if api in avoid or api not in cp.state["netns"] or cp.pid(api) is None:
            continue
        with contextlib.suppress(OSError, ssl.SSLError, ValueError):
            status, body = cp.request(api, path, timeout=3)
            if status == 200 and isinstance(body, dict):
                return body
    return None


def node_conditions(cp: Any, avoid: set[str] = frozenset()) -> dict[str, dict[str, Any]] | None:
    """{node: {"ready": "True"|"False"|"Unknown", "reason": ..., "taints": [...]}}."""
    body = _get(cp, "/api/v1/nodes", set(avoid))
    if body is None:
        return None
    out = {}
    for item in body.get("items") or []:
        cond = {c["type"]: c for c in (item.get("status") or {}).get("conditions") or []}
        ready = cond.get("Ready") or {}
        out[item["metadata"]["name"]] = {
            "ready": ready.get("status", "absent"), "reason": ready.get("reason", ""),
            "taints": [t.get("key") for t in (item.get("spec") or {}).get("taints") or []]}
    return out


def lease_renewals(cp: Any, avoid: set[str] = frozenset()) -> dict[str, float] | None:
    """{node: renewTime as epoch seconds} from the node Leases."""
    body = _get(cp, f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases", set(avoid))
    if body is None:
        return None
    out = {}
    for item in body.get("items") or []:
        renew = (item.get("spec") or {}).get("renewTime")
        if renew:
            out[item["metadata"]["name"]] = parse_time(renew)
    return out


def wait_nodes_ready(cp: Any, nodes: list[str], timeout: float,
                     alive: Callable[[], None] | None = None) -> float:
    """Seconds until every node in ``nodes`` reports Ready=True."""
    t0 = time.monotonic()
    last: dict[str, Any] | None = None
    while True:
        if alive:
            alive()
        last = node_conditions(cp)
        if last is not None and all((last.get(n) or {}).get("ready") == "True" for n in nodes):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"nodes not Ready within {timeout:g}s: {last}")
        time.sleep(0.5)


def connections(cp: Any, peers: dict[str, str]) -> dict[str, dict[str, int]]:
    """Established connections on each API server's port, counted in its own namespace,
    by peer: {api: {peer name: count}}; ``peers`` maps an address to a name."""
    out: dict[str, dict[str, int]] = {}
    for api in cphost.APISERVERS:
        ns = cp.state["netns"][api]
        proc = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established",
                               f"( sport = :{cphost.PORT} )"], capture_output=True, text=True,
                              timeout=10)
        counts: dict[str, int] = {}
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            peer = parts[-1].rsplit(":", 1)[0]
            name = peers.get(peer, peer)
            counts[name] = counts.get(name, 0) + 1
        out[api] = counts
    return out


_USER = re.compile(r'users:\(\("([^"]+)"')
_BYTES = {k: re.compile(rf"\b{k}:(\d+)") for k in ("bytes_sent", "bytes_received")}


def node_sockets(fleet: Any, node: str) -> list[dict[str, Any]]:
    """Established TCP sockets in a node's namespace: local, peer, owner, byte counts."""
    proc = fleet.in_netns(node, ["ss", "-Htnpi", "state", "established"])
    out: list[dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        if line[:1].isspace():  # the tcp_info line of the socket above
            if out:
                for key, rx in _BYTES.items():
                    m = rx.search(line)
                    out[-1][key] = int(m.group(1)) if m else 0
            continue
        parts = line.split()
        if len(parts) < 4:
            continue
        user = _USER.search(line)
        out.append({"local": parts[2], "peer": parts[3],
                    "owner": user.group(1) if user else "", "bytes_sent": 0,
                    "bytes_received": 0})
    return out


def kubelet_apis(cp: Any, fleet: Any, lb_port: int = 7445, owner: str = "kubemark",
                 nodes: list[str] | None = None) -> dict[str, list[str]]:
    """Per node, the API servers its kubelet's connections (or those of the program
    ``owner``, e.g. ``kubectl``) reach through its balancer.

    A balancer passes TLS through byte for byte, so the kubelet's socket to the balancer
    and the balancer's socket to the API server carrying it have counted the same bytes
    each way (to within what is in flight): matched on those counts. Counting a
    balancer's connections per API server instead would also count its own (the
    discovery watch of extractedprism and of the Go original), which carry no kubelet.
    """
    from concurrent.futures import ThreadPoolExecutor

    by_ip = {cp.ip(a): a for a in cphost.APISERVERS}
    out: dict[str, list[str]] = {}
    nodes = list(fleet.nodes if nodes is None else nodes)
    # A few nodes at a time: one `ss` after another took most of a minute at 100 nodes.
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="fleet-node-sockets") as ex:
        all_socks = dict(zip(nodes, ex.map(lambda n: node_sockets(fleet, n), nodes),
                             strict=True))
    for node in nodes:
        socks = all_socks[node]
        kubelet = [s for s in socks if s["owner"] == owner
                   and s["peer"] == f"127.0.0.1:{lb_port}"]
        ups = [s for s in socks if s["peer"].rsplit(":", 1)[0] in by_ip]
        apis = []
        for k in kubelet:
            best = min(ups, default=None, key=lambda u, k=k: (
                abs(u["bytes_sent"] - k["bytes_sent"])
                + abs(u["bytes_received"] - k["bytes_received"])))
            if best is None:
                continue
            off = (abs(best["bytes_sent"] - k["bytes_sent"])
                   + abs(best["bytes_received"] - k["bytes_received"]))
            if off <= max(4096, (k["bytes_sent"] + k["bytes_received"]) // 20):
                apis.append(by_ip[best["peer"].rsplit(":", 1)[0]])
        out[node] = apis
    return out


def busiest_for_kubelets(cp: Any, fleet: Any) -> tuple[str, dict[str, list[str]]]:
    """The API server carrying the most kubelets' connections (ties: the first)."""
    apis = kubelet_apis(cp, fleet)
    counts = {a: sum(v.count(a) for v in apis.values()) for a in cphost.APISERVERS}
    return max(cphost.APISERVERS, key=lambda a: counts[a]), apis


class Every:
    """Calls ``fn`` every ``period`` seconds on a thread named ``name`` until stopped, for
    at most ``max_s`` seconds (and as many calls as fit in them)."""

    def __init__(self, name: str, period: float, fn: Callable[[], None],
                 max_s: float = MAX_RUN_S) -> None:
        self.period, self.fn, self.max_s = period, fn, max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Every:
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        for _ in range(int(self.max_s / self.period) + 1):
            if self._stop.is_set() or time.monotonic() > deadline:
                return
            t0 = time.monotonic()
            self.fn()
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t0)))


PAUSE_MIN_S = 3.0  # a wakeup this late is the machine stopping, not scheduling on 2 CPUs


class PauseWatch:
    """Notices the whole machine stopping: a thread that wakes every 0.25 s and keeps every
    wakeup that came PAUSE_MIN_S or more late, by the wall clock or the monotonic one
    (a paused or snapshotted VM: the kernel logs ``crng reseeded due to virtual machine
    fork`` as it resumes). Every process stops with it, the measured ones and the
    measuring ones alike, so a cell with a pause has gaps that are the machine's."""

    TICK = 0.25

    def __init__(self, max_s: float = MAX_RUN_S) -> None:
        self.pauses: list[tuple[float, float]] = []  # (time.time() it began, seconds)
        self.max_s = max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pause-watch", daemon=True)

    def start(self) -> PauseWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        wall, mono = time.time(), time.monotonic()
        end = mono + self.max_s
        for _ in range(int(self.max_s / self.TICK) + 1):
            stopping = self._stop.wait(self.TICK)
            # Measure before honouring stop(): a machine resuming from a pause wakes every
            # thread at once, and the caller's stop() can win the race to this wakeup, which
            # is the one that shows the pause.
            now_wall, now_mono = time.time(), time.monotonic()
            late = max(now_wall - wall, now_mono - mono) - self.TICK
            if late >= PAUSE_MIN_S:
                self.pauses.append((wall, round(late, 2)))
            if stopping or now_mono > end:
                return
            wall, mono = now_wall, now_mono


@dataclass
class Sample:
    t: float  # time.time() of the sample
    not_ready: dict[str, str]  # node -> Ready status other than True (with reason)


@dataclass
class Sampler:
    """Samples Node readiness and Lease renewTimes every ``period`` seconds."""

    cp: Any
    nodes: list[str]
    period: float = 1.0
    avoid: set[str] = field(default_factory=set)
    renewals: dict[str, set[float]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    failed_polls: int = 0
    max_s: float = MAX_RUN_S  # its bound (a soak runs longer than a compare cell)

    def __post_init__(self) -> None:
        self._every = Every("fleet-sampler", self.period, self.poll, self.max_s)

    def start(self) -> Sampler:
        self._every.start()
        return self

    def stop(self) -> None:
        self._every.stop()

    def poll(self) -> None:
        now = time.time()
        leases = lease_renewals(self.cp, self.avoid)
        conds = node_conditions(self.cp, self.avoid)
        if leases is None or conds is None:
            self.failed_polls += 1
            return
        for node in self.nodes:
            if node in leases:
                self.renewals.setdefault(node, set()).add(leases[node])
        self.samples.append(Sample(now, {
            n: f"{(conds.get(n) or {}).get('ready', 'absent')} "
               f"{(conds.get(n) or {}).get('reason', '')}".strip()
            for n in self.nodes if (conds.get(n) or {}).get("ready") != "True"}))

    def not_ready(self, since: float = 0.0) -> dict[str, list[tuple[float, str]]]:
        """Every sample (at or after ``since``) in which a node was not Ready."""
        out: dict[str, list[tuple[float, str]]] = {}
        for s in self.samples:
            if s.t >= since:
                for node, why in s.not_ready.items():
                    out.setdefault(node, []).append((s.t, why))
        return out

    def lease_gaps(self, since: float, until: float | None = None) -> dict[str, float]:
        """Per node, the longest time without a renewal in [since, until]: between two
        renewals, and from the last renewal to ``until`` (default: now), counting the
        renewal just before ``since`` as the start."""
        until = until if until is not None else time.time()
        out = {}
        for node in self.nodes:
            times = sorted(self.renewals.get(node, ()))
            before = [t for t in times if t < since]
            inside = [t for t in times if since <= t <= until]
            points = ([before[-1]] if before else [since]) + inside + [until]
            out[node] = max(b - a for a, b in itertools.pairwise(points))
        return out
