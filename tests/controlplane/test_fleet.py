"""Real kubelets through extractedprism: hollow nodes stay Ready when an API server dies.

Three kubemark hollow kubelets (the kubelet's own code with a fake container runtime),
each in a network namespace of its own behind its own extractedprism on the node's
127.0.0.1:7445 (readyz probes with the node's client certificate, discovery, state file:
as its static pod runs it), with kube-controller-manager running the node lifecycle
controller at its default grace periods (scripts/fleet, docs/fleet.md). The API server
carrying most kubelets' connections is killed with SIGKILL; no node may go NotReady and
no node's Lease may go longer than a bound derived from the flags without a renewal.

Skipped, with one line, where the control plane cannot run or the fleet's binaries
(kubemark, kube-controller-manager, kube-scheduler) are not built: `scripts/fleet build`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.controlplane.conftest import INTERVAL, SLACK, TIMEOUT, cphost, fleet_why_not, record
from tests.util import wait_until

_WHY = fleet_why_not()
if _WHY:
    pytest.skip(f"fleet tests: {_WHY}", allow_module_level=True)

from epscripts.fleet import observe  # noqa: E402 - scripts/ is on the path (conftest)
from epscripts.fleet.nodes import Fleet  # noqa: E402

pytestmark = [pytest.mark.controlplane]

API = cphost.APISERVERS
NODES = 3
# The kubelet's side (kubemark's hollow kubelet keeps the kubelet defaults): the Lease
# lasts 40 s and is renewed every quarter of it; a heartbeat request gives up after
# min(node status update frequency 10 s, lease duration 40 s).
RENEW = 10.0
HEARTBEAT_TIMEOUT = 10.0
# kube-controller-manager v1.34 defaults: --node-monitor-grace-period 50s, checked every
# --node-monitor-period 5s. A node whose kubelet could not renew after the kill would be
# NotReady by the end of the watch below.
GRACE = 50.0
MONITOR_PERIOD = 5.0
# The proxy needs at most two probe intervals and a timeout to exclude a dead upstream
# (a refused dial fails over at once; this covers a kubelet request caught in between).
EXCLUDE = 2 * INTERVAL + TIMEOUT
# Longest time without a renewal: the renewal period, a renewal that waited out its
# timeout on a connection the kill broke, the proxy's exclusion, the stated slack.
LEASE_GAP_BOUND = RENEW + HEARTBEAT_TIMEOUT + EXCLUDE + SLACK


@pytest.fixture
def fleet(cluster: Any) -> Iterator[Fleet]:
    f = Fleet(cluster)
    if f.state["nodes"]:  # a crashed earlier session of this run
        f.down()
    try:
        yield f
    finally:
        f.down()


def test_kill_busiest_apiserver_nodes_stay_ready(cluster: Any, fleet: Fleet) -> None:
    t0 = time.monotonic()
    up_s = fleet.up(NODES, "extractedprism", ep_cmd=[sys.executable, "-m", "extractedprism"],
                    lb_extra=[f"--health-interval={INTERVAL:g}s",
                              f"--health-timeout={TIMEOUT:g}s", "--log-level=info"],
                    controllers_api="api1", timeout=90)
    sampler = observe.Sampler(cluster, fleet.nodes, period=1.0).start()
    try:
        # Steady state: every Lease renewed at least twice through its node's proxy.
        wait_until(lambda: all(len(sampler.renewals.get(n, ())) >= 2 for n in fleet.nodes),
                   2 * RENEW + 10, interval=0.5, message="two Lease renewals per node")
        # The server carrying most kubelets' own connections (matched through each node's
        # balancer on byte counts; the proxies' discovery watches are not counted).
        target, kubelet_apis = observe.busiest_for_kubelets(cluster, fleet)
        assert all(kubelet_apis.values()), f"a kubelet's upstream not found: {kubelet_apis}"
        peers = {fleet.state["nodes"][n]["ip"]: n for n in fleet.nodes}
        before = observe.connections(cluster, peers)
        if fleet.state["controllers_api"] == target:
            # The controllers must see the fault from a server that is not under it.
            fleet.move_controllers(next(a for a in API if a != target))
        sampler.avoid = {target}
        t_fault = time.time()
        cluster.kill(target)
        # Watch until a node that lost its Lease at the kill would have been marked.
        watch_s = GRACE + MONITOR_PERIOD + SLACK
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            fleet.check_alive()
            time.sleep(1.0)
        t_end = time.time()
        after = observe.connections(cluster, peers)
        kubelet_apis_after = observe.kubelet_apis(cluster, fleet)
        cluster.start(target)
        cluster.wait_ready([target], timeout=90)
    finally:
        sampler.stop()
    gaps = sampler.lease_gaps(since=t_fault, until=t_end)
    not_ready = sampler.not_ready()
    rss = {n: (fleet.rss_kib(f"lb-{n}") or 0) // 1024 for n in fleet.nodes}
    krss = {n: (fleet.rss_kib(f"kubelet-{n}") or 0) // 1024 for n in fleet.nodes}
    record("fleet kill -9", nodes=NODES, up_s=round(up_s, 1), killed=target,
           kubelet_apis_before=kubelet_apis, kubelet_apis_after=kubelet_apis_after,
           connections_before=before, connections_after=after,
           lease_gap_max_s=round(max(gaps.values()), 2),
           lease_gaps_s={n: round(g, 2) for n, g in gaps.items()},
           lease_gap_bound_s=LEASE_GAP_BOUND, not_ready=not_ready,
           failed_polls=sampler.failed_polls, proxy_rss_mib=rss, kubelet_rss_mib=krss,
           took_s=round(time.monotonic() - t0, 1))
    assert sampler.samples, "the sampler saw nothing"
    assert not not_ready, f"nodes went NotReady: {not_ready}"
    assert max(gaps.values()) <= LEASE_GAP_BOUND, (
        f"Lease renewal gaps {gaps} exceed {LEASE_GAP_BOUND:g}s "
        f"(renew {RENEW:g} + heartbeat timeout {HEARTBEAT_TIMEOUT:g} + "
        f"2I+T {EXCLUDE:g} + slack {SLACK:g})")
