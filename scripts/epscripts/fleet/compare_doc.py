"""docs/compare.md, rendered from scripts/compare's JSON results.

The text between ``<!-- notes -->`` and ``<!-- /notes -->`` in the existing document (a
person's reading of the figures) is kept when the document is rendered again. Nothing of
the measuring machine is written: scripts/compare stores its results without machine
paths, and the document says the commit measured once, at the top.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HOWTO = Path(__file__).with_name("compare_howto.md")  # the static part, with fields
NOTES_RX = re.compile(r"<!-- notes -->\n(.*?)<!-- /notes -->", re.S)
# The section of a run at another size than 3 nodes (scripts/compare --nodes N), kept when
# the 3-node part is rendered again and replaced when such a run renders its own; its own
# reading between the fleet-notes markers is kept too.
FLEET_RX = re.compile(r"<!-- fleet -->\n.*?<!-- /fleet -->\n", re.S)
FLEET_NOTES_RX = re.compile(r"<!-- fleet-notes -->\n(.*?)<!-- /fleet-notes -->", re.S)
FAULTS = ("scaleout", "kill", "stop", "partition", "rolling", "upgrade")
NAMES = {"extractedprism": "extractedprism", "haproxy": "HAProxy", "nginx": "nginx",
         "go-original": "Go original",
         "extractedprism-stall": "extractedprism, spec timings + stall check",
         "extractedprism-spec": "extractedprism, spec defaults"}
BRIEF_NODES = 10  # above this many nodes a cell's details are summed up, not listed per node
OURS = "extractedprism"  # as shipped: the one the targets and the peers are compared with
PEERS = ("haproxy", "nginx", "go-original")
FAULT_TITLES = {
    "scaleout": "Scale-out: the fleet on api1+api2, then api3 starts",
    "kill": "kill -9 of the API server carrying most kubelets (restarted 20 s later)",
    "stop": "SIGSTOP of the API server carrying most kubelets for 30 s",
    "partition": "The API server carrying most kubelets cut off from etcd for 60 s",
    "rolling": "Rolling restart: SIGTERM, exit, start, ready; api1, api2, api3",
    "upgrade": "Fleet-wide upgrade of the balancer: every node's replaced in turn, with the "
               "listener handover",
}
FAULT_SHORT = {"scaleout": "scale-out", "kill": "kill -9", "stop": "SIGSTOP 30 s",
               "partition": "etcd partition 60 s", "rolling": "rolling restart",
               "upgrade": "balancer upgrade"}
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
METRIC = {label: fn for label, fn, _ in METRICS}
# Issue 28's targets for extractedprism as shipped: metric -> (what it says, the faults it
# holds on, its bound; "best peer": no more than the best of HAProxy, nginx, Go original
# in the same fault). A watch gap of at most 10 s through every node means the watch that
# was on the faulted server resumed within 10 s (the others see the writer's 1 s period).
TARGETS: dict[str, tuple[str, tuple[str, ...], float | str]] = {
    "nodes NotReady": ("no node NotReady", FAULTS, 0),
    "longest Lease gap (s)": ("longest Lease gap at most 15 s on the freeze and the partition",
                              ("stop", "partition"), 15.0),
    "longest watch gap (s)": ("a watch on the faulted server resumes within 10 s "
                              "(longest watch gap)", ("kill", "stop", "partition", "rolling"),
                              10.0),
    "request loop: failed": ("request-loop failures no more than the best peer's", FAULTS,
                             "best peer"),
    "connection skew after (max/mean)": ("connection skew at most 1.25 at the end of the "
                                         "window after the roll and the scale-out",
                                         ("scaleout", "rolling"), 1.25),
    "kubelet requests failed": ("no kubelet request failed while every balancer was "
                                "replaced", ("upgrade",), 0),
}
# Where a target's bound differs for one fault: the fleet-wide upgrade has no peer (only
# extractedprism hands its listeners over) and the issue asks for no failure at all.
TARGET_BOUND = {("request loop: failed", "upgrade"): 0}


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and "error" not in row


def _cell(lb_rows: dict[str, dict[str, Any]], lb: str, fn: Any) -> str:
    row = lb_rows.get(lb)
    if row is None:
        return "not run"
    if "error" in row:
        return "error"
    return _fmt(fn(row))


def target(fault: str, label: str, rows: dict[str, dict[str, Any]],
           ) -> tuple[str, float | None, bool | None] | None:
    """The target for ``label`` in ``fault``: (its bound as text, the figure measured
    through extractedprism as shipped, met?); None where no target holds. Figure and
    verdict are None when either side was not measured."""
    if label not in TARGETS or fault not in TARGETS[label][1]:
        return None
    bound = TARGET_BOUND.get((label, fault), TARGETS[label][2])
    ours = rows.get(OURS)
    mine = METRIC[label](ours) if _ok(ours) else None
    if bound == "best peer":
        peers = [METRIC[label](rows[b]) for b in PEERS if _ok(rows.get(b))]
        if not peers:
            return "≤ best peer (no peer measured)", mine, None
        limit = float(min(peers))
        text = f"≤ {limit:g} (best peer)"
    else:
        limit = float(bound)
        text = f"{limit:g}" if limit == 0 else f"≤ {limit:g}"
    if mine is None:
        return text, None, None
    return text, mine, mine <= limit


def _target_cell(t: tuple[str, float | None, bool | None] | None) -> str:
    if t is None:
        return ""
    text, _, met = t
    return text if met is None else f"{text}: {'met' if met else '**missed**'}"


def targets_table(by: dict[str, dict[str, dict[str, Any]]], faults: list[str]) -> str:
    """Every target against what extractedprism as shipped measured, fault by fault."""
    head = ("| target, extractedprism as shipped | " + " | ".join(FAULT_SHORT[f] for f in faults)
            + " |\n|---|" + "---|" * len(faults) + "\n")
    lines, met, total = [], 0, 0
    for label, (what, where, _) in TARGETS.items():
        if not set(where) & set(faults):
            continue  # a target of faults this run did not measure
        cells = []
        for f in faults:
            rows = by.get(f, {})
            t = target(f, label, rows)
            if t is None:
                cells.append("")
                continue
            text, mine, ok = t
            if mine is None or ok is None:
                cells.append("not measured" if mine is None else f"{_fmt(mine)} ({text})")
                continue
            total += 1
            met += bool(ok)
            peer = f" (best peer {text[2:].split(' ')[0]})" if "best peer" in text else ""
            cell = f"{_fmt(mine)}{peer}: {'met' if ok else '**missed**'}"
            ours = rows[OURS]
            if label == "longest watch gap (s)" and (ours.get("exposed") or {}).get(
                    "watches") == 0:
                cell += ", no watch was on the faulted server"
            cells.append(cell)
        lines.append(f"| {what} | " + " | ".join(cells) + " |\n")
    return head + "".join(lines) + f"\nMet: {met} of {total}.\n"


def as_good(rows: dict[str, dict[str, Any]], lbs: list[str]) -> list[tuple[str, str, str, str]]:
    """Where a peer measured as well as extractedprism as shipped or better: (metric,
    extractedprism's figure, the peers better, the peers the same within the metric's
    tolerance)."""
    ours = rows.get(OURS)
    if not _ok(ours):
        return []
    out = []
    for label, fn, tol in METRICS:
        mine = fn(ours)
        if mine is None:
            continue
        theirs = {b: fn(rows[b]) for b in lbs if b in PEERS and _ok(rows.get(b))
                  and fn(rows[b]) is not None}
        better = [b for b, x in theirs.items() if x < mine - tol]
        equal = [b for b, x in theirs.items() if abs(x - mine) <= tol]
        if better or equal:
            out.append((label, _fmt(mine),
                        ", ".join(f"{NAMES[b]} {_fmt(theirs[b])}" for b in better) or "-",
                        ", ".join(f"{NAMES[b]} {_fmt(theirs[b])}" for b in equal) or "-"))
    return out


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
        _pauses(row),
        "; ".join(row["notes"]),
    ] if x)


def _pauses(row: dict[str, Any]) -> str:
    """The machine stopped during the cell (older results have no such field)."""
    pauses = row.get("host_pauses") or []
    if not pauses:
        return ""
    return ("THE MACHINE STOPPED " + ", ".join(f"{d:g} s at {t:+g} s" for t, d in pauses)
            + " (every process, the measuring ones too: this row's gaps include it)")


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


def _line(label: str, cells: list[str], lbs: list[str], tgt: str = "") -> str:
    """A table line; the target's column right after extractedprism's, when it is shown."""
    if OURS in lbs:
        cells = list(cells)
        cells.insert(1 + lbs.index(OURS), tgt)
    return f"| {label} | " + " | ".join(cells) + " |\n"


def _columns(doc: dict[str, Any], fault: str, rows: dict[str, Any]) -> list[str]:
    """The balancers shown for ``fault``: those measured for it, or meant to be."""
    variants = doc.get("variants", {})
    return [b for b in doc["lbs"] if b in rows or b not in variants
            or fault in variants[b].get("faults", FAULTS)]


def _header(doc: dict[str, Any]) -> str:
    runs = doc.get("runs") or [{"started": doc["started"], "argv": doc["argv"],
                                "commit": doc.get("commit")}]
    commits = {r.get("commit") for r in runs}
    took = f", {round(doc['took_s'] / 60)} min" if doc.get("took_s") and len(runs) == 1 else ""

    def one(r: dict[str, Any], with_commit: bool) -> str:
        c = f" on commit {r.get('commit') or '(not recorded)'}" if with_commit else ""
        return f"started {r['started']}{c}{took}: `{' '.join(portable(a) for a in r['argv'])}`"

    if len(commits) == 1:
        said = "; ".join(one(r, False) for r in runs)
        what = (f"extractedprism at commit {next(iter(commits)) or '(not recorded)'}, "
                f"measured in {len(runs)} run{'s' if len(runs) > 1 else ''} ({said})")
    else:
        what = f"{len(runs)} runs ({'; '.join(one(r, True) for r in runs)})"
    later = ("; a later run's cells replace an earlier one's, and each cell's details say "
             "which run it is from" if len(runs) > 1 else "")
    return f"Written by `scripts/compare` from {what}{later}."


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


def share_at(row: dict[str, Any], api: str, at: float) -> float | None:
    """``api``'s share of the nodes' connections in the first sample ``at`` s or more
    after the last server was ready (None without such a sample)."""
    ready = row.get("last_ready_s")
    if ready is None:
        return None
    for ts, conns in row.get("connections_series", []):
        if ts >= ready + at:
            total = sum(conns.values())
            return round(conns.get(api, 0) / total, 2) if total else None
    return None


def _never(key: str) -> Any:
    """A figure that is None when the thing never happened in the window (and absent from
    cells of runs before it was recorded)."""
    def fn(r: dict[str, Any]) -> Any:
        if "connections_series" not in r:
            return None
        return r.get(key) if r.get(key) is not None else "never in the window"
    return fn


def survivors_cpu(row: dict[str, Any]) -> str | None:
    """The API servers not under the fault: their CPU together before it, during it, and
    the highest 5 s step of one of them in it (% of a core)."""
    cpu = row.get("server_cpu")
    if not cpu:
        return None
    hit = set(row["target"].split(","))
    rest = [v for a, v in cpu.items() if a.startswith("api") and a not in hit]

    def total(key: str) -> str:
        vals = [v[key] for v in rest if v.get(key) is not None]
        return f"{sum(vals):.0f}" if vals else "-"

    peaks = [v["peak_pct"] for v in rest if v.get("peak_pct") is not None]
    return f"{total('before_pct')} / {total('during_pct')} ({max(peaks, default=0):.0f})"


def survivors_requests(row: dict[str, Any]) -> str | None:
    """Requests/s on the API servers not under the fault over it: the kubelets' and the
    control plane's, and the probes."""
    rates = row.get("requests_per_s")
    if not rates:
        return None
    hit = set(row["target"].split(","))
    rest = [v for a, v in rates.items() if a not in hit]
    return (f"{sum(v['kubelets+control plane'] for v in rest):.1f}; "
            f"{sum(v['probes'] for v in rest):.1f}")


_STAMPEDE = [
    ("survivors' CPU together, % of a core: before / during (highest 5 s of one)",
     survivors_cpu),
    ("survivors' requests/s during: kubelets + control plane; probes", survivors_requests),
]
# Rows shown only where some cell has them (cells of earlier runs do not).
EXTRA_ROWS: dict[str, list[tuple[str, Any]]] = {
    "kill": _STAMPEDE, "stop": _STAMPEDE, "partition": _STAMPEDE,
    "rolling": [
        ("kubelets' connections: skew after (max/mean)", lambda r: r.get("kubelet_skew_after")),
        ("connection skew when the last server was ready", lambda r: r.get("skew_at_ready")),
        ("time from then until skew ≤ 1.25 for good (s)", _never("time_to_skew_s")),
    ],
    "upgrade": [
        ("new instances that took the listeners over", lambda r: None if not r.get("upgrade")
         else f"{len(r['upgrade']['took_s']) - len(r['upgrade']['not_taken'])} of "
              f"{len(r['upgrade']['took_s'])}"),
        ("the roll, node after node (s)", lambda r: (r.get("upgrade") or {}).get("roll_s")),
    ],
    "scaleout": [
        ("kubelets' connections: skew after (max/mean)", lambda r: r.get("kubelet_skew_after")),
        ("time from api3 ready until skew ≤ 1.25 for good (s)", _never("time_to_skew_s")),
        ("api3's share of connections +10 / +30 / +60 s after ready", lambda r: (
            None if "connections_series" not in r else " / ".join(
                _fmt(share_at(r, "api3", t)) for t in (10, 30, 60)))),
    ],
}


def _brief(row: dict[str, Any]) -> str:
    """A cell's details summed up over its nodes (a large fleet)."""
    if "error" in row:
        return f"error: `{row['error'][:400]}`"
    gaps = sorted(row["lease_gaps_s"].values())
    failed = {n: v for n, v in row["kubelet_failed"].items() if v}
    w = row["watch"]
    rss = list(row["lb_rss_mib"].values())
    cpu = list(row["lb_cpu_s"].values())
    nr = sorted(row["not_ready"])
    return "; ".join(x for x in [
        f"run {row['run']}" if row.get("run") else "",
        f"target {row['target']}",
        f"NotReady {len(nr)} ({', '.join(nr[:10])}{', ...' if len(nr) > 10 else ''})"
        if nr else "",
        f"Lease gaps median {gaps[len(gaps) // 2]:g}, max {gaps[-1]:g} s over {len(gaps)} nodes"
        if gaps else "",
        f"kubelet requests failed on {len(failed)} nodes, {sum(failed.values())} in all"
        if failed else "no kubelet request failed",
        f"clients on {len(w)} nodes: watch gap max "
        f"{max((v['gap_max_s'] for v in w.values()), default=0):g} s, reconnects "
        f"{sum(v['reconnects'] for v in w.values())}, relists "
        f"{sum(v['relists'] for v in w.values())}, events due "
        f"{sum(v['events_due'] for v in w.values())}, lost {sum(v['lost'] for v in w.values())}",
        "connections after " + ", ".join(f"{a} {c}" for a, c in row["connections_after"].items()),
        "kubelets after " + ", ".join(f"{a} {c}" for a, c in row.get("kubelets_after", {}).items()),
        f"balancer RSS MiB mean {sum(rss) / max(1, len(rss)):.1f}, max {max(rss, default=0):g}",
        f"balancer CPU s mean {sum(cpu) / max(1, len(cpu)):.2f}, max {max(cpu, default=0):g} "
        f"over {row['fault_window_s']:g} s",
        f"load average mean {row['load']['mean']:g}, max {row['load']['max']:g}",
        f"writer failures {row['writer_failures']}" if row["writer_failures"] else "",
        _pauses(row),
        "; ".join(row["notes"]),
    ] if x)


def _per_api(values: dict[str, Any], fmt: str = "{:g}") -> str:
    return " / ".join(fmt.format(values[a]) if values.get(a) is not None else "-"
                      for a in sorted(values))


def cost_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The quiet cell's figures of one balancer: (row label, cell)."""
    c = r["cost"]
    n = r["nodes"]
    tot = c["requests_per_s_total"]
    servers = c["servers"]
    apis = sorted(a for a in servers if a != "etcd")

    def srv(name: str, key: str, fmt: str) -> str:
        v = servers.get(name)
        return fmt.format(v[key]) if v else "-"

    def halves(fn: Any) -> str:
        return " / ".join(fn(h) for h in c.get("halves", []))

    conns = c["connections"]
    b, k = c["balancer"], c["kubelet"]

    def mm(d: dict[str, float], fmt: str) -> str:
        return f"{fmt.format(d['mean'])} ({d['max']:g})"

    probes = halves(lambda h: f"{h['requests_per_s_total']['probes']:.2f}")
    api_cpu = halves(lambda h: "{:.1f}".format(
        sum((h["servers"].get(a) or {}).get("cpu_pct", 0) for a in apis)))
    return [
        ("window (s); load average mean / max", f"{r['window_s']:g}; {r['load']['mean']:g} / "
         f"{r['load']['max']:g}"),
        ("established connections from the nodes, " + " / ".join(apis) + " (per node)",
         f"{_per_api(conns)} ({sum(conns.values()) / max(1, n):.2f})"),
        ("open watches, all / balancers' EndpointSlice discovery (sum over API servers)",
         f"{sum(c['watches'].values()):g} / {sum(c['discovery_watches'].values()):g}"),
        ("requests/s, readyz/healthz probes (sum; per node)",
         f"{tot['probes']:.2f}; {tot['probes'] / max(1, n):.3f}"),
        ("requests/s, EndpointSlice discovery (sum)", f"{tot['discovery']:.3f}"),
        ("requests/s, kubelets + control plane (sum; of which Lease PUTs / node status "
         "PATCHes)", f"{tot['kubelets+control plane']:.2f} ({tot['lease_put']:.2f} / "
         f"{tot['status_patch']:.2f})"),
        ("requests/s failed (5xx, 429)", f"{tot['failed']:g}"),
        ("API server CPU, % of a core, " + " / ".join(apis),
         " / ".join(srv(a, "cpu_pct", "{:.1f}") for a in apis)),
        ("API servers' CPU together, first half / second half (%)", api_cpu),
        ("probes/s, first half / second half", probes),
        ("API server RSS (MiB), " + " / ".join(apis),
         " / ".join(srv(a, "rss_mib", "{:.0f}") for a in apis)),
        ("etcd CPU (% of a core); RSS (MiB)",
         f"{srv('etcd', 'cpu_pct', '{:.1f}')}; {srv('etcd', 'rss_mib', '{:.0f}')}"),
        ("balancer per node: RSS MiB mean (max)", mm(b["rss_mib"], "{:.1f}")),
        ("balancer per node: threads mean (max)", mm(b["threads"], "{:.1f}")),
        ("balancer per node: CPU % of a core mean (max)", mm(b["cpu_pct"], "{:.2f}")),
        (f"all {n} balancers: CPU % of a core; RSS (MiB)",
         f"{b['cpu_pct']['mean'] * b['cpu_pct']['n']:.1f}; "
         f"{b['rss_mib']['mean'] * b['rss_mib']['n']:.0f}"),
        ("hollow kubelet per node (the fleet's own, in no balancer's row): RSS MiB mean; CPU %",
         f"{k['rss_mib']['mean']:.1f}; {k['cpu_pct']['mean']:.2f}"),
        ("nodes not Ready at the end", str(len(r["not_ready_end"]))),
    ]


def cost_section(doc: dict[str, Any], rows: dict[str, dict[str, Any]], level: str) -> str:
    """What each balancer costs the control plane at rest: one column per balancer."""
    variants = doc.get("variants", {})
    lbs = [b for b in doc["lbs"] if b in rows
           or "quiet" in variants.get(b, {}).get("faults", ["quiet"])]
    if not lbs:
        return ""
    window = doc.get("quiet_window_s", 300)
    out = [f"""{level} At rest: what each balancer costs the control plane

No fault, no extra client, no writer, no sampler: only the {doc['nodes']} hollow kubelets,
their balancers and the controllers, for {window:g} s after the fleet settled (every node
Ready, every Lease renewed twice) and {doc.get('quiet_warmup_s', 30):g} s more. Requests
by kind from each API server's own `apiserver_request_total` (scraped at the start, the
middle and the end; the scrapes are left out), open watches from its
`apiserver_longrunning_requests`; CPU, RSS and threads from `/proc` of each API server, of
etcd, of each balancer's process tree and, apart, of each hollow kubelet. Halves: the same
over each half of the window (a quiet window shows them alike).

| | """ + " | ".join(NAMES.get(b, b) for b in lbs) + " |\n|---|" + "---|" * len(lbs) + "\n"]
    cells: dict[str, list[tuple[str, str]] | None] = {
        b: cost_rows(rows[b]) if _ok(rows.get(b)) else None for b in lbs}
    labels = next(([lab for lab, _ in v] for v in cells.values() if v), [])
    for i, label in enumerate(labels):
        line = []
        for b in lbs:
            v = cells[b]
            line.append(v[i][1] if v else ("error" if b in rows else "not run"))
        out.append(f"| {label} | " + " | ".join(line) + " |\n")
    errs = [f"* {NAMES.get(b, b)}: error: `{rows[b]['error'][:400]}`" for b in lbs
            if b in rows and not _ok(rows[b])]
    out.append("\n" + "".join(e + "\n" for e in errs) + ("\n" if errs else ""))
    return "".join(out)


def _faults(doc: dict[str, Any]) -> list[str]:
    """The faults of a run (its quiet cell is no fault: cost_section)."""
    return [f for f in doc["faults"] if f in FAULTS]


def _fault_sections(doc: dict[str, Any], by: dict[str, dict[str, dict[str, Any]]],
                    level: str) -> list[str]:
    """One table per fault, balancers as columns, then the peers' table and the details
    (summed up over the nodes above BRIEF_NODES nodes)."""
    out: list[str] = []
    brief = doc["nodes"] > BRIEF_NODES
    for fault in _faults(doc):
        rows = by.get(fault, {})
        lbs = _columns(doc, fault, rows)
        names = [NAMES.get(b, b) for b in lbs]
        if OURS in lbs:
            names.insert(1 + lbs.index(OURS), "target")
        out.append(f"{level} {FAULT_TITLES[fault]}\n\n| | " + " | ".join(names) + " |\n|---|"
                   + "---|" * len(names) + "\n")
        for label, fn, _ in METRICS:
            out.append(_line(label, [_cell(rows, b, fn) for b in lbs], lbs,
                             _target_cell(target(fault, label, rows))))
        for label, fn in EXTRA_ROWS.get(fault, []):
            if any(_ok(rows.get(b)) and fn(rows[b]) is not None for b in lbs):
                out.append(_line(label, [_cell(rows, b, fn) for b in lbs], lbs))
        out.append(_line("on the faulted server before: kubelets / watches",
                         [_exposed(rows[b]) if b in rows else "not run" for b in lbs], lbs))
        out.append(_line("balancer RSS (max); CPU per node (share of one core)",
                         [_resources(rows[b]) if b in rows else "not run" for b in lbs], lbs))
        out.append(_line("machine load average (mean / max)", [
            f"{rows[b]['load']['mean']:g} / {rows[b]['load']['max']:g}"
            if _ok(rows.get(b)) else "-" for b in lbs], lbs))
        good = as_good(rows, lbs)
        if good:
            out.append("\nWhere a peer did as well as extractedprism or better:\n\n"
                       "| | extractedprism | better | as good |\n|---|---|---|---|\n")
            out.extend(f"| {a} | {b} | {c} | {d} |\n" for a, b, c, d in good)
        elif _ok(rows.get(OURS)) and any(_ok(rows.get(b)) for b in PEERS):
            out.append("\nNo peer did as well as extractedprism on any row.\n")
        out.append("\n")
        for b in lbs:
            if b in rows:
                details = _brief(rows[b]) if brief else _details(rows[b])
                out.append(f"* {NAMES.get(b, b)}: {details}\n")
        out.append("\n")
    return out


def render(doc: dict[str, Any], previous: str | None = None) -> str:
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in doc["results"]:
        by.setdefault(r["fault"], {})[r["lb"]] = r
    m = NOTES_RX.search(previous or "")
    notes = m.group(1) if m else "(no reading written yet)\n"
    v = doc["versions"]
    t = doc["timing"]
    settle = t.get("settle_after_s", t["after_s"])
    out = [f"""# Node-local balancers side by side under API-server faults

{_header(doc)}
The figures below are as measured, unedited; the reading between the markers is a
person's. How it works and how to run it again: [below](#how-it-runs).

<!-- notes -->
{notes}<!-- /notes -->

## Targets

The targets for extractedprism as the chart ships it (its production profile,
[below](#configurations)); "best peer": the fewest of HAProxy, nginx and the Go original in
the same fault.

{targets_table(by, _faults(doc)) if OURS in doc["lbs"] else "extractedprism was not run."}
## Results

{doc['nodes']} hollow nodes (kubemark, docs/fleet.md), each behind its own balancer, each
with a kubectl watch and a request loop through it; one fault at a time from a healthy
fleet. Lower is better in every row. "Lease gap": the longest time between two renewals of
one node's Lease (the kubelet renews every 10 s; a node is NotReady 50 s after its last).
"Watch gap": the longest time a node's kubectl watch received no event while a writer
changed the watched ConfigMap every {t['write_period_s']:g} s (floor: that period).
"Skew": max/mean over the three API servers of the established connections from the
nodes, counted in the API servers' own namespaces at the end of the window ({settle:g} s
after the last server is ready, for the roll and the scale-out). "As good": within 1 s for
gaps, 0.34 for skew, exactly for counts.

"""]
    if "quiet" in doc["faults"]:
        out.append(cost_section(doc, by.get("quiet", {}), "###"))
    out.extend(_fault_sections(doc, by, "###"))
    missing = [f"{NAMES.get(b, b)}: {why}" for b, why in doc.get("skipped", {}).items()]
    missing += [f"{NAMES.get(b, b)} / {f}" for f in doc["faults"]
                for b in _columns(doc, f, by.get(f, {})) if b not in by.get(f, {})]
    if missing:
        out.append("Not measured: " + "; ".join(missing) + ".\n\n")
    fleet = FLEET_RX.search(previous or "")
    if fleet:
        out.append(fleet.group(0) + "\n")
    variants = doc.get("variants", {})
    stall = " ".join(variants.get("extractedprism-stall", {}).get("extra", [])) or "(not run)"
    out.append(HOWTO.read_text().format(
        nodes=doc["nodes"], watch_min=f"{t['watch_min_s']:g}",
        kill_down=f"{t['kill_down_s']:g}", stop=f"{t['stop_s']:g}",
        stop_watch=f"{max(t['watch_min_s'], t['stop_s'] + t['after_s']):g}",
        partition=f"{t['partition_s']:g}",
        partition_watch=f"{max(t['watch_min_s'], t['partition_s'] + t['after_s']):g}",
        settle=f"{settle:g}", settle_rebalances=t.get("settle_rebalances", "-"),
        quiet=(f"{doc['quiet_window_s']:g} + {doc.get('quiet_warmup_s', 30):g}"
               if "quiet_window_s" in doc else "`--quiet-window` (300 by default) + 30"),
        write_period=f"{t['write_period_s']:g}",
        request_period=f"{t['request_period_s']:g}",
        profile=" ".join(doc.get("profile", [])) or "(not run)",
        profile_source=doc.get("profile_source") or "-", stall=stall,
        v_python=v.get("python", "?"),
        v_haproxy=v.get("haproxy", "not run"), v_nginx=v.get("nginx", "not run"),
        v_go=v.get("go-original", "not run"), v_kubernetes=v.get("kubernetes"),
        v_etcd=v.get("etcd"), v_kernel=v.get("kernel"), v_cpus=v.get("cpus")))
    return "".join(out)


def render_fleet(doc: dict[str, Any], previous: str | None = None) -> str:
    """The section of a run at fleet size, between its markers (FLEET_RX)."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in doc["results"]:
        by.setdefault(r["fault"], {})[r["lb"]] = r
    m = FLEET_NOTES_RX.search(previous or "")
    notes = m.group(1) if m else "(no reading written yet)\n"
    out = [f"""<!-- fleet -->
## At fleet size: {doc['nodes']} nodes

{_header(doc)}
Each balancer on a fresh control plane with {doc['nodes']} hollow nodes, as above; the
extra clients (a kubectl watch and a request loop) on {doc.get('client_nodes', '-')} of them,
evenly spread; Lease gaps, NotReady and the kubelets' failed requests over every node;
the nodes' connections per API server counted every 5 s (the roll's and the scale-out's
time to an even spread). The same configurations as the 3-node run
([below](#configurations)); "extractedprism, spec defaults" is the same command line
without the profile.

<!-- fleet-notes -->
{notes}<!-- /fleet-notes -->

"""]
    if "quiet" in doc["faults"]:
        out.append(cost_section(doc, by.get("quiet", {}), "###"))
    if OURS in doc["lbs"] and _faults(doc):
        out.append("### Targets at fleet size\n\n" + targets_table(by, _faults(doc)) + "\n")
    out.extend(_fault_sections(doc, by, "###"))
    missing = [f"{NAMES.get(b, b)}: {why}" for b, why in doc.get("skipped", {}).items()]
    if missing:
        out.append("Not measured: " + "; ".join(missing) + ".\n\n")
    out.append("<!-- /fleet -->\n")
    return "".join(out)


def write(path: Path, doc: dict[str, Any]) -> None:
    """Render ``doc`` into ``path``: the whole page for a 3-node run (keeping the fleet
    section), only the fleet section for a run at another size (keeping the rest)."""
    previous = path.read_text() if path.exists() else None
    if doc.get("section") != "fleet":
        path.write_text(render(doc, previous))
        return
    block = render_fleet(doc, previous)
    text = previous or ""
    if FLEET_RX.search(text):
        text = FLEET_RX.sub(lambda _m: block, text, count=1)
    elif "## How it runs" in text:
        i = text.index("## How it runs")
        text = text[:i] + block + "\n" + text[i:]
    else:
        text = text + ("\n" if text else "") + block
    path.write_text(text)
