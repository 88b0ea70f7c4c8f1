"""The model of docs/scale.md: what each balancer costs the control plane at N nodes,
from the per-node costs a quiet cell measured (``scripts/compare --nodes N --faults quiet``,
docs/compare-fleet.json).

    PYTHONPATH=scripts python3 -m epscripts.fleet.scale [docs/compare-fleet.json]

prints the per-node figures and the projection to 500, 1,000 and 5,000 nodes as markdown.

What scales with the number of nodes N (S API servers, each node's balancer spreading
evenly over them), per API server:

* probes/s = (probes/s per node measured) x N / S: every node probes every server once
  per interval, so per node it is S / I and per server N / I;
* established connections = (connections per node measured) x N / S;
* the balancers' EndpointSlice watches = (watches per node measured) x N / S;
* CPU (cores) the balancer adds = ((API servers' CPU through it) - (through the baseline
  balancer, nginx: no probe, no discovery, one connection per node, as a bare TCP
  forwarder)) / N0 x N / S, N0 the measured fleet; and the same for etcd (one etcd);
* per node, the balancer's own RSS, threads and CPU do not depend on N.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SIZES = (500, 1000, 5000)
BASELINE = "nginx"  # forwards bytes only: no probe, no watch of its own
NAMES = {"extractedprism": "extractedprism as shipped", "extractedprism-spec":
         "extractedprism, spec defaults", "haproxy": "HAProxy", "nginx": "nginx",
         "go-original": "Go original"}


def per_node(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float]:
    """One balancer's quiet cell as costs per node (and, against ``base``, the API
    servers' and etcd's CPU it adds per node, in cores)."""
    c = row["cost"]
    n = row["nodes"]
    apis = [a for a in c["servers"] if a != "etcd"]

    def api_cpu(r: dict[str, Any]) -> float:
        return sum((r["cost"]["servers"].get(a) or {}).get("cpu_pct", 0.0) for a in apis) / 100

    def etcd_cpu(r: dict[str, Any]) -> float:
        return (r["cost"]["servers"].get("etcd") or {}).get("cpu_pct", 0.0) / 100

    out = {
        "nodes": n,
        "servers": len(apis),
        "probes_per_s": c["requests_per_s_total"]["probes"] / n,
        "connections": sum(c["connections"].values()) / n,
        "watches": sum(c["discovery_watches"].values()) / n,
        "api_cpu_cores": api_cpu(row) / n,
        "etcd_cpu_cores": etcd_cpu(row) / n,
        "lb_rss_mib": c["balancer"]["rss_mib"]["mean"],
        "lb_threads": c["balancer"]["threads"]["mean"],
        "lb_cpu_cores": c["balancer"]["cpu_pct"]["mean"] / 100,
    }
    if base is not None:
        out["api_cpu_added_cores"] = (api_cpu(row) - api_cpu(base)) / n
        out["etcd_cpu_added_cores"] = (etcd_cpu(row) - etcd_cpu(base)) / n
    return out


def project(costs: dict[str, float], nodes: int, servers: int = 3) -> dict[str, float]:
    """Per API server at ``nodes`` nodes (and ``servers`` API servers); per node figures
    stay what they are."""
    share = nodes / servers
    out = {"probes_per_s": costs["probes_per_s"] * share,
           "connections": costs["connections"] * share,
           "watches": costs["watches"] * share,
           "lb_cpu_cores_fleet": costs["lb_cpu_cores"] * nodes,
           "lb_rss_gib_fleet": costs["lb_rss_mib"] * nodes / 1024}
    if "api_cpu_added_cores" in costs:
        out["api_cpu_added_cores"] = costs["api_cpu_added_cores"] * share
        out["etcd_cpu_added_cores"] = costs["etcd_cpu_added_cores"] * nodes
    return out


def probe_cpu(a: dict[str, float], b: dict[str, float]) -> float | None:
    """API-server CPU seconds per probe from two balancers that differ (mostly) in their
    probe rate (``per_node`` of each): the CPU difference over the probe-rate difference;
    None when the rates are the same."""
    dp = a["probes_per_s"] - b["probes_per_s"]
    if abs(dp) < 1e-9:
        return None
    return (a["api_cpu_cores"] - b["api_cpu_cores"]) / dp


def interval_for(nodes: int, servers: int, probe_cpu_s: float, budget_cores: float,
                 floor_s: float = 5.0) -> float:
    """The shortest probe interval that keeps every API server's probe CPU within
    ``budget_cores``: each server answers nodes / I probes a second at ``probe_cpu_s``."""
    del servers  # every node probes every server: the per-server rate is N / I for any S
    return max(floor_s, nodes * probe_cpu_s / budget_cores)


# The rows of each projected table: (label, figure of a projection).
PROJECTED: list[tuple[str, Any]] = [
    ("probes/s", lambda p: f"{p['probes_per_s']:.0f}"),
    ("established connections from the nodes", lambda p: f"{p['connections']:.0f}"),
    ("balancers' EndpointSlice watches", lambda p: f"{p['watches']:.0f}"),
    ("CPU added against nginx (cores)",
     lambda p: f"{p['api_cpu_added_cores']:.2f}" if "api_cpu_added_cores" in p else "-"),
    ("the whole fleet's balancers: CPU (cores); RSS (GiB)",
     lambda p: f"{p['lb_cpu_cores_fleet']:.1f}; {p['lb_rss_gib_fleet']:.0f}"),
]


def markdown(doc: dict[str, Any]) -> str:
    rows = {r["lb"]: r for r in doc["results"] if r.get("fault") == "quiet" and "error" not in r}
    base = rows.get(BASELINE)
    lbs = [b for b in doc["lbs"] if b in rows]
    costs = {b: per_node(rows[b], base) for b in lbs}
    head = "| | " + " | ".join(NAMES.get(b, b) for b in lbs) + " |\n|---|" + "---|" * len(lbs)
    lines = [f"Per node, measured at {doc['nodes']} nodes (quiet cell of the run of "
             f"{doc['started']}):\n", head]

    def line(label: str, fn: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(costs[b]) for b in lbs) + " |")

    line("probes/s (to all API servers)", lambda c: f"{c['probes_per_s']:.3f}")
    line("established connections to the API servers", lambda c: f"{c['connections']:.2f}")
    line("EndpointSlice watches", lambda c: f"{c['watches']:.2f}")
    line("API servers' CPU per node, all of it (millicores)",
         lambda c: f"{1000 * c['api_cpu_cores']:.2f}")
    line(f"API servers' CPU per node added against {NAMES[BASELINE]} (millicores)",
         lambda c: f"{1000 * c['api_cpu_added_cores']:.2f}" if "api_cpu_added_cores" in c
         else "-")
    line("etcd CPU per node added (millicores)",
         lambda c: f"{1000 * c['etcd_cpu_added_cores']:.3f}" if "etcd_cpu_added_cores" in c
         else "-")
    line("balancer RSS (MiB); threads; CPU (millicores)",
         lambda c: f"{c['lb_rss_mib']:.1f}; {c['lb_threads']:.0f}; {1000 * c['lb_cpu_cores']:.2f}")
    pairs = [("extractedprism", "extractedprism-spec"), ("haproxy", BASELINE)]
    for a, b in pairs:
        if a in costs and b in costs:
            c = probe_cpu(costs[a], costs[b])
            lines.append(f"\nAPI-server CPU per probe from {NAMES[a]} against {NAMES[b]}: "
                         + (f"{1000 * c:.2f} ms" if c is not None else "-"))
    for n in SIZES:
        lines += ["", f"At {n:,} nodes, per API server (3 API servers):", "", head]
        proj = {b: project(costs[b], n) for b in lbs}
        for label, fn in PROJECTED:
            lines.append(f"| {label} | " + " | ".join(fn(proj[b]) for b in lbs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "docs/compare-fleet.json")
    sys.stdout.write(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
