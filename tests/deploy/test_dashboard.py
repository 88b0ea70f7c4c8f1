"""The Grafana dashboard: made by scripts/dashboard (grafana-foundation-sdk), shipped by the
chart as an opt-in ConfigMap the kube-prometheus-stack sidecar loads, every panel's query
valid PromQL for Prometheus' own parser (promtool). That each query returns data from a
real Prometheus scraping real balancers: tests/process/test_live_alerts.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.helpers import CHART_DIR, ENDPOINTS, by_kind, render
from tests.util import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from epscripts import dashboard  # scripts/ is put on the path above

FILE = CHART_DIR / "files" / "grafana-dashboard.json"
PROMTOOL = shutil.which("promtool")


def substituted(expr: str) -> str:
    """Grafana's variables as Grafana would fill them in."""
    return (expr.replace("$job", "extractedprism").replace("$node", ".*")
            .replace("$__rate_interval", "1m"))


def test_the_shipped_json_is_what_the_code_makes() -> None:
    assert FILE.read_text() == dashboard.render(), "stale: run scripts/dashboard"


def test_panels_cover_what_an_operator_watches() -> None:
    doc = json.loads(FILE.read_text())
    titles = " | ".join(p["title"] for p in doc["panels"])
    for words in ("Fleet matrix", "Fleet verdict", "Connections per API server",
                  "skew", "Failures by reason", "latency", "Stall checks",
                  "Restarts and handovers", "Discovery", "Node: $node", "API servers on $node"):
        assert words in titles, f"no panel {words!r} in {titles}"
    matrix = next(p for p in doc["panels"] if p["title"].startswith("Fleet matrix"))
    texts = {m["options"][k]["text"] for m in matrix["fieldConfig"]["defaults"]["mappings"]
             for k in m["options"]}
    assert texts == {"ready", "suspect", "excluded"}
    ids = [p["gridPos"] for p in doc["panels"]]
    assert all(g["x"] + g["w"] <= 24 for g in ids)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not found (Debian package `prometheus`)")
@pytest.mark.timeout(60)
def test_every_panel_query_parses(tmp_path: Path) -> None:
    queries = dashboard.panel_queries(json.loads(FILE.read_text()))
    assert len(queries) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": substituted(expr)}
        for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout


def test_chart_configmap_is_opt_in_and_labelled_for_the_sidecar() -> None:
    docs, _ = render({"endpoints": ENDPOINTS})
    assert not [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith(
        "-dashboard") or d["metadata"]["name"] == "extractedprism-dashboard"]
    docs, _ = render({"endpoints": ENDPOINTS,
                      "grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                           "folder": "Kubernetes"}})
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"]
             == "extractedprism-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Kubernetes"}
    assert json.loads(cm["data"]["extractedprism.json"]) == json.loads(FILE.read_text())
