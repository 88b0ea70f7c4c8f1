"""Every rendered chart manifest and every example manifest against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail) for one fixed Kubernetes version.

Kinds that kubernetes-validate has no schema for get an explicit check instead, never a
silent skip: the PodMonitor against the subset of its CRD the chart uses, kubeadm and
kubelet configuration and the kubeconfig structurally, the Talos machine config by
validating the static pods it embeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions

from extractedprism.config.table import FLAGS, validate
from tests.deploy.helpers import (
    ENDPOINTS,
    EXAMPLES_DIR,
    KUBE_VERSION,
    load_yaml_docs,
    render,
)

ENV_NAMES = {f.env for f in FLAGS}

# Value sets covering every optional template branch.
RENDER_CASES: dict[str, dict[str, Any]] = {
    "default": {"endpoints": ENDPOINTS},
    "readyz-secret-and-hostpath": {
        "endpoints": ENDPOINTS,
        "healthCheck": "readyz",
        "healthCheckCaFile": "/etc/extractedprism/readyz/ca.crt",
        "healthCheckCertFile": "/var/lib/kubelet/pki/kubelet-client-current.pem",
        "healthCheckKeyFile": "/var/lib/kubelet/pki/kubelet-client-current.pem",
        "readyzCredentials": {"secretName": "creds",
                              "hostPaths": [{"path": "/var/lib/kubelet/pki", "type": "Directory"},
                                            {"path": "/etc/kubernetes/pki/ca.crt"}]},
        "extraVolumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    },
    "everything-on": {
        "endpoints": ENDPOINTS,
        "healthBindAddress": "0.0.0.0",
        "podMonitor": {"enabled": True, "labels": {"release": "prom"},
                       "annotations": {"a": "b"}},
        "serviceAccount": {"annotations": {"x": "y"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"a": "b"},
        "podLabels": {"team": "platform"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "extraArgs": ["--log-level=debug"],
        "image": {"repository": "registry.example/extractedprism",
                  "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
    },
}

# The fields of monitoring.coreos.com/v1 PodMonitor the chart writes, with the CRD's types;
# additionalProperties false so a typo fails like strict validation would.
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object",
                                    "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"matchNames": {
                                          "type": "array", "items": {"type": "string"}}}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "properties": {
                                "sourceLabels": {"type": "array", "items": {
                                    "type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                                "regex": {"type": "string"},
                                "targetLabel": {"type": "string"},
                                "replacement": {"type": "string"},
                            }}},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                        "scrapeTimeout": {"type": "string",
                                          "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                    }}},
            },
        },
    },
}


def k8s_validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{where}: {doc['kind']} invalid at {path}: {exc.message}") from None


def test_the_fixed_kubernetes_version_is_shipped() -> None:
    assert KUBE_VERSION.rsplit(".", 1)[0] in {v.rsplit(".", 1)[0] for v in all_versions()}


@pytest.mark.parametrize("case", sorted(RENDER_CASES))
def test_rendered_chart_validates_strictly(case: str) -> None:
    docs, _ = render(RENDER_CASES[case])
    assert docs
    for doc in docs:
        if doc["kind"] == "PodMonitor":
            jsonschema.validate(doc, PODMONITOR_SCHEMA)
        else:
            k8s_validate(doc, f"chart[{case}]")


def test_strict_validation_does_catch_a_misspelt_field() -> None:
    docs, _ = render({"endpoints": ENDPOINTS})
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(AssertionError, match="hostNetwrok"):
        k8s_validate(ds, "mutated")


# --- examples ------------------------------------------------------------------------------

def _check_static_pod(pod: dict[str, Any], where: str) -> None:
    """Kubernetes schema plus what makes it work as extractedprism's static pod."""
    k8s_validate(pod, where)
    spec = pod["spec"]
    assert spec["hostNetwork"] is True, where
    assert spec["priorityClassName"] == "system-node-critical", where
    (c,) = spec["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert set(env) <= ENV_NAMES, f"{where}: unknown EP_ variables {set(env) - ENV_NAMES}"
    config = validate({f.dest: env.get(f.env) for f in FLAGS})  # the program accepts it
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, where
        assert get["host"] == config.health_bind_address, where
        assert get["port"] == config.health_port, where
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    assert all(m.get("readOnly") for m in mounts.values()), where
    for name in ("health_check_ca_file", "health_check_cert_file", "health_check_key_file"):
        path = getattr(config, name)
        if path:
            assert any(path == mp or path.startswith(mp.rstrip("/") + "/") for mp in mounts), (
                f"{where}: {name}={path} is not on a mounted volume")


def test_talos_example_static_pod_replaces_kubeprism() -> None:
    (doc,) = load_yaml_docs(EXAMPLES_DIR / "talos" / "machine-config-patch.yaml")
    assert doc["machine"]["features"]["kubePrism"]["enabled"] is False
    assert doc["cluster"]["controlPlane"]["endpoint"] == "https://localhost:7445"
    (pod,) = doc["machine"]["pods"]
    _check_static_pod(pod, "talos")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["EP_BIND_PORT"] == "7445"
    assert env["EP_HEALTH_CHECK"] == "readyz"
    assert env["EP_HEALTH_CHECK_CERT_FILE"] == "/var/lib/kubelet/pki/kubelet-client-current.pem"
    assert env["EP_ENABLE_DISCOVERY"] == "false"  # static pods have no service account token


def test_kubeadm_example_static_pod_and_configs_point_at_the_proxy() -> None:
    (pod,) = load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "extractedprism.yaml")
    _check_static_pod(pod, "kubeadm")
    assert pod["spec"]["securityContext"]["runAsUser"] == 65534
    docs = {d["kind"]: d for d in load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "kubeadm-config.yaml")}
    assert set(docs) == {"InitConfiguration", "ClusterConfiguration", "KubeletConfiguration"}
    assert docs["InitConfiguration"]["apiVersion"] == "kubeadm.k8s.io/v1beta4"
    assert "DirAvailable--etc-kubernetes-manifests" in (
        docs["InitConfiguration"]["nodeRegistration"]["ignorePreflightErrors"])
    cluster = docs["ClusterConfiguration"]
    assert cluster["apiVersion"] == "kubeadm.k8s.io/v1beta4"
    assert cluster["controlPlaneEndpoint"] == "127.0.0.1:7445"
    assert {"127.0.0.1", "localhost"} <= set(cluster["apiServer"]["certSANs"])
    kubelet = docs["KubeletConfiguration"]
    assert kubelet["apiVersion"] == "kubelet.config.k8s.io/v1beta1"
    assert kubelet["staticPodPath"] == "/etc/kubernetes/manifests"
    (join,) = load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "join-configuration.yaml")
    assert join["apiVersion"] == "kubeadm.k8s.io/v1beta4"
    assert join["kind"] == "JoinConfiguration"
    token = join["discovery"]["bootstrapToken"]
    assert token["apiServerEndpoint"].endswith(":6443")
    endpoints = validate({"endpoints": next(e["value"] for e in pod["spec"]["containers"][0]["env"]
                                            if e["name"] == "EP_ENDPOINTS")}).endpoints
    assert token["apiServerEndpoint"] in {str(e) for e in endpoints}


def test_sni_example_values_render_and_validate() -> None:
    import yaml

    values = yaml.safe_load((EXAMPLES_DIR / "sni-shared-endpoint" / "values.yaml").read_text())
    docs, _ = render(values)
    for doc in docs:
        k8s_validate(doc, "sni values")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    env = {e["name"]: e["value"] for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EP_ENDPOINTS"] == "198.51.100.10:443,198.51.100.11:443"
    assert env["EP_ENABLE_DISCOVERY"] == "false"


def test_sni_example_kubeconfig_and_edge_objects() -> None:
    (kubeconfig,) = load_yaml_docs(EXAMPLES_DIR / "sni-shared-endpoint" / "kubelet-kubeconfig.yaml")
    assert kubeconfig["apiVersion"] == "v1" and kubeconfig["kind"] == "Config"
    (cluster,) = kubeconfig["clusters"]
    assert cluster["cluster"]["server"] == "https://127.0.0.1:7445"
    assert cluster["cluster"]["tls-server-name"] == "api.cluster-x.example.com"
    (context,) = kubeconfig["contexts"]
    assert kubeconfig["current-context"] == context["name"]
    assert context["context"]["cluster"] == cluster["name"]
    assert context["context"]["user"] in {u["name"] for u in kubeconfig["users"]}
    edge = load_yaml_docs(EXAMPLES_DIR / "sni-shared-endpoint" / "edge-ingress.yaml")
    assert sorted(d["kind"] for d in edge) == ["EndpointSlice", "Ingress", "Service"]
    for doc in edge:
        k8s_validate(doc, "sni edge")
    ingress = next(d for d in edge if d["kind"] == "Ingress")
    assert ingress["spec"]["rules"][0]["host"] == cluster["cluster"]["tls-server-name"]


CHECKED_EXAMPLE_FILES = {
    "talos/machine-config-patch.yaml",
    "kubeadm/extractedprism.yaml",
    "kubeadm/kubeadm-config.yaml",
    "kubeadm/join-configuration.yaml",
    "sni-shared-endpoint/values.yaml",
    "sni-shared-endpoint/kubelet-kubeconfig.yaml",
    "sni-shared-endpoint/edge-ingress.yaml",
}


def test_every_example_manifest_is_checked_and_documented() -> None:
    found = {str(p.relative_to(EXAMPLES_DIR)) for p in EXAMPLES_DIR.rglob("*.y*ml")}
    assert found == CHECKED_EXAMPLE_FILES, "add new example files to a test above"
    for directory in {Path(f).parent for f in found}:
        readme = (EXAMPLES_DIR / directory / "README.md").read_text()
        for f in found:
            if Path(f).parent == directory:
                assert Path(f).name in readme, f"{directory}/README.md does not mention {f}"
