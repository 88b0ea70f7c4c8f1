"""The alerting rules (chart/extractedprism/files/prometheus-rules.yaml) on Prometheus' own
rule engine: `promtool check rules`, then `promtool test rules` on series written here.

Each scenario is a fleet of three nodes (3 API servers each) scraped every 30 s (the
chart's PodMonitor interval) and evaluated every 30 s, with one fault from FAULT_AT; it
says which alerts must be firing (labels and rendered annotations, exactly) at chosen
times and which must not. Every alert of the file fires in at least one scenario and is
asserted silent on the healthy fleet. The PrometheusRule the chart renders is checked to
be this file with only its selectors renamed.

promtool is Debian's `prometheus` package (.ci/run installs it); without it these tests
skip with that reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from extractedprism.config.profile import flags as profile_flags
from extractedprism.upstreams.state import FAILURE_THRESHOLD
from tests.deploy.helpers import CHART_DIR, ENDPOINTS, by_kind, render

RULES = CHART_DIR / "files" / "prometheus-rules.yaml"
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found (Debian package `prometheus`; .ci/run installs it)")

SCRAPE = 30  # s: the chart's podMonitor.interval, and the evaluation interval assumed
STEPS = 90  # samples per series: 45 minutes
FAULT_AT = 4  # the fault starts at sample 4 (t = 2m)
NODES = {"n1": "192.0.2.11:7446", "n2": "192.0.2.12:7446", "n3": "192.0.2.13:7446"}
UPS = ["192.0.2.1:6443", "192.0.2.2:6443", "192.0.2.3:6443"]
JOB = "extractedprism"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def seconds(d: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", d))


def values(*runs: tuple[float | str, int]) -> str:
    """("1", 4), ("0", 86) -> "1 1 1 1 0 0 ..." (explicit samples, no `AxB` arithmetic)."""
    out: list[str] = []
    for v, n in runs:
        out.extend([str(v)] * n)
    return " ".join(out)


def at(step: int) -> str:
    return f"{step * SCRAPE}s"


# -- annotations as Prometheus renders them, for the constructs the rules file uses ----------

def _humanize(v: float) -> str:
    return f"{v:.4g}"


def render_template(text: str, labels: dict[str, str], value: float) -> str:
    def node() -> str:
        return labels.get("node") or labels.get("instance", "")
    text = text.replace(
        "{{ with $labels.node }}{{ . }}{{ else }}{{ $labels.instance }}{{ end }}", node())
    text = text.replace("{{ $value | humanizePercentage }}", _humanize(value * 100) + "%")
    text = text.replace("{{ $value | humanize }}", _humanize(value))
    text = text.replace("{{ $value }}", f"{value:g}")
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
    assert "{{" not in text, f"a template construct this test does not render: {text}"
    return text


def expected(alert: str, labels: dict[str, str], value: float) -> dict[str, Any]:
    rule = alerts()[alert]
    full = {**labels, **rule["labels"]}
    return {"exp_labels": full,
            "exp_annotations": {k: render_template(v, full, value)
                                for k, v in rule["annotations"].items()}}


# -- the fleet's series ---------------------------------------------------------------------

@dataclass
class Fleet:
    """Every series of three healthy readyz-mode balancers; a scenario overrides some."""

    readyz: bool = True
    over: dict[str, str] = field(default_factory=dict)  # series selector -> values

    def series(self) -> list[dict[str, str]]:
        ok, zero = values(("1", STEPS)), values(("0", STEPS))
        out: dict[str, str] = {
            f'kube_daemonset_status_desired_number_scheduled{{namespace="kube-system",'
            f'daemonset="{JOB}"}}': values(("3", STEPS))}
        for node, inst in NODES.items():
            base = f'job="{JOB}",instance="{inst}",node="{node}"'
            out[f"up{{{base}}}"] = ok
            out[f"extractedprism_panic{{{base}}}"] = zero
            out[f"process_start_time_seconds{{{base}}}"] = zero
            out[f'extractedprism_discovery_connected{{{base},provider="kubernetes"}}'] = ok
            out[f'extractedprism_discovery_errors_total{{{base},provider="kubernetes"}}'] = zero
            for up in UPS:
                u = f'{base},upstream="{up}"'
                out[f"extractedprism_health_check_status{{{u}}}"] = ok
                if self.readyz:
                    out[f"extractedprism_upstream_ready{{{u}}}"] = ok
                for result in ("failed", "passed"):
                    out[f'extractedprism_stall_checks_total{{{u},result="{result}"}}'] = zero
        for sel, vals in self.over.items():
            if vals == "absent":
                out.pop(sel)
            else:
                assert sel in out, f"no such series: {sel}"
                out[sel] = vals
        return [{"series": s, "values": v} for s, v in out.items()]


def node_labels(node: str, **more: str) -> dict[str, str]:
    return {"job": JOB, "instance": NODES[node], "node": node, **more}


def sel(metric: str, node: str, **more: str) -> str:
    labels = node_labels(node, **more)
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def faulted(n: int = STEPS - FAULT_AT, ok: str = "1", bad: str = "0") -> str:
    return values((ok, FAULT_AT), (bad, n))


@dataclass
class Scenario:
    name: str
    fleet: Fleet
    # (step, alertname) -> [(labels, value)] firing; [] means "not firing".
    checks: dict[tuple[int, str], list[tuple[dict[str, str], float]]]


def scenarios() -> list[Scenario]:
    u1, u2, u3 = UPS
    healthy = Scenario("healthy fleet: nothing fires in 45 minutes", Fleet(), {
        (step, name): [] for name in alerts() for step in (FAULT_AT + 4, STEPS - 1)})
    out = [healthy]

    out.append(Scenario("a node's balancer stops answering scrapes", Fleet(over={
        sel("up", "n1"): faulted()}), {
        (FAULT_AT, "ExtractedprismDown"): [],
        (FAULT_AT + 1, "ExtractedprismDown"): [(node_labels("n1"), 0)],
        (FAULT_AT + 1, "ExtractedprismPanic"): [],
    }))

    out.append(Scenario("a node whose balancer is gone: DaemonSet wants 4, 3 answer", Fleet(over={
        'kube_daemonset_status_desired_number_scheduled{namespace="kube-system",'
        f'daemonset="{JOB}"}}': faulted(ok="3", bad="4")}), {
        (FAULT_AT + 3, "ExtractedprismPodsMissing"): [],
        (FAULT_AT + 4, "ExtractedprismPodsMissing"): [
            ({"namespace": "kube-system", "daemonset": JOB}, 4)],
    }))

    out.append(Scenario("every upstream refuses TCP on one node: panic", Fleet(over={
        **{sel("extractedprism_health_check_status", "n1", upstream=u): faulted()
           for u in UPS},
        sel("extractedprism_panic", "n1"): faulted(ok="0", bad="1")}), {
        (FAULT_AT, "ExtractedprismPanic"): [],
        (FAULT_AT + 1, "ExtractedprismPanic"): [(node_labels("n1"), 1)],
        (FAULT_AT + 1, "ExtractedprismNoUpstreamInService"): [],  # panic says it already
        (FAULT_AT + 1, "ExtractedprismAPIServerOutOfServiceFleetWide"): [],
    }))

    out.append(Scenario("every upstream answers TCP but none is ready on one node", Fleet(over={
        sel("extractedprism_upstream_ready", "n2", upstream=u): faulted() for u in UPS}), {
        (FAULT_AT, "ExtractedprismNoUpstreamInService"): [],
        (FAULT_AT + 1, "ExtractedprismNoUpstreamInService"): [(node_labels("n2"), 0)],
        (FAULT_AT + 1, "ExtractedprismPanic"): [],
    }))

    out.append(Scenario("one API server unready from every node: the server is sick",
                        Fleet(over={sel("extractedprism_upstream_ready", n, upstream=u2):
                                    faulted() for n in NODES}), {
        (FAULT_AT + 1, "ExtractedprismAPIServerOutOfServiceFleetWide"): [],
        (FAULT_AT + 2, "ExtractedprismAPIServerOutOfServiceFleetWide"): [
            ({"job": JOB, "upstream": u2}, 1)],
        (FAULT_AT + 10, "ExtractedprismNodePathToAPIServerDown"): [],
        (FAULT_AT + 10, "ExtractedprismNoUpstreamInService"): [],
        (FAULT_AT + 19, "ExtractedprismUpstreamsDegraded"): [],
        (FAULT_AT + 20, "ExtractedprismUpstreamsDegraded"): [
            (node_labels(n), 1) for n in NODES],
    }))

    out.append(Scenario("one node's path to one API server is cut (tcp mode: no readyz)",
                        Fleet(readyz=False, over={
                            sel("extractedprism_health_check_status", "n3", upstream=u3):
                            faulted()}), {
        (FAULT_AT + 3, "ExtractedprismNodePathToAPIServerDown"): [],
        (FAULT_AT + 4, "ExtractedprismNodePathToAPIServerDown"): [
            (node_labels("n3", upstream=u3), 1)],
        (FAULT_AT + 4, "ExtractedprismAPIServerOutOfServiceFleetWide"): [],
        (FAULT_AT + 19, "ExtractedprismUpstreamsDegraded"): [],
        (FAULT_AT + 20, "ExtractedprismUpstreamsDegraded"): [(node_labels("n3"), 1)],
    }))

    flap = values(("1", FAULT_AT), ("0", 1), ("1", 1), ("0", 1), ("1", 1), ("0", 1),
                  ("1", STEPS - FAULT_AT - 5))
    out.append(Scenario("an upstream out and back three times within three minutes",
                        Fleet(over={sel("extractedprism_upstream_ready", "n2", upstream=u1):
                                    flap}), {
        # Two round trips (a roll, then a crash) are not flapping.
        (FAULT_AT + 4, "ExtractedprismUpstreamFlapping"): [],
        (FAULT_AT + 5, "ExtractedprismUpstreamFlapping"): [
            (node_labels("n2", upstream=u1), 6)],
        # Gone once the 15 minutes no longer hold six changes.
        (FAULT_AT + 5 + 30, "ExtractedprismUpstreamFlapping"): [],
        (FAULT_AT + 5, "ExtractedprismUpstreamsDegraded"): [],
    }))

    stalls = " ".join(["0"] * FAULT_AT + ["1", "2", "3"] + ["3"] * (STEPS - FAULT_AT - 3))
    out.append(Scenario("three stall-asked checks of one upstream fail", Fleet(over={
        sel("extractedprism_stall_checks_total", "n3", upstream=u1, result="failed"): stalls}), {
        (FAULT_AT + 1, "ExtractedprismStallChecksFailing"): [],
        (FAULT_AT + 2, "ExtractedprismStallChecksFailing"): [
            (node_labels("n3", upstream=u1), 3)],
    }))

    errs = " ".join(["0"] * FAULT_AT + [str(i) for i in range(1, STEPS - FAULT_AT + 1)])
    out.append(Scenario("discovery fails every 30 s on one node", Fleet(over={
        sel("extractedprism_discovery_errors_total", "n2", provider="kubernetes"): errs}), {
        # increase over 10m passes 5 at t = fault + 3m (its 6th error), then `for: 5m`.
        (FAULT_AT + 5 + 9, "ExtractedprismDiscoveryErrors"): [],
        # The 10 minutes then hold samples 0..19: 4 zeros before the fault, then 1..16.
        (FAULT_AT + 5 + 10, "ExtractedprismDiscoveryErrors"): [
            (node_labels("n2", provider="kubernetes"), 16)],
    }))

    out.append(Scenario("no watch open on one node after a fault", Fleet(over={
        sel("extractedprism_discovery_connected", "n1", provider="kubernetes"): faulted()}), {
        # max_over_time over 15m covers the last 1 (step FAULT_AT - 1) until then.
        (FAULT_AT - 1 + 30, "ExtractedprismDiscoveryStale"): [],
        (FAULT_AT + 30, "ExtractedprismDiscoveryStale"): [
            (node_labels("n1", provider="kubernetes"), 0)],
    }))
    return out


def nothing_scraped() -> dict[str, Any]:
    return {"interval": f"{SCRAPE}s", "input_series": [
        {"series": 'kube_daemonset_status_desired_number_scheduled{namespace="kube-system",'
                   f'daemonset="{JOB}"}}', "values": values(("3", 30))}],
        "alert_rule_test": [
            {"eval_time": "9m30s", "alertname": "ExtractedprismNotScraped", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "ExtractedprismNotScraped",
             "exp_alerts": [expected("ExtractedprismNotScraped", {"job": JOB}, 1)]},
            {"eval_time": "10m", "alertname": "ExtractedprismPodsMissing",
             "exp_alerts": [expected("ExtractedprismPodsMissing",
                                     {"namespace": "kube-system", "daemonset": JOB}, 3)]}]}


def promtool_test_file(scs: list[Scenario]) -> dict[str, Any]:
    tests = []
    for sc in scs:
        checks = [{"eval_time": at(step), "alertname": name,
                   "exp_alerts": [expected(name, labels, v) for labels, v in firing]}
                  for (step, name), firing in sorted(sc.checks.items())]
        tests.append({"name": sc.name, "interval": f"{SCRAPE}s",
                      "input_series": sc.fleet.series(), "alert_rule_test": checks})
    tests.append({"name": "nothing scraped at all", **nothing_scraped()})
    return {"rule_files": [str(RULES)], "evaluation_interval": f"{SCRAPE}s", "tests": tests}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_checks_the_rules_file() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


@needs_promtool
@pytest.mark.timeout(120)
def test_every_alert_fires_and_resolves_as_its_scenario_says(tmp_path: Path) -> None:
    scs = scenarios()
    fired = {name for sc in scs for (_, name), firing in sc.checks.items() if firing}
    fired.add("ExtractedprismNotScraped")
    assert fired == set(alerts()), f"alerts no scenario fires: {set(alerts()) - fired}"
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(promtool_test_file(scs), sort_keys=False, width=1000))
    done = promtool("test", "rules", str(path))
    assert done.returncode == 0, f"promtool test rules {path}:\n{done.stdout}{done.stderr}"


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        ann = rule["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, name
        assert ann["runbook_url"].endswith("docs/operations.md#" + name.lower()), name
        assert name.lower() in anchors, f"docs/operations.md has no section '### {name}'"
        assert "node" in ann["description"] or "DaemonSet" in ann["description"] or \
            name == "ExtractedprismNotScraped", name


def test_critical_alerts_fire_within_two_minutes_of_the_fault_with_the_profile() -> None:
    """The profile's detection time, one scrape and one evaluation, then `for`."""
    p = {k: seconds(v) for k, v in profile_flags().items()
         if k in ("health-interval", "health-recheck", "health-timeout")}
    # First failed check up to one interval after the fault, FAILURE_THRESHOLD - 1 rechecks
    # each after --health-recheck, each check taking up to --health-timeout.
    detect = (p["health-interval"] + (FAILURE_THRESHOLD - 1) * p["health-recheck"]
              + FAILURE_THRESHOLD * p["health-timeout"])
    for name, rule in alerts().items():
        if rule["labels"]["severity"] != "critical" or name == "ExtractedprismPodsMissing":
            continue  # PodsMissing waits out a node's image pull and start: docs say so
        worst = detect + SCRAPE + SCRAPE + seconds(rule.get("for", "0s"))
        assert worst <= 120, f"{name}: {worst}s after the fault"


def test_chart_prometheusrule_is_the_rules_file_with_its_selectors_renamed() -> None:
    base = {"endpoints": ENDPOINTS, "healthBindAddress": "0.0.0.0",
            "podMonitor": {"enabled": True}}
    docs, _ = render(base)
    assert not by_kind(docs, "PrometheusRule")
    docs, _ = render({**base, "fullnameOverride": "ep-lb",
                      "prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                         "runbookBaseUrl": "https://example.test/ops.md"}})
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    want = RULES.read_text().replace('job="extractedprism"', 'job="ep-lb"')
    want = want.replace('daemonset="extractedprism"', 'daemonset="ep-lb"')
    want = want.replace("https://github.com/lexfrei/extractedprism/blob/main/docs/operations.md",
                        "https://example.test/ops.md")
    assert rule["spec"] == yaml.safe_load(want)
    (pm,) = by_kind(docs, "PodMonitor")
    relabel = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"targetLabel": "job", "replacement": "ep-lb"} in relabel
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "node"} in relabel
