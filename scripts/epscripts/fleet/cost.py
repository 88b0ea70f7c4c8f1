"""What a fleet's balancers cost the control plane, at rest (``scripts/compare --faults quiet``).

Over a quiet window (no fault, no extra clients, no writer, no sampler: only the hollow
kubelets, their balancers and the controllers), read from outside the balancers:

* each API server's own ``apiserver_request_total`` (scraped from ``/metrics`` at the
  start, the middle and the end), split by kind (:func:`kind_of`): the balancers' readyz
  and healthz probes, their EndpointSlice discovery (namespaced LIST/WATCH of
  EndpointSlices: the controllers' and the API servers' own EndpointSlice requests are
  cluster-scoped or by name), the scrapes themselves, and the rest (the kubelets', the
  controllers' and the API servers' own; Lease PUTs and node status PATCHes counted
  apart); the open watches (``apiserver_longrunning_requests{verb="WATCH"}``);
* the established connections on each API server's port from the nodes' addresses;
* CPU seconds (``utime + stime``), RSS and threads of each API server and of etcd
  (``/proc/PID``), and per node the same for the balancer's process tree and, apart, for
  its hollow kubelet (the fleet's own cost, never in a balancer's column).

Each figure is taken over both halves of the window too, so a reader can see whether the
window was quiet (the halves agree) or not. Pure parts (parsing, kinds, rates, the
summary) are tested in tests/process/test_fleet_cost.py.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The kinds of request, in the order the document shows them.
KINDS = ("probes", "discovery", "kubelets+control plane", "scrapes")
PROBE_PATHS = ("/readyz", "/healthz", "/livez")
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<v>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, names: Iterable[str]) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the metrics ``names`` in a Prometheus text exposition."""
    want = set(names)
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m or m.group("name") not in want:
            continue
        with contextlib.suppress(ValueError):
            out.append((m.group("name"), dict(_LABEL.findall(m.group("labels") or "")),
                        float(m.group("v"))))
    return out


def kind_of(labels: dict[str, str]) -> str:
    """The kind of an ``apiserver_request_total`` series (its labels)."""
    resource, sub = labels.get("resource", ""), labels.get("subresource", "")
    if not resource:
        if sub.startswith(PROBE_PATHS):
            return "probes"
        if sub == "/metrics":
            return "scrapes"
        return "kubelets+control plane"
    if resource == "endpointslices" and labels.get("scope") == "namespace":
        return "discovery"
    return "kubelets+control plane"


def snapshot_requests(text: str) -> dict[str, Any]:
    """One API server's counters: requests by kind, Lease PUTs, node-status PATCHes,
    failed requests (5xx, 429), and its open watches (all, and the discovery ones)."""
    kinds = dict.fromkeys(KINDS, 0.0)
    lease_put = status_patch = failed = 0.0
    watches = discovery_watches = 0.0
    for name, lab, v in parse_metrics(text, ("apiserver_request_total",
                                             "apiserver_longrunning_requests")):
        if name == "apiserver_longrunning_requests":
            if lab.get("verb") == "WATCH":
                watches += v
                if lab.get("resource") == "endpointslices" and lab.get("scope") == "namespace":
                    discovery_watches += v
            continue
        kinds[kind_of(lab)] += v
        if lab.get("resource") == "leases" and lab.get("verb") == "PUT":
            lease_put += v
        if lab.get("resource") == "nodes" and lab.get("subresource") == "status" \
                and lab.get("verb") == "PATCH":
            status_patch += v
        code = lab.get("code", "")
        if code.startswith("5") or code == "429":
            failed += v
    return {"kinds": kinds, "lease_put": lease_put, "status_patch": status_patch,
            "failed": failed, "watches": watches, "discovery_watches": discovery_watches}


def request_rates(before: dict[str, Any], after: dict[str, Any], seconds: float,
                  ) -> dict[str, float]:
    """Requests per second by kind (and Lease PUTs, status PATCHes, failures) between two
    :func:`snapshot_requests` of one API server; a counter that went down (a restart) counts
    from zero."""
    def d(a: float, b: float) -> float:
        return (b - a if b >= a else b) / seconds

    out = {k: round(d(before["kinds"][k], after["kinds"][k]), 3) for k in KINDS}
    for k in ("lease_put", "status_patch", "failed"):
        out[k] = round(d(before[k], after[k]), 3)
    return out


# --- /proc ---------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    for _ in range(1000):  # bounded: a process tree here has a handful of members
        if not todo:
            break
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def proc_usage(pid: int | None, tree: bool = True, skip: tuple[str, ...] = ("unshare",),
               ) -> dict[str, float] | None:
    """CPU seconds (utime + stime), RSS (MiB) and threads of a process (and its
    descendants), leaving out wrappers named in ``skip`` (the balancers' PID-namespace
    ``unshare``) for RSS and threads; None when it is gone."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    cpu = rss = threads = 0.0
    seen = False
    for p in [pid, *(_descendants(pid) if tree else [])]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            seen = True
            if status[0].split()[-1] in skip:
                continue
            for line in status:
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
    return {"cpu_s": cpu, "rss_mib": rss, "threads": threads} if seen else None


# --- the figures -------------------------------------------------------------------------


def spread(values: Iterable[float]) -> dict[str, float]:
    vals = sorted(values)
    if not vals:
        return {"n": 0, "mean": 0.0, "min": 0.0, "max": 0.0}
    return {"n": len(vals), "mean": round(sum(vals) / len(vals), 3),
            "min": round(vals[0], 3), "max": round(vals[-1], 3)}


def process_figures(a: dict[str, dict[str, float] | None], b: dict[str, dict[str, float] | None],
                    seconds: float) -> dict[str, dict[str, float] | None]:
    """Per process name: CPU as a share of one core over [a, b], RSS and threads at b."""
    out: dict[str, dict[str, float] | None] = {}
    for name, end in b.items():
        start = a.get(name)
        if end is None or start is None:
            out[name] = None
            continue
        out[name] = {"cpu_pct": round(100 * max(0.0, end["cpu_s"] - start["cpu_s"]) / seconds, 2),
                     "cpu_s": round(max(0.0, end["cpu_s"] - start["cpu_s"]), 2),
                     "rss_mib": round(end["rss_mib"], 1), "threads": int(end["threads"])}
    return out


def window_figures(snaps: list[dict[str, Any]], apis: list[str], nodes: list[str],
                   ) -> dict[str, Any]:
    """The quiet window's figures from its snapshots (start, middle, end; each
    ``{"t", "requests": {api: snapshot}, "procs": {name: usage}, "conns": {api: n}}``):
    the whole window, and each half for the reader to judge it quiet."""
    def over(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        s = b["t"] - a["t"]
        procs = process_figures(a["procs"], b["procs"], s)
        per_api = {api: request_rates(a["requests"][api], b["requests"][api], s)
                   for api in apis if api in a["requests"] and api in b["requests"]}
        return {
            "seconds": round(s, 1),
            "requests_per_s": per_api,
            "requests_per_s_total": {k: round(sum(r[k] for r in per_api.values()), 3)
                                     for k in [*KINDS, "lease_put", "status_patch", "failed"]},
            "servers": {n: procs.get(n) for n in [*apis, "etcd"]},
            "balancer": {k: spread(procs[f"lb-{n}"][k] for n in nodes if procs.get(f"lb-{n}"))
                         for k in ("cpu_pct", "rss_mib", "threads")},
            "kubelet": {k: spread(procs[f"kubelet-{n}"][k] for n in nodes
                                  if procs.get(f"kubelet-{n}"))
                        for k in ("cpu_pct", "rss_mib", "threads")},
        }

    first, *_, last = snaps
    out = over(first, last)
    out["halves"] = [over(a, b) for a, b in itertools.pairwise(snaps)] if len(snaps) > 2 else []
    out["connections"] = last["conns"]
    out["connections_start"] = first["conns"]
    out["watches"] = {api: last["requests"][api]["watches"] for api in apis
                      if api in last["requests"]}
    out["discovery_watches"] = {api: last["requests"][api]["discovery_watches"] for api in apis
                                if api in last["requests"]}
    return out
