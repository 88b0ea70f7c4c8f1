"""scripts/render-chart: the chart rendered without a cluster or a helm binary (docs/deploy.md)."""

from __future__ import annotations

import subprocess
import sys

import yaml

from extractedprism.config.table import validate
from tests.deploy.helpers import flag_values
from tests.util import ROOT

SCRIPT = ROOT / "scripts" / "render-chart"


def run(*args: str, values: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=120, input=values)


def test_renders_what_helm_template_would(tmp_path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text("endpoints:\n  - 10.0.0.1:6443\n  - 10.0.0.2:6443\nlogLevel: debug\n")
    out = run("-f", str(values), "--set", "healthInterval=30s", "-n", "infra", "ep")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds.index("ServiceAccount") < kinds.index("DaemonSet")  # helm's install order
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    assert ds["metadata"]["namespace"] == "infra"
    env = {e["name"]: e["value"] for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]
           if "value" in e}
    assert env["EP_LOG_LEVEL"] == "debug" and env["EP_HEALTH_INTERVAL"] == "30s"
    config = validate(flag_values(env))
    assert [str(e) for e in config.endpoints] == ["10.0.0.1:6443", "10.0.0.2:6443"]


def test_a_bad_value_fails_with_the_programs_message() -> None:
    out = run("--set", "endpoints={10.0.0.1:99999}")
    assert out.returncode == 1 and out.stdout == ""
    assert ("extractedprism: invalid configuration: --endpoints (10.0.0.1:99999) is invalid: "
            "'10.0.0.1:99999': port 99999 is outside 1-65535") in out.stderr
