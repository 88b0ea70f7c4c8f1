"""extractedprism's Grafana dashboard, built with grafana-foundation-sdk (Grafana's own typed
builders, so every field is one Grafana's schema has) and written as JSON to
chart/extractedprism/files/grafana-dashboard.json, which the chart ships as an opt-in
ConfigMap for the kube-prometheus-stack Grafana sidecar (grafanaDashboard.enabled).

    scripts/dashboard            # rewrite the JSON
    scripts/dashboard --check    # exit 1 when the JSON differs from what this code makes

The queries read only what the balancers export (no recording rules needed), so the
dashboard works beside any rules file. Every panel's query is parsed by promtool and run on
a real Prometheus scraping real balancers in the tests (tests/deploy/test_dashboard.py,
tests/process/test_live_alerts.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, statushistory, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "chart" / "extractedprism" / "files" / "grafana-dashboard.json"
UID = "extractedprism"

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job="$job"'
NODE = 'job="$job", node=~"$node"'


def out_of_service(sel: str) -> str:
    """1 while a node keeps new connections off an upstream (TCP-unhealthy or unready),
    0 in service: the recording rule extractedprism:upstream_out_of_service, inlined so
    the dashboard needs no rules."""
    return (f"(clamp_max((1 - extractedprism_health_check_status{{{sel}}}) "
            f"+ (1 - extractedprism_upstream_ready{{{sel}}}), 1) "
            f"or (1 - extractedprism_health_check_status{{{sel}}}))")


def state(sel: str) -> str:
    """0 ready, 1 suspect (in service with a failure streak: one failure from exclusion,
    or marked: the stall check's suspect, a stalled dial; the marks new connections
    avoid, docs/architecture.md), 2 excluded."""
    out = out_of_service(sel)
    suspect = (f"clamp_max(extractedprism_upstream_failure_streak{{{sel}}} "
               f"+ on(job, instance, upstream) group_left() "
               f"(extractedprism_upstream_suspect{{{sel}}} "
               f"or 0 * extractedprism_upstream_failure_streak{{{sel}}}) "
               f"+ on(job, instance, upstream) group_left() "
               f"(extractedprism_upstream_dial_stalled{{{sel}}} "
               f"or 0 * extractedprism_upstream_failure_streak{{{sel}}}), 1)")
    return f"max by (node, upstream) (2 * {out} + (1 - {out}) * {suspect})"


STATE_MAP = dm.ValueMap(options={
    "0": dm.ValueMappingResult(text="ready", color="green", index=0),
    "1": dm.ValueMappingResult(text="suspect", color="yellow", index=1),
    "2": dm.ValueMappingResult(text="excluded", color="red", index=2),
})


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    return q.legend_format(legend) if legend else q


def pos(w: int, h: int, x: int, y: int) -> dm.GridPos:
    return dm.GridPos(w=w, h=h, x=x, y=y)


def series(title: str, desc: str, unit: str, *targets: tuple[str, str],
           grid: dm.GridPos) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(desc).unit(unit).datasource(DS)
         .grid_pos(grid))
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(query(expr, legend, chr(ord("A") + i)))
    return p


def matrix(title: str, desc: str, sel: str, grid: dm.GridPos) -> statushistory.Panel:
    return (statushistory.Panel().title(title).description(desc).datasource(DS)
            .grid_pos(grid).mappings([STATE_MAP]).show_value(common.VisibilityMode.NEVER)
            .with_target(query(state(sel), "{{node}} → {{upstream}}")))


def build() -> dict[str, object]:
    conns = f"sum by (upstream) (extractedprism_upstream_connections_active{{{SEL}}})"
    d = (dashboard.Dashboard("extractedprism: node-local API server balancers").uid(UID)
         .tags(["extractedprism", "kubernetes"]).refresh("30s").time("now-1h", "now")
         .timezone("browser")
         .description("Every node's balancer by API server: in service, connections, "
                      "failures, checks, restarts; the last row is one node's drill-down. "
                      "Runbooks: docs/operations.md, \"Alerts and runbooks\".")
         .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus")
                        .type("prometheus"))
         .with_variable(dashboard.QueryVariable("job").label("Job").datasource(DS)
                        .query("label_values(extractedprism_build_info, job)")
                        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED))
         .with_variable(dashboard.QueryVariable("node").label("Node").datasource(DS)
                        .query(f"label_values(extractedprism_build_info{{{SEL}}}, node)")
                        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .include_all(True).all_value(".*").multi(True)))
    d = d.with_row(dashboard.Row("Fleet").grid_pos(pos(24, 1, 0, 0)))
    d = d.with_panel(
        stat.Panel().title("Balancers answering").datasource(DS).grid_pos(pos(4, 4, 0, 1))
        .description("Targets of the job whose scrape succeeded, of all targets")
        .with_target(query(f"count(up{{{SEL}}} == 1)", "up", "A"))
        .with_target(query(f"count(up{{{SEL}}})", "targets", "B")))
    d = d.with_panel(
        stat.Panel().title("Nodes in panic / with no upstream in service").datasource(DS)
        .grid_pos(pos(4, 4, 4, 1))
        .description("Panic: no upstream healthy. No upstream in service: none healthy "
                     "and ready. Both are critical alerts.")
        .with_target(query(f"sum(extractedprism_panic{{{SEL}}})", "panic", "A"))
        .with_target(query(f"count(sum by (instance) (1 - {out_of_service(SEL)}) == 0) "
                           "or vector(0)", "no upstream in service", "B")))
    d = d.with_panel(series(
        "Fleet verdict: share of nodes with the API server out of service",
        "From half of the nodes or more: the server is sick "
        "(ExtractedprismAPIServerOutOfServiceFleetWide); from a few: those nodes' paths "
        "(ExtractedprismNodePathToAPIServerDown)", "percentunit",
        (f"avg by (upstream) ({out_of_service(SEL)})", "{{upstream}}"),
        grid=pos(16, 8, 8, 1)))
    d = d.with_panel(matrix(
        "Fleet matrix: node → API server (ready, suspect, excluded)",
        "Suspect: in service with a failure streak (its confirming check comes after "
        "--health-recheck) or stalled connections. Excluded: TCP-unhealthy or unready.",
        SEL, pos(24, 12, 0, 9)))
    d = d.with_panel(series(
        "Connections per API server", "Live proxied connections, all nodes", "short",
        (conns, "{{upstream}}"), grid=pos(12, 8, 0, 21)))
    d = d.with_panel(series(
        "Connection skew: busiest API server / mean", "1 is even; least-conn and "
        "rebalancing (--rebalance-interval) bring it back after a roll", "short",
        (f"max({conns}) / clamp_min(avg({conns}), 1)", "skew"), grid=pos(12, 8, 12, 21)))
    d = d.with_panel(series(
        "Failures by reason", "Per second, all nodes", "ops",
        (f"sum by (upstream) (rate(extractedprism_connection_errors_total{{{SEL}, "
         f'upstream!="none"}}[$__rate_interval]))', "dial failed: {{upstream}}"),
        (f'sum(rate(extractedprism_connection_errors_total{{{SEL}, upstream="none"}}'
         "[$__rate_interval]))", "client closed: no upstream available"),
        (f'sum by (upstream) (rate(extractedprism_stall_checks_total{{{SEL}, '
         'result="failed"}[$__rate_interval]))', "stall check failed: {{upstream}}"),
        (f'sum by (upstream) (rate(extractedprism_answer_hedges_total{{{SEL}, '
         'outcome="silent"}[$__rate_interval]))', "no answer to a ClientHello: {{upstream}}"),
        (f"sum(rate(extractedprism_discovery_errors_total{{{SEL}}}[$__rate_interval]))",
         "discovery error"),
        grid=pos(12, 8, 0, 29)))
    d = d.with_panel(series(
        "Client dial latency (p50, p99)", "Time to connect to an API server for a client "
        "connection, by upstream", "s",
        (f"histogram_quantile(0.5, sum by (upstream, le) (rate("
         f"extractedprism_dial_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
         "p50 {{upstream}}"),
        (f"histogram_quantile(0.99, sum by (upstream, le) (rate("
         f"extractedprism_dial_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
         "p99 {{upstream}}"),
        grid=pos(12, 8, 12, 29)))
    d = d.with_panel(series(
        "Stall checks", "Checks asked for by stalled connections (--stall-timeout), by "
        "result; failed ones found a sick server between its regular checks", "short",
        (f"sum by (upstream, result) (increase(extractedprism_stall_checks_total{{{SEL}}}"
         "[$__rate_interval]))", "{{result}} {{upstream}}"),
        grid=pos(12, 8, 0, 37)))
    d = d.with_panel(series(
        "Restarts and handovers", "A new process on a node (a restart, or an upgrade "
        "that took the listeners over through the handover socket) and failed scrapes",
        "short",
        (f"sum by (node) (changes(process_start_time_seconds{{{SEL}}}[$__rate_interval]))",
         "new process: {{node}}"),
        (f"count by (node) (up{{{SEL}}} == 0)", "scrape failed: {{node}}"),
        grid=pos(12, 8, 12, 37)))
    d = d.with_panel(series(
        "Discovery", "1: an EndpointSlice watch is open. Age of the last list or watch "
        "event (a quiet watch is normal)", "short",
        (f"min(extractedprism_discovery_connected{{{SEL}}})", "watch open on every node"),
        (f"max(time() - extractedprism_discovery_last_event_timestamp_seconds{{{SEL}}})",
         "oldest last event (s)"),
        grid=pos(24, 6, 0, 45)))
    d = d.with_row(dashboard.Row("Node: $node").grid_pos(pos(24, 1, 0, 51)))
    d = d.with_panel(matrix(
        "API servers on $node", "Ready, suspect, excluded, as the fleet matrix", NODE,
        pos(12, 8, 0, 52)))
    d = d.with_panel(series(
        "Connections by API server on $node", "Live, and the connections' failure streak",
        "short",
        (f"sum by (node, upstream) (extractedprism_upstream_connections_active{{{NODE}}})",
         "{{node}} {{upstream}}"),
        (f"max by (node, upstream) (extractedprism_upstream_failure_streak{{{NODE}}})",
         "failure streak {{node}} {{upstream}}"),
        grid=pos(12, 8, 12, 52)))
    d = d.with_panel(series(
        "Bytes on $node", "Proxied bytes per second by API server and direction", "Bps",
        (f"sum by (node, upstream, direction) (rate(extractedprism_upstream_bytes_total"
         f"{{{NODE}}}[$__rate_interval]))", "{{node}} {{upstream}} {{direction}}"),
        grid=pos(12, 8, 0, 60)))
    d = d.with_panel(series(
        "Process on $node", "Resident memory and CPU of the balancer", "short",
        (f"max by (node) (process_resident_memory_bytes{{{NODE}}}) / 2^20", "RSS MiB {{node}}"),
        (f"sum by (node) (rate(process_cpu_seconds_total{{{NODE}}}[$__rate_interval]))",
         "CPU cores {{node}}"),
        grid=pos(12, 8, 12, 60)))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def panel_queries(doc: dict[str, object]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    out = []
    for p in doc["panels"]:  # type: ignore[union-attr]
        for t in p.get("targets", []):  # type: ignore[union-attr]
            out.append((p["title"], t["expr"]))  # type: ignore[index]
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 when {OUT.relative_to(ROOT)} is not what this code makes")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run scripts/dashboard", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(panel_queries(build()))} queries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
