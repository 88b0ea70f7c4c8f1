"""Membership that cannot go stale (issue 29): a node recovers on its own when every
address it knows is gone, and when every discovered one is.

Operators' most reported failure with node-local balancers is a node stuck on an endpoint
list that no longer holds a live API server, often because the list was refreshed through
the balancer itself; extractedprism's discovery goes through its own listener. Two
measurements on the real control plane, each with four proxies side by side (the same
run, the same faults): ``--static-endpoints`` always (the spec's behaviour) and fallback,
each with the test timings (I, T) and with the spec's defaults (20 s, 15 s):

* :func:`test_restart_after_the_control_plane_moved`: the proxies run with ``--endpoints``
  naming api1 and api2 by address and a host name ``NAME`` that resolves to api3, and a
  ``--state-file``; they stop; api1-api3 are killed and their addresses black-holed from
  the node (a replaced machine answers nothing, not even a reset); api5-api7 take over on
  new addresses, and ``NAME`` now resolves to api5 (each proxy reads a hosts file of its
  own, standing in for the control plane's DNS name); the proxies start again. Every
  address in the state file and ``--endpoints`` is dead except the name's.
* :func:`test_discovered_servers_die_static_lives`: ``--endpoints`` names api4 only, an API
  server that never enters the ``kubernetes`` EndpointSlice (``--endpoint-reconciler-type
  =none``: a static endpoint the slice does not list, as a DNS name or an external
  balancer in front of the servers is); discovery lists api1-api3; all three die
  (SIGKILL, addresses black-holed). No live reconciler drops their leases, so the slice
  keeps naming the dead servers: discovery's list goes stale and stays stale.

* :func:`test_kubelet_lease_when_the_discovered_servers_die`: the same fault under a real
  (hollow) kubelet behind its node's extractedprism (``--static-endpoints=fallback``, the
  spec's timings): how long until its Lease renews.
* :func:`test_kubelet_lease_after_the_control_plane_moved`: the first test's move under a
  hollow kubelet (its node's proxy stopped, the control plane moved, the proxy started
  again): how long from the proxy's start until the Lease renews, and whether the node
  went NotReady meanwhile. Slow (a fleet, three servers started): only with
  ``EP_CONTROLPLANE_SLOW=1``.

The client: one request loop per proxy, a new connection per request (GET /readyz, as
authenticated clients and the kubelet's reconnects do), every ``PERIOD`` s, each given
the kubelet's heartbeat timeout (``CLIENT_TIMEOUT``). Figures: the first request that
succeeds, and "flowing": the end of the first success after which no request failed,
both from the proxies' start (or the fault); the failed requests; for the first test,
when every new server is discovered and ready.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane import harness
from tests.controlplane.conftest import (
    INTERVAL,
    MARKS,
    SLACK,
    TIMEOUT,
    cphost,
    record,
    require_control_plane,
    restore,
)
from tests.controlplane.harness import mono
from tests.util import wait_until

require_control_plane()

# Each test: a control plane moved or killed, four proxies, the restore afterwards.
pytestmark = [*MARKS, pytest.mark.timeout(900)]

NAME = "cp.extractedprism.test"  # the control plane's DNS name, in --endpoints
OLD = cphost.APISERVERS  # api1-api3
NEW = ("api5", "api6", "api7")
STATIC_ONLY = "api4"  # (second test) reachable, never in the slice
PERIOD = 0.5  # the request loop's pause between requests
# The kubelet gives a heartbeat request min(node status update frequency, lease
# duration) = 10 s; a client of ours waits as long for an answer.
CLIENT_TIMEOUT = 10.0
DEFAULT_INTERVAL = 20.0  # the spec's --health-interval
DEFAULT_TIMEOUT = 15.0  # the spec's --health-timeout (also the dial timeout)
# How long the new servers' lease reconcilers take to drop the killed servers from the
# slice: the lease TTL (15 s) plus a reconcile period (10 s) plus start-up.
LEASE_EXPIRY_S = 60.0


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str  # --static-endpoints
    interval: float
    timeout: float
    root: Path | None = None  # another checkout's extractedprism (measured, not judged)


VARIANTS: tuple[Variant, ...] = (
    Variant("always-test", "always", INTERVAL, TIMEOUT),
    Variant("fallback-test", "fallback", INTERVAL, TIMEOUT),
    Variant("always-defaults", "always", DEFAULT_INTERVAL, DEFAULT_TIMEOUT),
    Variant("fallback-defaults", "fallback", DEFAULT_INTERVAL, DEFAULT_TIMEOUT),
)
# EP_STALE_COMPARE_TREE=<another checkout>: the spec-default variants of that checkout's
# extractedprism run beside these, on the same faults (figures only; a before/after
# comparison in one run, docs/lifecycle.md).
_COMPARE = os.environ.get("EP_STALE_COMPARE_TREE")
if _COMPARE:
    VARIANTS += tuple(Variant(f"{v.name}-compared", v.mode, v.interval, v.timeout,
                              Path(_COMPARE)) for v in VARIANTS if v.timeout > TIMEOUT)
# EP_STALE_COMPARE_FLAGS="--flag=value ...": appended to the compared node's proxy in
# test_kubelet_lease_after_the_control_plane_moved (e.g. this checkout with
# --dial-hedge-delay=0: what the hedge buys on a restart after the move).
_COMPARE_FLAGS = os.environ.get("EP_STALE_COMPARE_FLAGS", "").split()


def r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --- the node's view of the network ----------------------------------------------------


def blackhole(cp: Any, api: str) -> None:
    """Frames from the root namespace (the node) to ``api`` go to a MAC nobody has: the
    address answers nothing, as a machine that is gone."""
    cphost.run_ip("neigh", "replace", cp.ip(api), "lladdr", cphost.DEAD_MAC, "dev",
                  cp.state["bridge"], "nud", "permanent")


def unblackhole(cp: Any, api: str) -> None:
    cphost.run_ip("neigh", "del", cp.ip(api), "dev", cp.state["bridge"], check=False)


def write_hosts(path: Path, ip: str) -> None:
    """In place (the proxies' bind mounts hold the inode)."""
    with open(path, "r+" if path.exists() else "w") as f:
        f.seek(0)
        f.write(f"127.0.0.1 localhost\n{ip} {NAME}\n")
        f.truncate()


# --- the client --------------------------------------------------------------------------


@dataclass
class Requests:
    """One request loop through a proxy: a new TLS connection per GET /readyz."""

    port: int
    ctx: ssl.SSLContext
    results: list[tuple[float, float, bool, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Requests:
        self._thread = threading.Thread(target=self._run, name="cp-stale-requests",
                                        daemon=True)
        return harness.start_live(self, [self._thread])

    def _one(self) -> tuple[bool, str]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx,
                                           timeout=CLIENT_TIMEOUT)
        try:
            # SNI and verification as kubernetes.default.svc: connected here, so the
            # request goes on this socket.
            sock = socket.create_connection(("127.0.0.1", self.port), CLIENT_TIMEOUT)
            conn.sock = self.ctx.wrap_socket(sock, server_hostname=harness.SERVER_NAME)
            conn.request("GET", "/readyz")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200, f"HTTP {resp.status}"
        except (OSError, http.client.HTTPException) as exc:
            return False, f"{type(exc).__name__}: {exc}"[:200]
        finally:
            conn.close()

    def _run(self) -> None:
        deadline = mono() + harness.MAX_RUN_S
        for _ in range(10_000):
            if self._stop.is_set() or mono() > deadline:
                break
            t0 = mono()
            ok, what = self._one()
            self.results.append((t0, mono(), ok, what))
            self._stop.wait(PERIOD)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLIENT_TIMEOUT + 5)

    def figures(self, since: float) -> dict[str, Any]:
        """first_ok / flowing: seconds from ``since`` to the end of the first success,
        and of the first success after which nothing failed (None: never)."""
        rows = [x for x in self.results if x[0] >= since]
        first_ok = next((end for _, end, ok, _ in rows if ok), None)
        flowing = None
        for i, (_, end, ok, _) in enumerate(rows):
            if ok and all(x[2] for x in rows[i:]):
                flowing = end
                break
        failed = [what for _, _, ok, what in rows if not ok]
        return {"first_ok_s": r(first_ok - since) if first_ok is not None else None,
                "flowing_s": r(flowing - since) if flowing is not None else None,
                "requests": len(rows), "failed": len(failed),
                "failures": sorted(set(failed))[:4]}

    def flowing_since(self, since: float, hold: float) -> bool:
        """Every request of the last ``hold`` s succeeded (and there were some)."""
        rows = [x for x in self.results if x[0] >= since]
        if not rows or rows[-1][1] - hold < since:
            return False
        tail = [x for x in rows if x[1] >= rows[-1][1] - hold]
        return len(tail) >= 2 and all(x[2] for x in tail)


def ready_in(ups: dict[str, dict[str, Any]], addresses: list[str]) -> bool:
    return all(a in ups and ups[a]["healthy"] and not ups[a]["draining"]
               and ups[a]["readiness"] == "ready" and "kubernetes" in ups[a]["source"]
               for a in addresses)


def upstreams_or_empty(proxy: harness.Proxy) -> dict[str, dict[str, Any]]:
    try:
        return proxy.upstreams()
    except (OSError, ValueError, KeyError):
        return {}


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def moved(cluster: Any) -> Iterator[Any]:
    """The run, restored afterwards: nothing black-holed, the spares stopped gracefully
    (each drops its own lease from the slice), api1-api3 back and alone in the slice."""
    try:
        yield cluster
    finally:
        harness.stop_live()
        for api in (*OLD, *NEW, STATIC_ONLY):
            unblackhole(cluster, api)
        spares = [a for a in (*NEW, STATIC_ONLY) if a in cluster.state["netns"]
                  and cluster.running(a)]
        for api in spares:
            cluster.term(api)
        for api in spares:
            if not cluster.wait_exit(api, 60):
                cluster.kill(api)
        restore(cluster)
        cluster.wait_slice({cluster.ip(a) for a in OLD}, LEASE_EXPIRY_S)


def start_variant(cluster: Any, tmp_path: Path, v: Variant, *, endpoints: list[str],
                  hosts: Path | None, tag: str) -> harness.Proxy:
    return harness.start_proxy(
        cluster, tmp_path, interval=v.interval, timeout=v.timeout, endpoints=endpoints,
        hosts=hosts, name=f"{v.name}-{tag}", root=v.root,
        extra=[f"--static-endpoints={v.mode}",
               f"--state-file={tmp_path / (v.name + '.state')}"])


def start_variants(cluster: Any, tmp_path: Path, *, endpoints: list[str],
                   hosts: Path | None, tag: str) -> dict[str, harness.Proxy]:
    return {v.name: start_variant(cluster, tmp_path, v, endpoints=endpoints, hosts=hosts,
                                  tag=tag) for v in VARIANTS}


def stop_variants(proxies: dict[str, harness.Proxy]) -> None:
    for p in proxies.values():
        p.stop()


def state_file_lists(path: Path, want: set[str]) -> bool:
    from extractedprism.discovery import statefile

    got = statefile.read(str(path))  # None until written (it is replaced atomically)
    return got is not None and {str(e) for e in got} == want


def wait_serving(cluster: Any, apis: tuple[str, ...], via: str, timeout: float) -> float:
    """Until each of ``apis`` answers /readyz 200 and the slice (asked of ``via``) lists
    exactly them."""
    t0 = mono()
    want = {cluster.ip(a) for a in apis}

    def ok() -> bool:
        for api in apis:
            if cluster.pid(api) is None:
                raise AssertionError(f"{api} exited while starting")
        return (all(cluster.readyz(a) == 200 for a in apis)
                and cluster.slice_addresses(via=via) == want)

    wait_until(ok, timeout, interval=0.5,
               message=f"{', '.join(apis)} ready and alone in the kubernetes EndpointSlice")
    return mono() - t0


# --- (a) every address the node knows is gone -------------------------------------------


HEDGE = 0.25  # --dial-hedge-delay (the default; the proxies here keep it)
ANSWER_HEDGE = 1.0  # --answer-hedge-delay (the default): the carrying request's answer


def flow_bound(v: Variant) -> float:
    """Until traffic flows through the live endpoint (the name after the restart, the
    static one after the fault), derived from the flags and the client's timeout.

    A request costs at most ``min(CLIENT_TIMEOUT, 2T + 2 hedges)``: its first pick and
    its hedge may both go to dead servers not yet known to stall (two dials in flight at
    most), and the second dial after the first timed out reaches the live one. That
    request marks the two dead servers it dialled as stalled; the next one's first pick
    skips them (the third dead server or the live endpoint), and a pick of the third
    stalls and is hedged to the live endpoint, the only one left unmarked: at most one
    request misses. The next is carried within the hedge delay and answered within the
    answer hedge delay (a slower first answer would be hedged). Plus the loop's pause
    before the first request (up to one period) and the slack."""
    per_request = min(CLIENT_TIMEOUT, 2 * v.timeout + 2 * HEDGE) + PERIOD
    return PERIOD + per_request + HEDGE + ANSWER_HEDGE + SLACK


def discovery_bound(v: Variant) -> float:
    """Until the new servers are discovered and ready: discovery's list through the
    proxy's listener after traffic flows, at most one backoff later (the delays double
    from 1 s with 25% jitter, so the next attempt comes by 2.5 x the time spent failing
    plus 1.25 s, and the backoff is capped at 30 s), then their first probe (one
    timeout), then the slack."""
    f = flow_bound(v)
    return min(2.5 * f + 1.25, f + 1.25 * 30) + v.timeout + SLACK


def test_restart_after_the_control_plane_moved(moved: Any, tmp_path: Path) -> None:
    cp = moved
    hosts = tmp_path / "hosts"
    write_hosts(hosts, cp.ip("api3"))
    endpoints = [cp.endpoint("api1"), cp.endpoint("api2"), f"{NAME}:{cphost.PORT}"]
    old = {cp.endpoint(a) for a in OLD}
    proxies = start_variants(cp, tmp_path, endpoints=endpoints, hosts=hosts, tag="before")
    try:
        for v in VARIANTS:
            wait_until(lambda v=v: state_file_lists(tmp_path / f"{v.name}.state", old),
                       2 * v.interval + v.timeout + 30, interval=0.2,
                       message=f"{v.name}: the state file lists api1-api3")
    finally:
        stop_variants(proxies)

    # The control plane moves while the node's proxy is down.
    for api in OLD:
        cp.kill(api)
        blackhole(cp, api)
    for api in NEW:
        cp.add_apiserver(api)
        cp.start(api)
    moved_s = wait_serving(cp, NEW, via=NEW[0], timeout=90 + LEASE_EXPIRY_S)
    write_hosts(hosts, cp.ip(NEW[0]))
    new = [cp.endpoint(a) for a in NEW]

    # Each proxy's clock starts when it is started; its client starts as soon as it
    # answers /healthz (the process is up), before anything else is started.
    t_start: dict[str, float] = {}
    started: dict[str, float | None] = {}
    proxies: dict[str, harness.Proxy] = {}
    loops: dict[str, Requests] = {}
    discovered: dict[str, float | None] = {v.name: None for v in VARIANTS}
    try:
        for v in VARIANTS:
            t_start[v.name] = mono()
            proxies[v.name] = start_variant(cp, tmp_path, v, endpoints=endpoints, hosts=hosts,
                                            tag="after")
            started[v.name] = r(mono() - t_start[v.name])
            loops[v.name] = Requests(proxies[v.name].port, cp.ssl_context()).start()
        deadline = mono() + 2 * max(discovery_bound(v) for v in VARIANTS) + CLIENT_TIMEOUT
        while mono() < deadline:
            for v in VARIANTS:
                if discovered[v.name] is None and ready_in(
                        upstreams_or_empty(proxies[v.name]), new):
                    discovered[v.name] = r(mono() - t_start[v.name])
            if all(discovered.values()) and all(
                    loops[v.name].flowing_since(t_start[v.name], 4 * PERIOD)
                    for v in VARIANTS):
                break
            time.sleep(0.1)
        final = {name: upstreams_or_empty(p) for name, p in proxies.items()}
    finally:
        for loop in loops.values():
            loop.stop()
        stop_variants(proxies)
    figs = {v.name: {**loops[v.name].figures(t_start[v.name]),
                     "discovered_ready_s": discovered[v.name],
                     "proxy_started_s": started[v.name], "bound_s": flow_bound(v),
                     "discovery_bound_s": discovery_bound(v),
                     "upstreams_at_end": {a: (u["state"], u["source"])
                                          for a, u in final[v.name].items()}}
            for v in VARIANTS}
    record("stale: restart after the control plane moved", moved_s=r(moved_s), **figs)
    for v in (v for v in VARIANTS if v.root is None):
        f = figs[v.name]
        assert f["flowing_s"] is not None and f["flowing_s"] <= flow_bound(v), (
            f"{v.name}: traffic did not flow within {flow_bound(v):g}s: {f}")
        assert discovered[v.name] is not None and discovered[v.name] <= discovery_bound(v), (
            f"{v.name}: api5-api7 not discovered and ready within "
            f"{discovery_bound(v):g}s: {f}")


# --- (b) every discovered server dies, the static one lives -----------------------------


def test_discovered_servers_die_static_lives(moved: Any, tmp_path: Path) -> None:
    cp = moved
    cp.add_apiserver(STATIC_ONLY)
    cp.start(STATIC_ONLY, ["--endpoint-reconciler-type=none"])
    wait_until(lambda: cp.readyz(STATIC_ONLY) == 200, 90, interval=0.5,
               message=f"{STATIC_ONLY} ready")
    assert cp.slice_addresses(via="api1") == {cp.ip(a) for a in OLD}
    static = cp.endpoint(STATIC_ONLY)
    old = [cp.endpoint(a) for a in OLD]
    proxies = start_variants(cp, tmp_path, endpoints=[static], hosts=None, tag="b")
    loops: dict[str, Requests] = {}
    try:
        for v in VARIANTS:
            wait_until(lambda v=v: ready_in(upstreams_or_empty(proxies[v.name]), old),
                       2 * v.interval + v.timeout + 30, interval=0.2,
                       message=f"{v.name}: api1-api3 discovered and ready")
        roles = {v.name: upstreams_or_empty(proxies[v.name]).get(static, {}).get("state")
                 for v in VARIANTS}
        loops = {name: Requests(p.port, cp.ssl_context()).start()
                 for name, p in proxies.items()}
        wait_until(lambda: all(loop.flowing_since(0, 2 * PERIOD) for loop in loops.values()),
                   30, interval=0.2, message="requests flowing before the fault")
        # The fault, for the node: the three addresses answer nothing from now on; the
        # processes go after (their leases stay in the slice).
        for api in OLD:
            blackhole(cp, api)
        t_fault = mono()
        for api in OLD:
            cp.kill(api)
        # Twice the bound: code that misses it is measured, not cut off.
        deadline = t_fault + 2 * max(flow_bound(v) for v in VARIANTS) + CLIENT_TIMEOUT
        while mono() < deadline:
            if all(loop.flowing_since(t_fault, 4 * PERIOD) for loop in loops.values()):
                break
            time.sleep(0.2)
        final = {name: upstreams_or_empty(p) for name, p in proxies.items()}
    finally:
        for loop in loops.values():
            loop.stop()
        stop_variants(proxies)
    figs = {v.name: {**loops[v.name].figures(t_fault), "bound_s": flow_bound(v),
                     "static_state_before": roles[v.name],
                     "upstreams_at_end": {a: (u["state"], u["source"])
                                          for a, u in final[v.name].items()}}
            for v in VARIANTS}
    record("stale: discovered servers die, the static one lives", **figs)
    for v in (v for v in VARIANTS if v.root is None):
        f = figs[v.name]
        assert f["flowing_s"] is not None and f["flowing_s"] <= flow_bound(v), (
            f"{v.name}: traffic did not flow via {static} within {flow_bound(v):g}s: {f}")
        with contextlib.suppress(KeyError):
            assert final[v.name][static]["healthy"], f"{v.name}: {final[v.name][static]}"


# --- (b) with a real kubelet: how long until its Lease renews ------------------------------

# The kubelet (kubemark's hollow kubelet keeps its defaults) renews its Lease every
# quarter of its 40 s duration; kube-controller-manager marks a node NotReady after
# --node-monitor-grace-period 50 s without one.
RENEW = 10.0
NODE_GRACE = 50.0


def _in_node(fleet: Any, node: str, code: str) -> str:
    out = fleet.in_netns(node, [sys.executable, "-c", code], timeout=15)
    return out.stdout


def _node_upstreams(fleet: Any, node: str) -> dict[str, dict[str, Any]]:
    code = ("import json, urllib.request as u; print(json.dumps({x['address']: x for x in "
            "json.load(u.urlopen('http://127.0.0.1:7446/upstreams', timeout=5))"
            "['upstreams']}))")
    try:
        return dict(json.loads(_in_node(fleet, node, code) or "{}"))
    except ValueError:
        return {}


def _static_only_up(cp: Any) -> None:
    """api4 started, never in the slice (``--endpoint-reconciler-type=none``), with an
    admin kubeconfig for the controllers: they talk to a server the faults spare, so they
    see the nodes from outside."""
    from epscripts.controlplane.pki import kubeconfig

    cp.add_apiserver(STATIC_ONLY)
    cp.start(STATIC_ONLY, ["--endpoint-reconciler-type=none"])
    wait_until(lambda: cp.readyz(STATIC_ONLY) == 200, 90, interval=0.5,
               message=f"{STATIC_ONLY} ready")
    (cp.dir / f"admin-{STATIC_ONLY}.kubeconfig").write_text(kubeconfig(
        f"https://{cp.endpoint(STATIC_ONLY)}", cp.ca, token=cp.token("admin")))


def _blackhole_in_nodes(fleet: Any, api: str) -> None:
    """As :func:`blackhole`, in each node's namespace (it has neighbours of its own)."""
    for node in fleet.nodes:
        cphost.run_ip("-n", fleet.netns(node), "neigh", "replace", fleet.cp.ip(api),
                      "lladdr", cphost.DEAD_MAC, "dev", "eth0", "nud", "permanent")


def _ep_cmds(hosts: Path | None = None) -> dict[str, list[str]]:
    """How each node runs its proxy: this checkout's, and with ``EP_STALE_COMPARE_TREE``
    that checkout's (its package first on the path; the fleet runs every balancer from
    this checkout's directory). ``hosts``: the proxy resolves names with that file, bound
    over /etc/hosts in the private mount namespace ``ip netns exec`` gives each process
    (the kubelet's own hosts file is bound in its own); ``sh`` execs, so the fleet's pid
    is the proxy's."""
    cmds = {"this": [sys.executable, "-m", "extractedprism"]}
    if _COMPARE:
        cmds["compared"] = [sys.executable, "-c",
                            f"import runpy, sys; sys.path.insert(0, {_COMPARE!r}); "
                            "runpy.run_module('extractedprism', run_name='__main__', "
                            "alter_sys=True)"]
    if hosts is None:
        return cmds
    wrap = ["sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    return {label: [*wrap, *cmd] for label, cmd in cmds.items()}


def test_kubelet_lease_when_the_discovered_servers_die(moved: Any, tmp_path: Path) -> None:
    """A hollow kubelet behind extractedprism as its static pod runs it, with
    ``--static-endpoints=fallback`` and the spec's timings (20 s / 15 s): the node's
    ``--endpoints`` name api4 only (never in the slice), discovery lists api1-api3; all
    three die (SIGKILL, black-holed from the node). Figure: from the fault to the
    Lease's first renewal, and the longest gap; bound: the node never goes NotReady
    (the renewal comes within the grace period, with the renewal period and a request
    timeout to spare). With ``EP_STALE_COMPARE_TREE``, a second node runs that
    checkout's proxy on the same fault."""
    from tests.controlplane.conftest import fleet_why_not

    why = fleet_why_not()
    if why:
        pytest.skip(f"fleet tests: {why}")
    from epscripts.fleet import observe
    from epscripts.fleet.nodes import Fleet

    cp = moved
    _static_only_up(cp)
    static = cp.endpoint(STATIC_ONLY)
    old = [cp.endpoint(a) for a in OLD]
    extra = [f"--endpoints={static}", "--static-endpoints=fallback", "--log-level=info"]
    fleet = Fleet(cp)
    if fleet.state["nodes"]:
        fleet.down()
    ep_cmds = _ep_cmds()
    sampler = None
    try:
        fleet.state["lb"] = "extractedprism"
        fleet.save()
        fleet.start_controllers(STATIC_ONLY)
        names = {}
        for i, (label, cmd) in enumerate(ep_cmds.items(), 1):
            names[label] = fleet.add_node(i, "extractedprism", cmd, None, list(extra))
        observe.wait_nodes_ready(cp, fleet.nodes, timeout=120, alive=fleet.check_alive)
        sampler = observe.Sampler(cp, fleet.nodes, period=1.0).start()
        for node in fleet.nodes:
            wait_until(lambda n=node: ready_in(_node_upstreams(fleet, n), old)
                       and len(sampler.renewals.get(n, ())) >= 2,
                       2 * DEFAULT_INTERVAL + DEFAULT_TIMEOUT + 2 * RENEW + 30, interval=1.0,
                       message=f"{node}: api1-api3 discovered and ready, two renewals")
        for api in OLD:
            blackhole(cp, api)
            _blackhole_in_nodes(fleet, api)
        t_fault = time.time()
        for api in OLD:
            cp.kill(api)
        deadline = time.monotonic() + NODE_GRACE + 10
        while time.monotonic() < deadline:
            fleet.check_alive()
            if all(len([t for t in sampler.renewals.get(n, ()) if t > t_fault]) >= 3
                   for n in fleet.nodes):
                break
            time.sleep(1.0)
        t_end = time.time()
        gaps = sampler.lease_gaps(since=t_fault, until=t_end)
        first = {n: min((t for t in sampler.renewals.get(n, ()) if t > t_fault),
                        default=None) for n in fleet.nodes}
        not_ready = sampler.not_ready(since=t_fault)
        ups = {n: {a: u["state"] for a, u in _node_upstreams(fleet, n).items()}
               for n in fleet.nodes}
    finally:
        if sampler is not None:
            sampler.stop()
        for node in fleet.nodes:
            with contextlib.suppress(OSError):
                cp.request(STATIC_ONLY, f"/api/v1/nodes/{node}", method="DELETE", timeout=5)
        fleet.down()
    figs = {label: {"node": n,
                    "first_renewal_after_fault_s": r(first[n] - t_fault)
                    if first[n] is not None else None,
                    "longest_lease_gap_s": r(gaps[n]), "not_ready": not_ready.get(n, []),
                    "upstreams_at_end": ups[n]} for label, n in names.items()}
    record("stale: kubelet Lease, discovered servers die", renew_s=RENEW,
           node_grace_s=NODE_GRACE, **figs)
    n = names["this"]
    assert first[n] is not None, f"the Lease was never renewed after the fault: {figs}"
    assert not not_ready.get(n), f"{n} went NotReady: {figs}"
    assert gaps[n] < NODE_GRACE, figs


# --- (a) with a real kubelet: how long after the proxy's start until its Lease renews ------

# The node's proxy as the fleet runs it: the spec's timings (no timing flag given), with
# --static-endpoints=fallback as in the test above.
NODE = Variant("node", "fallback", DEFAULT_INTERVAL, DEFAULT_TIMEOUT)
# The kubelet's Lease controller (k8s.io/component-helpers apimachinery/lease, v1.34): a
# sync every RENEW s with 4% jitter; in a sync, a failed update is retried at once (five
# tries), then the Lease is fetched again with a backoff doubling from 200 ms to at most
# 7 s for as long as that fails, then updated. Every request goes through the heartbeat
# client, whose timeout is min(node status update frequency, lease duration) = 10 s
# (CLIENT_TIMEOUT).
RENEW_JITTER = 0.04
LEASE_MAX_BACKOFF = 7.0
PROXY_EXIT_TIMEOUT = 20.0  # the spec's 5 s shutdown on a loaded machine (scripts/chaos's)
SLOW = os.environ.get("EP_CONTROLPLANE_SLOW") == "1"


def lease_bound(v: Variant) -> float:
    """From the proxy's start to the kubelet's first Lease renewal, derived from the flags.

    By ``flow_bound(v)`` every new request through the proxy succeeds (case (a)'s bound,
    counted from the same instant, the proxy's start; the request loop's pauses in it are
    an allowance the kubelet, whose own waits are counted below, does not use). At that
    moment the Lease controller is in one of three places:

    * waiting for a request sent earlier: it ends, answered or not, within the heartbeat
      timeout (``CLIENT_TIMEOUT``). A failed update is retried at once, and succeeds; a
      failed fetch is retried after its backoff, at most ``LEASE_MAX_BACKOFF``, then the
      fetch and the update succeed;
    * sleeping in that backoff: at most ``LEASE_MAX_BACKOFF``, then the same;
    * between two syncs (the last one gave up on its five updates before traffic flowed):
      the next one starts within ``RENEW * (1 + RENEW_JITTER)`` and its update succeeds.

    The worst is the first: ``CLIENT_TIMEOUT + LEASE_MAX_BACKOFF``; the third is shorter
    (10.4 s). The fetch that then succeeds is the request flow_bound's last terms (hedge
    and answer hedge) already wait for; the renewal's time is the kubelet's own stamp,
    taken before its update is sent, so the update's own trip is not in the figure."""
    return flow_bound(v) + max(CLIENT_TIMEOUT, RENEW * (1 + RENEW_JITTER)) + LEASE_MAX_BACKOFF


def _stop_proxy(fleet: Any, node: str) -> dict[str, Any]:
    """SIGTERM to the node's proxy (its pid and process group, as scripts/chaos's
    proxy-term), SIGKILL if it has not exited within PROXY_EXIT_TIMEOUT."""
    name = f"lb-{node}"
    pid = fleet.cp.pid(name)
    t0 = time.monotonic()
    fleet.stop_proc(name, signal.SIGTERM, timeout=PROXY_EXIT_TIMEOUT)
    killed = fleet.cp.pid(name) is not None
    if killed:
        fleet.stop_proc(name, signal.SIGKILL)
    return {"pid": pid, "exit_s": r(time.monotonic() - t0), "sigkill_needed": killed}


def _kubelets_alive(fleet: Any) -> None:
    """While the proxies are down: every process but them still runs."""
    for name in fleet.proc_names():
        if not name.startswith("lb-") and fleet.cp.pid(name) is None:
            raise AssertionError(f"{name} exited; log tail:\n{fleet.log(name)[-2500:]}")


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not SLOW, reason="set EP_CONTROLPLANE_SLOW=1 (a fleet node and a moved "
                    "control plane: about 2 minutes)")
def test_kubelet_lease_after_the_control_plane_moved(moved: Any, tmp_path: Path) -> None:
    """Case (a) under a real (hollow) kubelet behind its node's extractedprism, as its
    static pod runs it (readyz with the node's certificate, discovery through its own
    listener, a state file), ``--static-endpoints=fallback`` and the spec's timings, plus
    ``--endpoints`` naming api1, api2 and the host name ``NAME`` (resolving to api3 from
    the proxy's own hosts file); the controllers talk to api4, which the node never
    knows. Once the Lease renews and the state file lists api1-api3: the node's proxy is
    stopped (SIGTERM); api1-api3 are killed and black-holed (from the machine and from
    the node's namespace), api5-api7 start on new addresses and take the slice over,
    ``NAME`` now resolves to api5; the proxy is started again.

    Figure: seconds from the proxy's start to the kubelet's first Lease renewal (bound:
    :func:`lease_bound`); whether the node went NotReady, reported, not judged: the move
    itself can take longer than the controllers' 50 s grace while the kubelet has no
    proxy. With ``EP_STALE_COMPARE_TREE``, a second node runs that checkout's proxy
    through the same move, with ``EP_STALE_COMPARE_FLAGS`` appended to its flags."""
    from tests.controlplane.conftest import fleet_why_not

    why = fleet_why_not()
    if why:
        pytest.skip(f"fleet tests: {why}")
    from epscripts.fleet import observe
    from epscripts.fleet.nodes import Fleet

    cp = moved
    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    _static_only_up(cp)
    hosts = tmp_path / "hosts"
    write_hosts(hosts, cp.ip("api3"))
    endpoints = [cp.endpoint("api1"), cp.endpoint("api2"), f"{NAME}:{cphost.PORT}"]
    old = [cp.endpoint(a) for a in OLD]
    new = [cp.endpoint(a) for a in NEW]
    extra = [f"--endpoints={','.join(endpoints)}", f"--static-endpoints={NODE.mode}",
             "--log-level=info"]
    fleet = Fleet(cp)
    if fleet.state["nodes"]:
        fleet.down()
    ep_cmds = _ep_cmds(hosts)
    bound = lease_bound(NODE)
    names: dict[str, str] = {}
    stops: dict[str, dict[str, Any]] = {}
    t_start: dict[str, float] = {}
    listening: dict[str, float] = {}
    discovered: dict[str, float | None] = {}
    sampler = None
    try:
        fleet.state["lb"] = "extractedprism"
        fleet.save()
        fleet.start_controllers(STATIC_ONLY)
        for i, (label, cmd) in enumerate(ep_cmds.items(), 1):
            flags = [*extra, *(_COMPARE_FLAGS if label == "compared" else [])]
            names[label] = fleet.add_node(i, "extractedprism", cmd, None, flags)
        observe.wait_nodes_ready(cp, fleet.nodes, timeout=120, alive=fleet.check_alive)
        # The sampler never asks the servers that will go (a black hole costs it 3 s).
        sampler = observe.Sampler(cp, fleet.nodes, period=1.0, avoid=set(OLD)).start()
        for node in fleet.nodes:
            wait_until(lambda n=node: ready_in(_node_upstreams(fleet, n), old)
                       and state_file_lists(fleet.node_dir(n) / "extractedprism.state",
                                            set(old))
                       and len(sampler.renewals.get(n, ())) >= 2,
                       2 * NODE.interval + NODE.timeout + 2 * RENEW + 30, interval=1.0,
                       message=f"{node}: api1-api3 discovered, ready and in the state "
                               "file, two renewals")

        # The proxy stops; the control plane moves while it is down.
        t_stop = time.time()
        for node in fleet.nodes:
            stops[node] = _stop_proxy(fleet, node)
        for api in OLD:
            cp.kill(api)
            blackhole(cp, api)
            _blackhole_in_nodes(fleet, api)
        for api in NEW:
            cp.add_apiserver(api)
            cp.start(api)
        moved_s = wait_serving(cp, NEW, via=NEW[0], timeout=90 + LEASE_EXPIRY_S)
        write_hosts(hosts, cp.ip(NEW[0]))
        _kubelets_alive(fleet)

        # Each node's clock starts when its proxy is started.
        for label, node in names.items():
            t_start[node] = time.time()
            fleet.start_balancer(node, "extractedprism", ep_cmds[label], None)
            listening[node] = time.time() - t_start[node]
            discovered[node] = None
        # Twice the bound: a miss is measured, not cut off; then the node Ready again.
        deadline = time.monotonic() + 2 * bound
        while time.monotonic() < deadline:
            fleet.check_alive()
            for node in fleet.nodes:
                if discovered[node] is None and ready_in(_node_upstreams(fleet, node), new):
                    discovered[node] = time.time() - t_start[node]
            last = sampler.samples[-1] if sampler.samples else None
            if (all(len([t for t in sampler.renewals.get(n, ()) if t > t_start[n]]) >= 2
                    for n in fleet.nodes)
                    and all(d is not None for d in discovered.values())
                    and last is not None and last.t > max(t_start.values())
                    and not last.not_ready):
                break
            time.sleep(1.0)
        t_end = time.time()
        load["end"] = [round(x, 2) for x in os.getloadavg()]
        gaps = sampler.lease_gaps(since=t_stop, until=t_end)
        renewed = {n: sorted(t for t in sampler.renewals.get(n, ()) if t > t_start[n])
                   for n in fleet.nodes}
        not_ready = sampler.not_ready(since=t_stop)
        # Ready again: the first sample after its last NotReady one.
        ready_again = {n: next((s.t for s in sampler.samples
                                if s.t > not_ready[n][-1][0] and n not in s.not_ready), None)
                       if not_ready.get(n) else None for n in fleet.nodes}
        ups = {n: {a: (u["state"], u["source"]) for a, u in _node_upstreams(fleet, n).items()}
               for n in fleet.nodes}
    finally:
        if sampler is not None:
            sampler.stop()
        for node in fleet.nodes:
            with contextlib.suppress(OSError):
                cp.request(STATIC_ONLY, f"/api/v1/nodes/{node}", method="DELETE", timeout=5)
        fleet.down()

    def since(t: float | None, t0: float) -> float | None:
        return None if t is None else r(t - t0)

    figs = {label: {
        "node": n, "proxy_stop": stops[n],
        "proxy_down_s": r(t_start[n] - t_stop), "proxy_listening_s": r(listening[n]),
        "first_renewal_after_start_s": since(renewed[n][0] if renewed[n] else None,
                                             t_start[n]),
        "renewals_after_start_s": [r(t - t_start[n]) for t in renewed[n][:3]],
        "bound_s": r(bound),
        "discovered_ready_s": r(discovered[n]),
        "longest_lease_gap_s": r(gaps[n]),
        "went_not_ready": bool(not_ready.get(n)),
        "not_ready_from_stop_s": since(not_ready[n][0][0], t_stop) if not_ready.get(n)
        else None,
        "not_ready_reasons": sorted({why for _, why in not_ready.get(n, [])}),
        "ready_again_after_start_s": since(ready_again[n], t_start[n]),
        "upstreams_at_end": ups[n]} for label, n in names.items()}
    record("stale: kubelet Lease after the control plane moved", renew_s=RENEW,
           node_grace_s=NODE_GRACE, moved_s=r(moved_s), load_average=load,
           compared_flags=_COMPARE_FLAGS if _COMPARE else None,
           sampler_failed_polls=sampler.failed_polls if sampler else None, **figs)
    f = figs["this"]
    assert f["first_renewal_after_start_s"] is not None, (
        f"the Lease was never renewed after the proxy's start: {figs}")
    assert f["first_renewal_after_start_s"] <= bound, (
        f"first renewal {f['first_renewal_after_start_s']}s after the proxy's start, "
        f"bound {bound:.2f}s: {figs}")
