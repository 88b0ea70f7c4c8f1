"""scripts/compare at fleet size: the cost accounting of the quiet cell
(epscripts.fleet.cost), the connection spread over time (time to skew), the clients'
spread over a large fleet, and the fleet section of docs/compare.md.

Pure parts on recorded figures, plus /proc of processes this test starts; nothing here
starts a control plane (the figures themselves are a run by hand, docs/compare.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from epscripts.fleet import compare, compare_doc, cost  # noqa: E402

pytestmark = pytest.mark.timeout(60)

def _series(name: str, value: float, **labels: str) -> str:
    """One sample line as kube-apiserver writes it (every label, empty ones too)."""
    keys = ("code", "component", "dry_run", "group", "resource", "scope", "subresource",
            "verb", "version")
    if name == "apiserver_longrunning_requests":
        keys = ("component", "group", "resource", "scope", "subresource", "verb", "version")
    body = ",".join(f'{k}="{labels.get(k, "")}"' for k in keys)
    return f"{name}{{{body}}} {value:g}\n"


REQ, LONG = "apiserver_request_total", "apiserver_longrunning_requests"
ES = {"group": "discovery.k8s.io", "resource": "endpointslices", "version": "v1"}
METRICS = ("# HELP apiserver_request_total [STABLE] Counter of apiserver requests\n"
           "# TYPE apiserver_request_total counter\n"
           + _series(REQ, 100, code="200", subresource="/readyz", verb="GET")
           + _series(REQ, 20, code="200", subresource="/healthz", verb="GET")
           + _series(REQ, 3, code="500", subresource="/readyz", verb="GET")
           + _series(REQ, 2, code="200", subresource="/metrics", verb="GET")
           + _series(REQ, 4, code="200", scope="namespace", verb="LIST", **ES)
           + _series(REQ, 1, code="200", scope="namespace", verb="WATCH", **ES)
           + _series(REQ, 30, code="200", scope="resource", verb="GET", **ES)
           + _series(REQ, 60, code="200", group="coordination.k8s.io", resource="leases",
                     scope="resource", verb="PUT")
           + _series(REQ, 6, code="200", resource="nodes", scope="resource",
                     subresource="status", verb="PATCH")
           + _series(REQ, 1, code="429", resource="nodes", scope="resource", verb="GET")
           + _series(LONG, 5, scope="namespace", verb="WATCH", **ES)
           + _series(LONG, 2, scope="cluster", verb="WATCH", **ES)
           + _series(LONG, 7, resource="pods", scope="cluster", verb="WATCH")
           + _series(LONG, 9, resource="pods", scope="cluster", verb="LIST")
           + 'apiserver_request_duration_seconds_count{verb="GET"} 1e6\n')


def test_requests_split_by_kind_and_watches_counted() -> None:
    snap = cost.snapshot_requests(METRICS)
    # readyz and healthz, whatever their code, are probes; the scrape is apart; the
    # namespaced EndpointSlice LIST/WATCH is the balancers' discovery, the by-name GET
    # (the API servers' own endpoint reconciler) is not.
    assert snap["kinds"] == {"probes": 123, "discovery": 5,
                             "kubelets+control plane": 30 + 60 + 6 + 1, "scrapes": 2}
    assert snap["lease_put"] == 60 and snap["status_patch"] == 6
    assert snap["failed"] == 3 + 1
    assert snap["watches"] == 5 + 2 + 7  # WATCH only, every resource
    assert snap["discovery_watches"] == 5


def test_rates_over_a_window_and_a_restarted_counter() -> None:
    a = cost.snapshot_requests(METRICS)
    b = cost.snapshot_requests(METRICS.replace("} 100\n", "} 400\n").replace("} 60\n",
                                                                               "} 10\n"))
    r = cost.request_rates(a, b, 10.0)
    assert r["probes"] == pytest.approx(30.0)
    # The Lease PUT counter went down (the server restarted): counted from zero.
    assert r["lease_put"] == pytest.approx(1.0)
    assert r["discovery"] == 0 and r["scrapes"] == 0


def test_proc_usage_of_a_tree_counts_children_and_leaves_a_wrapper_out() -> None:
    # A shell (the wrapper, named like one to skip) with a busy child.
    # The child burns 1.2 s of CPU (not of wall time: the machine may be loaded), then idles.
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time\n"
                             "while time.process_time() < 1.2: pass\n"
                             "time.sleep(60)'; true"], start_new_session=True)
    try:
        deadline = time.monotonic() + 45
        while True:
            whole = cost.proc_usage(proc.pid)
            if whole and whole["cpu_s"] >= 1.0:
                break
            assert time.monotonic() < deadline, whole
            time.sleep(0.2)
        alone = cost.proc_usage(proc.pid, tree=False)
        assert alone is not None and alone["cpu_s"] < 0.5  # the shell itself is idle
        assert whole["threads"] >= 2 and whole["rss_mib"] > alone["rss_mib"]
        no_sh = cost.proc_usage(proc.pid, skip=("sh",))
        assert no_sh is not None and no_sh["cpu_s"] == pytest.approx(whole["cpu_s"], abs=0.3)
        assert no_sh["rss_mib"] < whole["rss_mib"] and no_sh["threads"] == whole["threads"] - 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the shell and its child, started by us
        proc.wait(10)
    assert cost.proc_usage(proc.pid) is None
    assert cost.proc_usage(None) is None


def _snap(t: float, probes: float, api_cpu: float, lb_cpu: float, conns: dict) -> dict:
    req = cost.snapshot_requests(METRICS.replace("} 100\n", f"}} {probes}\n"))
    procs = {"api1": {"cpu_s": api_cpu, "rss_mib": 300.0, "threads": 20},
             "api2": {"cpu_s": api_cpu / 2, "rss_mib": 290.0, "threads": 20},
             "api3": None, "etcd": {"cpu_s": 1.0, "rss_mib": 80.0, "threads": 12}}
    for i, node in enumerate(("n1", "n2")):
        procs[f"lb-{node}"] = {"cpu_s": lb_cpu * (i + 1), "rss_mib": 30.0 + i, "threads": 8 + i}
        procs[f"kubelet-{node}"] = {"cpu_s": 5 * lb_cpu, "rss_mib": 77.0, "threads": 15}
    return {"t": t, "requests": {"api1": req, "api2": req}, "procs": procs, "conns": conns}


def test_window_figures_whole_and_halves_and_the_fleet_kept_apart() -> None:
    snaps = [_snap(0, 100, 10, 0, {"api1": 4, "api2": 2, "api3": 0}),
             _snap(50, 600, 15, 1, {"api1": 4, "api2": 2, "api3": 0}),
             _snap(100, 1100, 30, 2, {"api1": 3, "api2": 3, "api3": 0})]
    f = cost.window_figures(snaps, ["api1", "api2", "api3"], ["n1", "n2"])
    assert f["requests_per_s"]["api1"]["probes"] == pytest.approx(10.0)
    assert f["requests_per_s_total"]["probes"] == pytest.approx(20.0)
    assert f["servers"]["api1"]["cpu_pct"] == pytest.approx(20.0)
    assert f["servers"]["api3"] is None  # not running: no figure, no crash
    assert [h["servers"]["api1"]["cpu_pct"] for h in f["halves"]] == [10.0, 30.0]
    # Balancers: n1 2 s, n2 4 s over 100 s; the kubelets (10, 20 s) only in their own row.
    assert f["balancer"]["cpu_pct"] == {"n": 2, "mean": 3.0, "min": 2.0, "max": 4.0}
    assert f["balancer"]["threads"]["max"] == 9
    assert f["kubelet"]["cpu_pct"]["mean"] == pytest.approx(10.0)
    assert f["connections"] == {"api1": 3, "api2": 3, "api3": 0}
    assert f["discovery_watches"] == {"api1": 5, "api2": 5}


def test_time_to_skew_is_from_the_ready_time_until_it_stays_even() -> None:
    even, bad = {"api1": 10, "api2": 10, "api3": 10}, {"api1": 15, "api2": 15, "api3": 0}
    series = [(0.0, bad), (5.0, bad), (10.0, even), (15.0, bad), (20.0, even), (25.0, even)]
    assert compare.skew(bad) == 1.5 and compare.skew(even) == 1.0
    assert compare.skew({"api1": 0, "api2": 0}) is None
    # Even at 10 s but not for good: from 20 s on.
    assert compare.time_to_skew(series, 3.0, 1.25) == 17.0
    assert compare.skew_at(series, 3.0) == 1.5
    assert compare.time_to_skew(series[:4], 3.0, 1.25) is None
    assert compare.time_to_skew(series, 30.0, 1.25) is None


def test_clients_spread_over_a_large_fleet() -> None:
    nodes = [f"n{i}" for i in range(1, 101)]
    picked = compare.pick_spread(nodes, 10)
    assert picked == [f"n{i}" for i in range(1, 101, 10)]
    assert compare.pick_spread(nodes[:3], 10) == nodes[:3]
    assert compare.pick_spread(nodes, 0) == []


def _quiet_row(lb: str, probes: float) -> dict:
    snaps = [_snap(0, 100, 10, 0, {"api1": 4, "api2": 2, "api3": 0}),
             _snap(50, 100 + 50 * probes, 15, 1, {"api1": 4, "api2": 2, "api3": 0}),
             _snap(100, 100 + 100 * probes, 30, 2, {"api1": 3, "api2": 3, "api3": 0})]
    return {"fault": "quiet", "lb": lb, "nodes": 2, "settle_s": 20.0, "window_s": 100.0,
            "warmup_s": 30, "cost": cost.window_figures(snaps, ["api1", "api2", "api3"],
                                                        ["n1", "n2"]),
            "not_ready_end": [], "load": {"mean": 1.5, "max": 2.0},
            "load_halves": [{"mean": 1.4, "max": 2.0}, {"mean": 1.6, "max": 1.9}],
            "cell_s": 150.0}


def _fleet_doc(results: list[dict], **kw: object) -> dict:
    doc = {"started": "2026-12-04 00:00 UTC", "argv": ["scripts/compare", "--nodes", "100"],
           "commit": "0123456789ab", "section": "fleet", "nodes": 100,
           "faults": ["quiet"], "lbs": ["extractedprism", "haproxy", "extractedprism-spec"],
           "skipped": {}, "quiet_window_s": 100, "quiet_warmup_s": 30, "client_nodes": 10,
           "variants": {"extractedprism-spec": {"kind": "extractedprism", "extra": [],
                                                "faults": ["quiet"]}},
           "results": results}
    doc.update(kw)
    return doc


def test_fleet_section_goes_beside_the_3_node_page_and_survives_its_rendering(
        tmp_path: Path) -> None:
    """A fleet run writes only its section (before "How it runs"), keeps its own reading;
    a later 3-node rendering keeps the fleet section; another fleet run replaces it."""
    page = tmp_path / "compare.md"
    main = json.loads((SCRIPTS.parent / "docs" / "compare.json").read_text())
    compare_doc.write(page, main)
    before = page.read_text()
    fleet = _fleet_doc([_quiet_row("extractedprism", 20.0), _quiet_row("haproxy", 4.0)])
    compare_doc.write(page, fleet)
    text = page.read_text()
    assert text.count("<!-- fleet -->") == 1
    assert text.index("## At fleet size: 100 nodes") < text.index("## How it runs")
    assert text.replace(text[text.index("<!-- fleet -->"):text.index("<!-- /fleet -->\n")
                             + len("<!-- /fleet -->\n") + 1], "") == before
    sec = text[text.index("### At rest"):]
    assert "| | extractedprism | HAProxy | extractedprism, spec defaults |" in sec
    # Per node: the cell's own 2 nodes.
    assert "| requests/s, readyz/healthz probes (sum; per node) | 40.00; 20.000 | 8.00; 4.000 " \
           "| not run |" in sec
    assert "| API servers' CPU together, first half / second half (%) | 15.0 / 45.0 |" in sec
    page.write_text(text.replace("(no reading written yet)", "The fleet's reading.", 1))
    compare_doc.write(page, main)  # the 3-node part again
    again = page.read_text()
    assert "The fleet's reading." in again and again.count("<!-- fleet -->") == 1
    compare_doc.write(page, _fleet_doc([_quiet_row("haproxy", 2.0)]))
    last = page.read_text()
    assert last.count("## At fleet size") == 1 and "The fleet's reading." in last
    assert "| 4.00; 2.000 |" in last and "40.00; 20.000" not in last


def test_fleet_fault_details_are_summed_over_nodes() -> None:
    row = {"fault": "rolling", "lb": "extractedprism", "target": "api1,api2,api3",
           "not_ready": {}, "lease_gaps_s": {f"n{i}": 10.0 + i / 100 for i in range(1, 51)},
           "lease_gap_max_s": 10.5, "kubelet_failed": {"n1": 2, "n2": 0},
           "kubelet_codes_delta": {}, "watch": {"n1": {
               "gap_max_s": 1.5, "lost": 0, "requests_failed": 0, "request_gap_max_s": 1.0,
               "reconnects": 1, "relists": 0, "events_due": 80, "request_errors": {}}},
           "connections_after": {"api1": 50, "api2": 50, "api3": 50},
           "kubelets_after": {"api1": 17, "api2": 17, "api3": 16}, "skew_after": 1.0,
           "kubelet_apis_before": {}, "kubelet_apis_after": {}, "nodes": 50,
           "lb_rss_mib": {"n1": 30.0, "n2": 32.0}, "lb_cpu_s": {"n1": 1.0, "n2": 3.0},
           "fault_window_s": 100.0, "load": {"mean": 5.0, "max": 7.0}, "writer_failures": 0,
           "notes": ["api1: exited 5.0s after SIGTERM"], "kubelet_skew_after": 1.02,
           "connections_series": [[0.0, {"api1": 75, "api2": 75, "api3": 0}],
                                  [60.0, {"api1": 60, "api2": 60, "api3": 30}],
                                  [90.0, {"api1": 50, "api2": 50, "api3": 50}]],
           "last_ready_s": 55.0, "skew_at_ready": 1.2, "time_to_skew_s": 5.0}
    brief = compare_doc._brief(row)
    assert "Lease gaps median 10.26, max 10.5 s over 50 nodes" in brief
    assert "kubelet requests failed on 1 nodes, 2 in all" in brief
    assert "balancer CPU s mean 2.00, max 3" in brief and "n2 32" not in brief
    doc = _fleet_doc([row], faults=["rolling"], lbs=["extractedprism"], nodes=50)
    text = compare_doc.render_fleet(doc)
    assert "| time from then until skew ≤ 1.25 for good (s) | 5 |" in text
    assert "| kubelets' connections: skew after (max/mean) | 1.02 |" in text
    assert "### Targets at fleet size" in text and "| no node NotReady | 0: met |" in text
    assert compare_doc.share_at(row, "api3", 10) == pytest.approx(0.33, abs=0.01)


def test_survivors_cpu_before_during_and_peak_over_a_fault() -> None:
    # api1 at 10 % before the fault (t 100..), 50 % over one 5 s step in it; api2
    # restarted in it (its counter went down): that step is left out.
    series = [(90.0, {"api1": 1.0, "api2": 5.0}), (95.0, {"api1": 1.5, "api2": 5.5}),
              (100.0, {"api1": 2.0, "api2": 6.0}), (105.0, {"api1": 4.5, "api2": 0.2}),
              (110.0, {"api1": 5.0, "api2": 0.7}), (115.0, {"api1": 5.5, "api2": None})]
    out = compare.cpu_peaks(series, 100.0, 115.0)
    assert out["api1"] == {"before_pct": 10.0, "during_pct": 23.3, "peak_pct": 50.0}
    assert out["api2"] == {"before_pct": 10.0, "during_pct": 10.0, "peak_pct": 10.0}


def test_a_3_node_page_with_a_quiet_cell_shows_it_as_cost_not_as_a_fault(tmp_path: Path) -> None:
    main = json.loads((SCRIPTS.parent / "docs" / "compare.json").read_text())
    main["faults"] = ["scaleout", "quiet", *main["faults"][1:]]
    main["results"].append(_quiet_row("extractedprism", 2.4))
    page = tmp_path / "compare.md"
    compare_doc.write(page, main)
    text = page.read_text()
    assert "### At rest: what each balancer costs the control plane" in text
    assert "| target, extractedprism as shipped | scale-out | kill -9 |" in text
    assert "quiet" not in text.split("## Targets")[1].split("## Results")[0]


def test_which_balancer_takes_which_fault() -> None:
    faults = list(compare.FAULTS)
    assert compare.faults_for("extractedprism", faults) == faults
    # Only extractedprism hands its listeners over; the variants keep their own faults.
    assert compare.faults_for("haproxy", faults) == [f for f in faults if f != "upgrade"]
    assert compare.faults_for("extractedprism-spec", faults) == ["quiet"]
    assert compare.faults_for("extractedprism-stall", faults) == ["stop", "partition"]
    assert compare.faults_for("nginx", faults, {"nginx"}) == ["quiet"]
    assert compare.faults_for("nginx", ["rolling"], {"nginx"}) == []


def _fault_row(fault: str, **kw: object) -> dict:
    row = {"fault": fault, "lb": "extractedprism", "target": "api2", "not_ready": {},
           "lease_gaps_s": {"n1": 10.4}, "lease_gap_max_s": 10.4, "kubelet_failed": {"n1": 0},
           "kubelet_codes_delta": {}, "watch": {"n1": {
               "gap_max_s": 1.1, "lost": 0, "requests_failed": 0, "request_gap_max_s": 1.0,
               "reconnects": 0, "relists": 0, "events_due": 60, "request_errors": {}}},
           "connections_after": {"api1": 5, "api2": 5, "api3": 5}, "skew_after": 1.0,
           "kubelet_apis_before": {"n1": ["api2"]}, "kubelet_apis_after": {"n1": ["api1"]},
           "nodes": 20, "lb_rss_mib": {"n1": 31.0}, "lb_cpu_s": {"n1": 1.0},
           "fault_window_s": 65.0, "load": {"mean": 4.0, "max": 5.0}, "writer_failures": 0,
           "notes": [], "connections_series": []}
    row.update(kw)
    return row


def test_stampede_on_the_survivors_and_the_upgrade_targets() -> None:
    stop = _fault_row("stop", server_cpu={
        "api1": {"before_pct": 10.0, "during_pct": 30.0, "peak_pct": 55.0},
        "api2": {"before_pct": 10.0, "during_pct": 0.0, "peak_pct": 0.0},
        "api3": {"before_pct": 12.0, "during_pct": 20.0, "peak_pct": 40.0},
        "etcd": {"before_pct": 5.0, "during_pct": 6.0, "peak_pct": 9.0}},
        requests_per_s={a: {"kubelets+control plane": 4.0, "probes": 2.0}
                        for a in ("api1", "api2", "api3")})
    assert compare_doc.survivors_cpu(stop) == "22 / 50 (55)"  # api2 and etcd left out
    assert compare_doc.survivors_requests(stop) == "8.0; 4.0"
    up = _fault_row("upgrade", target="every balancer", kubelet_failed={"n1": 1},
                    upgrade={"took_s": {"n1": 0.8, "n2": None}, "not_taken": ["n2"],
                             "killed": [], "roll_s": 9.0})
    doc = _fleet_doc([stop, up], faults=["stop", "upgrade"], lbs=["extractedprism"], nodes=20)
    text = compare_doc.render_fleet(doc)
    assert "| survivors' CPU together, % of a core: before / during (highest 5 s of one) " \
           "| 22 / 50 (55) |" in text
    # No peer hands its listeners over: the upgrade's bounds are absolute (0 failures).
    assert "| no kubelet request failed while every balancer was replaced |  | 1: **missed** |" \
        in text
    # The freeze without a peer in this run: shown, not judged.
    assert "| request-loop failures no more than the best peer's " \
           "| 0 (≤ best peer (no peer measured)) | 0: met |" in text
    assert "| new instances that took the listeners over | 1 of 2 |" in text


def test_upgrade_surge_is_one_node_in_a_small_fleet_five_percent_in_a_large() -> None:
    assert [compare.upgrade_surge(n) for n in (1, 3, 10, 39, 40, 100)] == [1, 1, 1, 1, 2, 5]


def test_scale_model_projects_per_node_costs_against_the_baseline() -> None:
    from epscripts.fleet import scale

    ours, base = _quiet_row("extractedprism", 20.0), _quiet_row("nginx", 0.0)
    base["cost"]["servers"] = {"api1": {"cpu_pct": 10.0}, "api2": {"cpu_pct": 5.0},
                               "api3": None, "etcd": {"cpu_pct": 1.0}}
    c = scale.per_node(ours, base)  # 2 nodes: API servers 20 + 10 %, etcd 2 %
    assert c["probes_per_s"] == pytest.approx(20.0)  # 20/s on each of 2 servers, 2 nodes
    assert c["connections"] == pytest.approx(3.0) and c["watches"] == pytest.approx(5.0)
    assert c["api_cpu_added_cores"] == pytest.approx((0.30 - 0.15) / 2)
    p = scale.project(c, 600, servers=3)
    assert p["probes_per_s"] == pytest.approx(20.0 * 200)
    assert p["api_cpu_added_cores"] == pytest.approx(0.075 * 200)
    assert p["lb_rss_gib_fleet"] == pytest.approx(30.5 * 600 / 1024)
    # 5,000 nodes at 1.5 ms a probe within 0.25 cores: 30 s; a small fleet: the floor.
    assert scale.interval_for(5000, 3, 0.0015, 0.25) == pytest.approx(30.0)
    assert scale.interval_for(100, 3, 0.0015, 0.25) == 5.0
    text = scale.markdown(_fleet_doc([ours, base], lbs=["extractedprism", "nginx"]))
    assert "| probes/s (to all API servers) | 20.000 | 0.000 |" in text
    assert "At 5,000 nodes, per API server (3 API servers):" in text
