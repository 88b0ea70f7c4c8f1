"""Shared helpers for the deployment tests: render the chart with the real Helm engine.

helm-python-sdk binds libhelm_c (Helm's Go SDK behind a C ABI) with ctypes, so rendering,
schema validation and lint are Helm's own code paths, offline, with no helm binary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from extractedprism.config.flags import Flag
from extractedprism.config.table import FLAGS
from tests.util import ROOT

CHART_DIR = ROOT / "chart" / "extractedprism"
EXAMPLES_DIR = ROOT / "examples"
CONTAINERFILE = ROOT / "Containerfile"
RELEASE = "extractedprism"
NAMESPACE = "kube-system"
# One fixed Kubernetes version that kubernetes-validate ships schemas for; the chart's
# kubeVersion floor is 1.25, and 1.30 is a long-supported middle ground.
KUBE_VERSION = "1.30.0"
ENDPOINTS = ["10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"]


def values_key(flag: Flag) -> str:
    """--health-check-ca-file -> healthCheckCaFile (the chart's naming rule)."""
    head, *rest = flag.name.split("-")
    return head + "".join(part.capitalize() for part in rest)


def helm() -> Any:
    import helm_python

    helm_python.disable_logging()
    return helm_python


def render(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE
           ) -> tuple[list[dict[str, Any]], str]:
    """Render the chart; return (parsed manifests, NOTES.txt)."""
    h = helm()
    with h.Chart.load(CHART_DIR) as chart:
        out = chart.render(values, name=RELEASE, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    notes = ""
    for name, text in sorted(out.items()):
        if name.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs, notes


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    env = c.get("env") or []
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"duplicate env vars: {names}"
    return {e["name"]: e["value"] for e in env if "value" in e}


def flag_values(env: dict[str, str]) -> dict[str, str | None]:
    """EP_ env -> the dict extractedprism.config.table.validate() takes (keyed by dest)."""
    return {f.dest: env.get(f.env) for f in FLAGS}


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def containerfile_stages(text: str) -> list[list[str]]:
    """Containerfile instructions (continuations joined, comments dropped), per stage."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(re.sub(r"\s+", " ", buf + line).strip())
        buf = ""
    stages: list[list[str]] = [[]]
    for instr in logical:
        if instr.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(instr)
    return stages  # stages[0]: global ARGs before the first FROM
