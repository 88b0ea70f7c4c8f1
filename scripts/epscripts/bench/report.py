"""The metric table, PASS/FAIL against issue 3's targets, and the printed tables (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from epscripts.bench.config import PATHS, PROXIES, REFS
from epscripts.bench.parse import best, spread


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    # ("ratio_min", x): ep/haproxy >= x; ("ratio_max", x): ep/haproxy <= x;
    # ("abs_max", x): ep value <= x; None: informational.
    target: tuple[str, float] | None = None
    paths: tuple[str, ...] = PATHS


METRICS: tuple[Metric, ...] = (
    # Targets: issue 16 (the native relay), as ratios to HAProxy in the same run.
    Metric("bulk1_gbps", "bulk 1 stream", "Gbit/s", True, ("ratio_min", 1.3)),
    Metric("bulk4_gbps", "bulk 4 streams", "Gbit/s", True, ("ratio_min", 1.3)),
    Metric("bulk1_cpu_s_per_gb", "  proxy CPU, bulk 1", "cpu-s/GB", False, None, PROXIES),
    Metric("bulk4_cpu_s_per_gb", "  proxy CPU, bulk 4", "cpu-s/GB", False, None, PROXIES),
    Metric("ka1_rps", "keep-alive c=1", "req/s", True, ("ratio_min", 1.0)),
    Metric("ka1_p50_ms", "keep-alive c=1 p50", "ms", False),
    Metric("ka1_p99_ms", "keep-alive c=1 p99", "ms", False),
    Metric("ka1_cpu_us_per_req", "  proxy CPU, c=1", "cpu-us/req", False, None, PROXIES),
    Metric("ka64_rps", "keep-alive c=64", "req/s", True, ("ratio_min", 0.7)),
    Metric("ka64_p50_ms", "keep-alive c=64 p50", "ms", False),
    Metric("ka64_p99_ms", "keep-alive c=64 p99", "ms", False, ("ratio_max", 3.0)),
    Metric("ka64_cpu_us_per_req", "  proxy CPU, c=64", "cpu-us/req", False, ("ratio_max", 2.0),
           PROXIES),
    Metric("nc1_cps", "new connections c=1", "conn/s", True, ("ratio_min", 0.9)),
    Metric("nc1_cpu_us_per_conn", "  proxy CPU, new conn c=1", "cpu-us/conn", False, None,
           PROXIES),
    Metric("newconn_cps", "new connections", "conn/s", True, ("ratio_min", 0.45)),
    Metric("newconn_p99_ms", "new connections p99", "ms", False, ("ratio_max", 3.0)),
    Metric("newconn_cpu_us_per_conn", "  proxy CPU, new conn", "cpu-us/conn", False, None,
           PROXIES),
    Metric("idle_rss_kib_per_conn", "RSS per idle conn", "KiB", False, ("abs_max", 24.0),
           PROXIES),
    Metric("idle_rss_total_mib", "  RSS with idle conns", "MiB", False, None, PROXIES),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}


def judge(metric: Metric, ep: float | None, ha: float | None) -> tuple[float | None, str]:
    """(ratio extractedprism/haproxy, PASS/FAIL/INFO/N/A) for one metric."""
    ratio = ep / ha if ep is not None and ha not in (None, 0) else None
    if metric.target is None:
        return ratio, "INFO"
    kind, limit = metric.target
    if kind == "abs_max":
        return ratio, "N/A" if ep is None else ("PASS" if ep <= limit else "FAIL")
    if ratio is None:
        return None, "N/A"
    if kind == "ratio_min":
        return ratio, "PASS" if ratio >= limit else "FAIL"
    return ratio, "PASS" if ratio <= limit else "FAIL"


def target_text(metric: Metric) -> str:
    if metric.target is None:
        return ""
    kind, limit = metric.target
    return {"ratio_min": f">= {limit:g}x HA", "ratio_max": f"<= {limit:g}x HA",
            "abs_max": f"<= {limit:g} {metric.unit}"}[kind]


def refs_in(runs_or_summary: dict) -> list[str]:
    """The reference paths that have any value in a runs dict or a summary."""
    return [r for r in REFS if any(isinstance(v, dict) and r in v
                                   for v in runs_or_summary.values())]


def summarize(runs: dict[str, dict[str, list[float | None]]]) -> dict:
    """runs[metric][path] = values of each repetition -> JSON-ready summary with verdicts."""
    summary: dict = {}
    refs = refs_in(runs)
    for metric in METRICS:
        per_path = runs.get(metric.key, {})
        entry: dict = {"label": metric.label.strip(), "unit": metric.unit,
                       "higher_is_better": metric.higher_is_better,
                       "target": target_text(metric) or None}
        extra = tuple(refs) if "extractedprism" in metric.paths else ()
        for path in metric.paths + extra:
            vals = per_path.get(path, [])
            entry[path] = {"best": best(vals, metric.higher_is_better), "runs": vals,
                           "spread": spread(vals)}
        ep = entry.get("extractedprism", {}).get("best")
        ha = entry.get("haproxy", {}).get("best")
        entry["ratio_ep_haproxy"], entry["status"] = judge(metric, ep, ha)
        for ref in extra:
            # What the target would say of the reference: informational, never the verdict.
            entry[f"ratio_{ref}_haproxy"], entry[f"status_{ref}"] = judge(
                metric, entry[ref]["best"], ha)
        summary[metric.key] = entry
    return summary


def rep_ratios(runs: dict[str, dict[str, list[float | None]]]) -> dict:
    """Same-repetition ratios path/HAProxy: {metric: {path: {"runs", "median", "best"}}}.

    Each repetition measures every path within a few seconds, so its own ratio is the
    figure least moved by other load on the machine; "best" follows the metric's
    direction (highest rate, lowest latency or cost)."""
    out: dict = {}
    for metric in METRICS:
        per_path = runs.get(metric.key, {})
        ha = per_path.get("haproxy", [])
        for path in ("extractedprism", *REFS):
            vals = per_path.get(path, [])
            ratios = [v / h for v, h in zip(vals, ha, strict=False)
                      if v is not None and h not in (None, 0)]
            if not ratios:
                continue
            ordered = sorted(ratios)
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            out.setdefault(metric.key, {})[path] = {
                "runs": ratios, "median": median,
                "best": max(ratios) if metric.higher_is_better else min(ratios)}
    return out


def render_rep_ratios(ratios: dict) -> str:
    """One line per metric: median and best of the same-run ratios of each path."""
    paths = [p for p in ("extractedprism", *REFS) if any(p in v for v in ratios.values())]
    rows = [("metric", *(f"{p}/HA median (best)" for p in paths))]
    for metric in METRICS:
        e = ratios.get(metric.key)
        if not e:
            continue
        rows.append((metric.label, *(f"{e[p]['median']:.2f} ({e[p]['best']:.2f})" if p in e
                                     else "" for p in paths)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in rows)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def render_table(summary: dict) -> str:
    """The human-readable table: best of N per cell, and the spread (max-min)/max of the runs."""
    refs = refs_in(summary)
    head = ("metric", "unit", *PATHS, *refs, "ep/HA", *(f"{r}/HA" for r in refs), "target",
            "status")
    rows = [head]
    for metric in METRICS:
        e = summary.get(metric.key)
        if e is None:
            continue
        cells = [metric.label, metric.unit]
        for path in (*PATHS, *refs):
            if path not in e:
                cells.append("")
                continue
            b, s = e[path]["best"], e[path]["spread"]
            cells.append(_fmt(b) + (f" ±{s * 100:.0f}%" if s is not None and b is not None
                                    else ""))
        for key in ("ratio_ep_haproxy", *(f"ratio_{r}_haproxy" for r in refs)):
            r = e.get(key)
            cells.append(f"{r:.2f}" if r is not None else "")
        cells += [target_text(metric), e["status"] if metric.target else ""]
        rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)
