"""The production profile on real kubelets: a frozen or etcd-less API server costs a node
no Lease renewal beyond the targets, and a watch on it resumes elsewhere quickly.

Three kubemark hollow kubelets (the kubelet's own code: a Lease renewal every 10 s, its
HTTP/2 connections and PINGs), each behind its own extractedprism as its static pod runs
it (readyz with the node's certificate, discovery, a state file: scripts/fleet) and with
the shipped profile's values, taken from the one definition (config/profile.py), never
re-typed. On each node a kubectl watch resumed from its last resourceVersion and a
request loop run through the node's proxy, while a writer updates a ConfigMap every
second (the clients and the measurements of scripts/compare, whose cells this reuses).
The API server carrying the most kubelets (then watches) is

* frozen with SIGSTOP for 30 s (TCP still accepted by the kernel, nothing answered);
* cut off from etcd for 60 s (TLS and HTTP/2 PINGs answered, requests hang).

Targets (issue 28): no node NotReady, the longest Lease gap at most 15 s, and a watch on
the faulted server resumed within 10 s of the fault (the watch gap, whose floor is the
writer's 1 s period, at most 10 s + that period). What the chain took on each node whose
kubelet or watch was on the faulted server -- stall-triggered check, failed checks,
exclusion, unready drain, connections closed -- is read from the node's proxy log and
recorded with the figures, so a miss says which link took the time.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from extractedprism.config import profile
from tests.controlplane.conftest import fleet_why_not, record

_WHY = fleet_why_not()
if _WHY:
    pytest.skip(f"fleet tests: {_WHY}", allow_module_level=True)

from epscripts.fleet import compare  # noqa: E402 - scripts/ is on the path (conftest)
from epscripts.fleet.nodes import Fleet  # noqa: E402

# The partition target was missed in 2 of 5 runs on a loaded machine (a just-cut server
# still answers /readyz for ~3 s; watches waited a 3 s unready drain). With the stall
# check's second look and a 1 s unready drain it was met in the 3 runs since (docs/
# deploy.md); still a measurement run with EP_CONTROLPLANE_SLOW=1: the worst case (a cut
# that coincides with a Lease renewal while /readyz lags) is ~15.5 s, at the target.
pytestmark = [pytest.mark.controlplane,
              pytest.mark.skipif(os.environ.get("EP_CONTROLPLANE_SLOW") != "1",
                                 reason="set EP_CONTROLPLANE_SLOW=1 (about 5 minutes)")]

NODES = 3
LEASE_GAP_TARGET = 15.0  # issue 28: longest Lease gap on the freeze and the partition
WATCH_RESUME_TARGET = 10.0  # issue 28: a watch on the faulted server resumes within 10 s
WATCH_GAP_BOUND = WATCH_RESUME_TARGET + compare.WRITE_PERIOD  # the gap's floor: the writes
FAULTS = ("stop", "partition")
# For tuning runs only: flags appended after the profile's (they win), recorded with the
# figures, e.g. EP_PROFILE_EXTRA="--unready-drain-timeout=1s". Unset: the shipped profile.
EXTRA = os.environ.get("EP_PROFILE_EXTRA", "").split()


class TimedCell(compare.Cell):
    """compare's cell, remembering when the fault began (the target is chosen, the
    controllers moved off it, then the fault starts at once)."""

    t_fault = 0.0

    def _avoid(self, apis: set[str]) -> None:
        super()._avoid(apis)
        if apis and not self.t_fault:
            self.t_fault = time.time()


_FIELD = r'(?:"(?:[^"\\]|\\.)*"|\S+)'


def _field(line: str, key: str) -> str:
    m = re.search(rf"(?:^| ){key}=({_FIELD})", line)
    return m.group(1).strip('"') if m else ""


def chain(log: str, addr: str, t0: float, t1: float) -> list[str]:
    """The proxy's log lines about ``addr`` in [t0, t1], as ``+S.Ss what`` (what the
    stall check, the probes and the readiness rules did, in order)."""
    out = []
    for line in log.splitlines():
        if f"upstream={addr}" not in line:
            continue
        try:
            t = datetime.datetime.fromisoformat(_field(line, "ts")).timestamp()
        except ValueError:
            continue
        if not t0 - 1 <= t <= t1:
            continue
        what = _field(line, "msg")
        for key in ("result", "reason", "connections", "stalled_for", "took"):
            value = _field(line, key)
            if value:
                what += f" {key}={value}"
        out.append(f"+{t - t0:.1f}s {what}")
    return out


_KLOG = re.compile(r'^([EW])(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ [^\]]*\] "([^"]*)"'
                   r'(?: err="(.*))?')


def kubelet_errors(log: str, t0: float, t1: float) -> list[str]:
    """The kubelet's errors and warnings about its Lease and node status in [t0, t1], as
    ``+S.Ss kubelet: message (error)`` (klog's time of day, in this machine's zone)."""
    day = datetime.datetime.fromtimestamp(t0)
    out = []
    for line in log.splitlines():
        m = _KLOG.match(line)
        if not m or not re.search(r"lease|node status", m.group(5), re.I):
            continue
        clock = datetime.datetime.strptime(m.group(4)[:15], "%H:%M:%S.%f").time()
        t = datetime.datetime.combine(day.date().replace(month=int(m.group(2)),
                                                         day=int(m.group(3))), clock)
        t_s = t.timestamp()
        if t0 - 1 <= t_s <= t1:
            err = (m.group(6) or "").rstrip('"').split(": ")[-1][:100]
            out.append(f"+{t_s - t0:.1f}s kubelet: {m.group(5)} ({err})")
    return out


def first(lines: list[str], words: str) -> float | None:
    for line in lines:
        if words in line:
            return float(line.split("s ", 1)[0].lstrip("+"))
    return None


@pytest.fixture
def fleet(cluster: Any) -> Iterator[Fleet]:
    f = Fleet(cluster)
    if f.state["nodes"]:  # a crashed earlier session of this run
        f.down()
    try:
        yield f
    finally:
        f.down()
        for api in ("api1", "api2", "api3"):  # the clients' namespace, from any live server
            try:
                if cluster.request(api, f"/api/v1/namespaces/{compare.NAMESPACE}",
                                   method="DELETE", timeout=5)[0] in (200, 202, 404):
                    break
            except OSError:
                continue


@pytest.mark.timeout(1200)
def test_freeze_and_etcd_partition_with_the_shipped_profile(cluster: Any, fleet: Fleet) -> None:
    for path, body in (("/api/v1/namespaces", {"metadata": {"name": compare.NAMESPACE}}),
                       (f"/api/v1/namespaces/{compare.NAMESPACE}/configmaps",
                        {"metadata": {"name": compare.CONFIGMAP}, "data": {"seq": "0"}})):
        status, answer = cluster.request("api1", path, method="POST", body=body)
        assert status in (201, 409), (path, status, answer)
    flags = [*profile.args(), *EXTRA]
    up_s = fleet.up(NODES, "extractedprism", ep_cmd=[sys.executable, "-m", "extractedprism"],
                    lb_extra=[*flags, "--log-level=info"], controllers_api="api1",
                    timeout=compare.READY_TIMEOUT)
    rows: dict[str, dict[str, Any]] = {}
    for fault in FAULTS:
        compare.restore(cluster, fleet)
        # settle_after_s matters to the roll and the scale-out only.
        cell = TimedCell(cluster, fleet, fault, cluster.binary("kubectl"), "extractedprism",
                         compare.AFTER_S)
        row = cell.run()
        t0, t1 = cell.t_fault, time.time()
        addr = cluster.endpoint(row["target"])
        exposed = {n for n in fleet.nodes
                   if row["target"] in row["kubelet_apis_before"].get(n, [])
                   or row["target"] in row["watch_apis_before"].get(n, [])}
        row["chain"] = {n: chain(fleet.log(f"lb-{n}"), addr, t0, t1) for n in sorted(exposed)}
        row["kubelet_errors"] = {n: kubelet_errors(fleet.log(f"kubelet-{n}"), t0, t1)[:12]
                                 for n in sorted(exposed)}
        row["chain_first_s"] = {n: {
            "stall_check": first(lines, "stall check"),
            "check_failed": first(lines, "check failed"),
            "closing_stalled": first(lines, "closing stalled connections"),
            "unready_close_scheduled": first(lines, "closing its connections after drain"),
            "closed_unready": first(lines, "reason=unready"),
        } for n, lines in row["chain"].items()}
        rows[fault] = row
        watch_exposed = [n for n in fleet.nodes
                         if row["target"] in row["watch_apis_before"].get(n, [])]
        record(f"profile {fault}", profile=" ".join(flags), up_s=round(up_s, 1),
               target=row["target"], exposed=row["exposed"],
               not_ready=row["not_ready"], lease_gaps_s=row["lease_gaps_s"],
               watch_gaps_s={n: row["watch"][n]["gap_max_s"] for n in fleet.nodes},
               watch_on_target=watch_exposed,
               lost={n: row["watch"][n]["lost"] for n in fleet.nodes},
               request_failed={n: row["watch"][n]["requests_failed"] for n in fleet.nodes},
               kubelet_failed=row["kubelet_failed"], chain_first_s=row["chain_first_s"],
               chain=row["chain"], kubelet_errors=row["kubelet_errors"],
               renewals={n: [round(t - t0, 1) for t in sorted(cell.sampler.renewals.get(n, ()))
                             if t0 - 12 <= t <= t0 + 40] for n in fleet.nodes},
               load=row["load"], lb_rss_mib=row["lb_rss_mib"])
    problems = []
    for fault, row in rows.items():
        assert row["exposed"]["kubelets"] >= 1, f"{fault}: no kubelet on {row['target']}"
        if row["not_ready"]:
            problems.append(f"{fault}: nodes NotReady {row['not_ready']}")
        if row["lease_gap_max_s"] > LEASE_GAP_TARGET:
            problems.append(f"{fault}: longest Lease gap {row['lease_gap_max_s']}s > "
                            f"{LEASE_GAP_TARGET:g}s ({row['lease_gaps_s']}); chain "
                            f"{row['chain_first_s']}")
        for n in fleet.nodes:
            if row["target"] in row["watch_apis_before"].get(n, []):
                gap = row["watch"][n]["gap_max_s"]
                if gap > WATCH_GAP_BOUND:
                    problems.append(f"{fault}: {n}'s watch on {row['target']} stuck {gap}s > "
                                    f"{WATCH_GAP_BOUND:g}s; chain {row['chain'].get(n)}")
            if row["watch"][n]["lost"]:
                problems.append(f"{fault}: {n} lost {row['watch'][n]['lost']} events")
    assert not problems, "\n".join(problems)
