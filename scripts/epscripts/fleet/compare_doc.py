"""docs/compare.md, rendered from scripts/compare's JSON results.

The text between ``<!-- notes -->`` and ``<!-- /notes -->`` in the existing document (a
person's reading of the figures) is kept when the document is rendered again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HOWTO = Path(__file__).with_name("compare_howto.md")  # the static part, with fields
NOTES_RX = re.compile(r"<!-- notes -->\n(.*?)<!-- /notes -->", re.S)
NAMES = {"extractedprism": "extractedprism", "haproxy": "HAProxy", "nginx": "nginx",
         "go-original": "Go original"}
FAULT_TITLES = {
    "scaleout": "Scale-out: the fleet on api1+api2, then api3 starts",
    "kill": "kill -9 of the API server carrying most kubelets (restarted 20 s later)",
    "stop": "SIGSTOP of the API server carrying most kubelets for 30 s",
    "partition": "The API server carrying most kubelets cut off from etcd for 60 s",
    "rolling": "Rolling restart: SIGTERM, exit, start, ready; api1, api2, api3",
}
# (label, function of a row -> comparable number or None, tolerance): lower is better;
# figures closer than the tolerance count as the same. Lease gaps: the kubelet renews at
# 10 s with jitter of a few hundred ms; watch and request gaps: the writer's and the
# request loop's 1 s period; skew: one connection more or less on one of ~3 per server.
METRICS: list[tuple[str, Any, float]] = [
    ("nodes NotReady", lambda r: len(r["not_ready"]), 0),
    ("longest Lease gap (s)", lambda r: r["lease_gap_max_s"], 1.0),
    ("kubelet requests failed", lambda r: sum(r["kubelet_failed"].values()), 0),
    ("longest watch gap (s)", lambda r: max(w["gap_max_s"] for w in r["watch"].values()), 1.0),
    ("watch events lost", lambda r: sum(w["lost"] for w in r["watch"].values()), 0),
    ("request loop: failed",
     lambda r: sum(w["requests_failed"] for w in r["watch"].values()), 0),
    ("request loop: longest without success (s)",
     lambda r: max(w["request_gap_max_s"] for w in r["watch"].values()), 1.0),
    ("connection skew after (max/mean)", lambda r: r["skew_after"], 0.34),
]


def _cell(lb_rows: dict[str, dict[str, Any]], lb: str, label: str, fn: Any) -> str:
    row = lb_rows.get(lb)
    if row is None:
        return "not run"
    if "error" in row:
        return "error"
    value = fn(row)
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _details(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: `{row['error'][:400]}`"
    w = row["watch"]
    nr = "; ".join(f"{n}: {', '.join(v)}" for n, v in sorted(row["not_ready"].items()))
    return "; ".join(x for x in [
        f"run {row['run']}" if row.get("run") else "",
        f"target {row['target']}",
        "watches on " + ", ".join(f"{n}->{'+'.join(a) or '?'}"
                                  for n, a in row.get("watch_apis_before", {}).items()),
        f"NotReady {nr}" if nr else "",
        "Lease gaps " + ", ".join(f"{n} {g:g}" for n, g in row["lease_gaps_s"].items()),
        "kubelet failed " + ", ".join(f"{n} {v}" for n, v in row["kubelet_failed"].items()),
        "kubelet codes " + ", ".join(f"{n} {d}" for n, d in row["kubelet_codes_delta"].items()
                                     if d),
        "watch gaps " + ", ".join(f"{n} {v['gap_max_s']:g}" for n, v in w.items()),
        "watch reconnects " + ", ".join(f"{n} {v['reconnects']}" for n, v in w.items()),
        "relists " + str(sum(v["relists"] for v in w.values())),
        "events due " + str(sum(v["events_due"] for v in w.values())),
        "request errors " + ", ".join(f"{n} {v['request_errors']}" for n, v in w.items()
                                      if v["request_errors"]),
        "connections after " + ", ".join(f"{a} {c}" for a, c in row["connections_after"].items()),
        "kubelets on " + ", ".join(f"{n}->{'+'.join(a) or '?'}"
                                   for n, a in row["kubelet_apis_after"].items()),
        "balancer RSS MiB " + ", ".join(f"{n} {v:g}" for n, v in row["lb_rss_mib"].items()),
        "balancer CPU s " + ", ".join(f"{n} {v:g}" for n, v in row["lb_cpu_s"].items())
        + f" over {row['fault_window_s']:g} s",
        f"load average mean {row['load']['mean']:g}, max {row['load']['max']:g}",
        f"writer failures {row['writer_failures']}" if row["writer_failures"] else "",
        "; ".join(row["notes"]),
    ] if x)


def _exposed(row: dict[str, Any]) -> str:
    if "error" in row:
        return "error"
    e = row.get("exposed")
    if e:
        return f"{row['target']}: {e['kubelets']} / {e['watches']} of {row['nodes']}"
    # Cells of runs before the watches' servers were recorded: the kubelets only.
    on = set(row["target"].split(","))
    kubelets = sum(1 for v in row["kubelet_apis_before"].values() if on & set(v))
    return f"{row['target']}: {kubelets} / (not recorded) of {row['nodes']}"


def _resources(row: dict[str, Any]) -> str:
    if "error" in row:
        return "error"
    rss = max(row["lb_rss_mib"].values(), default=0)
    cpu = sum(row["lb_cpu_s"].values()) / max(1, len(row["lb_cpu_s"]))
    return f"{rss:g} MiB; {cpu:.2f} s ({100 * cpu / row['fault_window_s']:.1f} %)"


def as_good(rows: dict[str, dict[str, Any]], lbs: list[str]) -> list[str]:
    """Where another balancer measured as well as extractedprism or better."""
    ours = rows.get("extractedprism")
    if not ours or "error" in ours:
        return []
    out = []
    for label, fn, tol in METRICS:
        mine = fn(ours)
        if mine is None:
            continue
        theirs = {b: fn(rows[b]) for b in lbs if b != "extractedprism" and b in rows
                  and "error" not in rows[b] and fn(rows[b]) is not None}
        better = [b for b, x in theirs.items() if x < mine - tol]
        equal = [b for b, x in theirs.items() if abs(x - mine) <= tol]
        if better:
            figs = ", ".join(f"{NAMES[b]} {theirs[b]:g}" for b in better)
            out.append(f"{label}: better through {figs} (extractedprism {mine:g})")
        if equal:
            within = f", within {tol:g}" if tol else ""
            figs = ", ".join(f"{NAMES[b]} {theirs[b]:g}" for b in equal)
            out.append(f"{label}: the same through {figs} (extractedprism {mine:g}{within})")
    return out


def portable(arg: str) -> str:
    """An argument as a reader can use it: no path of the measuring machine (a committed
    doc names none), so ``/work/main/.venv/bin/python`` -> ``.venv/bin/python`` and
    ``/tmp/fleetwork/extractedprism-go`` -> ``DIR/extractedprism-go``."""
    if not arg.startswith("/"):
        return arg
    parts = arg.split("/")
    if ".venv" in parts:
        return "/".join(parts[parts.index(".venv"):])
    return "DIR/" + parts[-1]


def render(doc: dict[str, Any], previous: str | None = None) -> str:
    lbs = doc["lbs"]
    by = {}
    for r in doc["results"]:
        by.setdefault(r["fault"], {})[r["lb"]] = r
    m = NOTES_RX.search(previous or "")
    notes = m.group(1) if m else "(no reading written yet)\n"
    v = doc["versions"]
    t = doc["timing"]
    head = "| | " + " | ".join(NAMES[b] for b in lbs) + " |\n|---|" + "---|" * len(lbs) + "\n"
    runs = doc.get("runs") or [{"started": doc["started"], "argv": doc["argv"]}]
    said = "; ".join(f"started {r['started']}: `{' '.join(portable(a) for a in r['argv'])}`"
                     for r in runs)
    out = [f"""# Node-local balancers side by side under API-server faults

Written by `scripts/compare` ({len(runs)} run{'s' if len(runs) > 1 else ''}: {said};
a later run's cells replace an earlier one's, and each cell's details say which run it
is from); the figures below are as measured, unedited. The reading between the markers
is a person's. How it works and how to run it again: [below](#how-it-runs).

<!-- notes -->
{notes}<!-- /notes -->

## Results

{doc['nodes']} hollow nodes (kubemark, docs/fleet.md), each behind its own balancer, each
with a kubectl watch and a request loop through it; one fault at a time from a healthy
fleet. Lower is better in every row. "Lease gap": the longest time between two renewals of
one node's Lease (the kubelet renews every 10 s; a node is NotReady 50 s after its last).
"Watch gap": the longest time a node's kubectl watch received no event while a writer
changed the watched ConfigMap every {t['write_period_s']:g} s (floor: that period).
"Skew": max/mean over the three API servers of the established connections from the
nodes, counted in the API servers' own namespaces at the end of the window.

"""]
    for fault in doc["faults"]:
        rows = by.get(fault, {})
        out.append(f"### {FAULT_TITLES[fault]}\n\n{head}")
        for label, fn, _ in METRICS:
            out.append(f"| {label} | " + " | ".join(_cell(rows, b, label, fn) for b in lbs)
                       + " |\n")
        out.append("| on the faulted server before: kubelets / watches | " + " | ".join(
            _exposed(rows[b]) if b in rows else "not run" for b in lbs) + " |\n")
        out.append("| balancer RSS (max); CPU per node (share of one core) | "
                   + " | ".join(_resources(rows[b]) if b in rows else "not run" for b in lbs)
                   + " |\n")
        out.append("| machine load average (mean / max) | " + " | ".join(
            (f"{rows[b]['load']['mean']:g} / {rows[b]['load']['max']:g}"
             if b in rows and "error" not in rows[b] else "-") for b in lbs) + " |\n\n")
        good = as_good(rows, lbs)
        if good:
            out.append("Another balancer as good or better here: " + "; ".join(good) + ".\n\n")
        for b in lbs:
            if b in rows:
                out.append(f"* {NAMES[b]}: {_details(rows[b])}\n")
        out.append("\n")
    missing = [f"{NAMES.get(b, b)}: {why}" for b, why in doc.get("skipped", {}).items()]
    missing += [f"{NAMES[b]} / {f}" for f in doc["faults"] for b in lbs
                if b not in by.get(f, {})]
    if missing:
        out.append("Not measured: " + "; ".join(missing) + ".\n\n")
    out.append(HOWTO.read_text().format(
        nodes=doc["nodes"], watch_min=f"{t['watch_min_s']:g}",
        kill_down=f"{t['kill_down_s']:g}", stop=f"{t['stop_s']:g}",
        stop_watch=f"{max(t['watch_min_s'], t['stop_s'] + t['after_s']):g}",
        partition=f"{t['partition_s']:g}",
        partition_watch=f"{max(t['watch_min_s'], t['partition_s'] + t['after_s']):g}",
        after=f"{t['after_s']:g}", write_period=f"{t['write_period_s']:g}",
        request_period=f"{t['request_period_s']:g}", ep=" ".join(doc["ep_recommended"]),
        v_ep=v.get("extractedprism", "?"), v_python=v.get("python", "?"),
        v_haproxy=v.get("haproxy", "not run"), v_nginx=v.get("nginx", "not run"),
        v_go=v.get("go-original", "not run"), v_kubernetes=v.get("kubernetes"),
        v_etcd=v.get("etcd"), v_kernel=v.get("kernel"), v_cpus=v.get("cpus")))
    return "".join(out)


def write(path: Path, doc: dict[str, Any]) -> None:
    previous = path.read_text() if path.exists() else None
    path.write_text(render(doc, previous))
