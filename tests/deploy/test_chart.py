"""The Helm chart, rendered by Helm's own engine (helm-python-sdk): the properties the spec's
"Installation" and "Security" sections promise, every flag reachable from values.yaml,
the schema, the render-time checks and a clean ``helm lint``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

import extractedprism
from extractedprism.config import profile
from extractedprism.config.table import (
    FLAGS,
    HEALTH_CHECKS,
    LOG_FORMATS,
    LOG_LEVELS,
    SELECTION_MODES,
    STATIC_ENDPOINT_MODES,
    validate,
)
from tests.deploy.helpers import (
    CHART_DIR,
    ENDPOINTS,
    NAMESPACE,
    RELEASE,
    by_kind,
    container,
    env_of,
    flag_values,
    helm,
    one,
    render,
    values_key,
)

h = helm()

# A valid, non-default value for every flag. A new flag in config.FLAGS fails
# test_every_flag_has_a_non_default_case until it is added here and to the chart.
NON_DEFAULTS: dict[str, Any] = {
    "bind-address": "127.0.0.2",
    "bind-port": 17445,
    "health-port": 17446,
    "health-bind-address": "0.0.0.0",
    "endpoints": ["192.0.2.1:6443", "192.0.2.2:443"],
    "health-interval": "30s",
    "health-timeout": "5s",
    "health-recheck": "10s",
    "enable-discovery": False,
    "overload-guard": True,
    "log-level": "debug",
    "liveness-interval": "2s",
    "liveness-threshold": "1m",
    "drain-timeout": "0",
    "unready-drain-timeout": "3s",
    "upstream-selection": "latency",
    "rebalance-interval": "30s",
    "rebalance-quiet": "10s",
    "slow-start": "1m",
    "stall-timeout": "2s",
    "health-check": "readyz",
    "health-check-ca-file": "/etc/extractedprism/readyz/ca.crt",
    "health-check-cert-file": "/var/lib/kubelet/pki/kubelet-client-current.pem",
    "health-check-key-file": "/var/lib/kubelet/pki/kubelet-client-current.pem",
    "health-check-token-file": "/etc/extractedprism/readyz/token",
    "health-check-server-name": "api.example.com",
    "kubeconfig": "/etc/extractedprism/kubeconfig",
    "max-connections": 1000000,
    "pipe-sched": "normal",
    "gil-cpu": "off",
    "relay": "python",
    "dial-hedge-delay": "0s",
    "answer-hedge-delay": "3s",
    "handover-socket": "/run/ep/handover.sock",
    "shutdown-drain-timeout": "5s",
    "state-file": "/var/lib/ep/state.json",
    "static-endpoints": "fallback",
    "log-format": "json",
    "admin-socket": "/run/ep-admin/admin.sock",
}

SA_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
# Where the chart's default deliberately differs from the program's, and why:
CHART_DEFAULTS: dict[str, Any] = {
    # The production profile (tests/deploy/test_profile.py holds it to config/profile.py).
    **profile.flags(),
    # Empty = readyz (the profile's) with the pod's service-account CA when discovery is on,
    # else tcp.
    "health-check": "",
    # The handover, the shutdown drain and the state file make a node's upgrade gapless.
    "handover-socket": "/run/extractedprism/handover.sock",
    "shutdown-drain-timeout": "30s",
    "state-file": "/var/lib/extractedprism/state.json",
    # The admin socket on a per-pod emptyDir, for `kubectl exec ... extractedprism admin`.
    "admin-socket": "/run/extractedprism-admin/admin.sock",
}
# What the default render passes to the program for those.
CHART_DEFAULT_ENV: dict[str, str] = {
    **profile.flags(),
    "health-check": "readyz",
    "health-check-ca-file": SA_CA,
    "handover-socket": "/run/extractedprism/handover.sock",
    "shutdown-drain-timeout": "30s",
    "state-file": "/var/lib/extractedprism/state.json",
    "admin-socket": "/run/extractedprism-admin/admin.sock",
}


def _as_env(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render({"endpoints": ENDPOINTS})[0]


@pytest.fixture(scope="module")
def chart_values() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def _pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "DaemonSet")["spec"]["template"]["spec"]


# --- metadata and values -------------------------------------------------------------------


def test_chart_metadata_is_helm_v3_api_and_tracks_the_package_version() -> None:
    with h.Chart.load(CHART_DIR) as chart:
        meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "extractedprism"
    assert meta["appVersion"] == extractedprism.__version__


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_every_flag_is_in_values_with_the_program_default(flag, chart_values) -> None:
    key = values_key(flag)
    assert key in chart_values, f"values.yaml lacks {key} for {flag.option}"
    value = chart_values[key]
    if flag.name in CHART_DEFAULTS:
        assert _as_env(value) == _as_env(CHART_DEFAULTS[flag.name]), key
    elif flag.default is None:
        assert value in ("", [], None), f"{key}: {flag.option} has no default, values has {value!r}"
    else:
        assert _as_env(value) == flag.default, (
            f"{key}={value!r}, {flag.option} default {flag.default}")


def test_every_flag_has_a_non_default_case() -> None:
    assert set(NON_DEFAULTS) == {f.name for f in FLAGS}
    for flag in FLAGS:
        assert _as_env(NON_DEFAULTS[flag.name]) != (flag.default or ""), flag.name


def test_schema_enums_are_the_programs_choices() -> None:
    with h.Chart.load(CHART_DIR) as chart:
        props = chart.schema["properties"]
    assert props["logLevel"]["enum"] == list(LOG_LEVELS)
    assert props["upstreamSelection"]["enum"] == list(SELECTION_MODES)
    assert props["healthCheck"]["enum"] == ["", *HEALTH_CHECKS]  # "": the chart's choice
    assert props["logFormat"]["enum"] == list(LOG_FORMATS)
    assert props["staticEndpoints"]["enum"] == list(STATIC_ENDPOINT_MODES)


# --- the DaemonSet -------------------------------------------------------------------------


def test_default_render_has_exactly_the_expected_objects(default_docs) -> None:
    kinds = sorted(d["kind"] for d in default_docs)
    assert kinds == ["DaemonSet", "Role", "RoleBinding", "ServiceAccount"]
    assert not by_kind(default_docs, "PodMonitor")


def test_pod_runs_in_the_node_network_as_node_critical(default_docs) -> None:
    spec = _pod_spec(default_docs)
    assert spec["hostNetwork"] is True
    # Hostname endpoints must resolve before the CNI and cluster DNS exist.
    assert spec["dnsPolicy"] == "Default"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is True
    assert spec["serviceAccountName"] == one(default_docs, "ServiceAccount")["metadata"]["name"]
    ds = one(default_docs, "DaemonSet")
    assert ds["metadata"]["namespace"] == NAMESPACE
    # The new pod starts beside the old one and takes its listeners over.
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    # The probes reach whichever process holds the shared health listener: the new pod
    # must stay ready a while (past its takeover) before the old one is stopped.
    assert ds["spec"]["minReadySeconds"] >= 10
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' toleration matching (ToleratesTaint)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        op = t.get("operator", "Equal")
        if op == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


@pytest.mark.parametrize("taint", [
    {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
    {"key": "node-role.kubernetes.io/master", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/network-unavailable", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/disk-pressure", "effect": "NoSchedule"},
    {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
], ids=lambda t: t["key"])
def test_tolerations_let_it_run_on_every_node(default_docs, taint) -> None:
    assert _tolerates(_pod_spec(default_docs)["tolerations"], taint)


def test_no_declared_ports_so_the_surge_pod_fits_on_the_node(default_docs) -> None:
    # In the host network a declared containerPort is a host port: the scheduler would keep
    # the surge pod of the rolling update off the node while the old pod holds it.
    spec = _pod_spec(default_docs)
    for c in spec["containers"] + spec.get("initContainers", []):
        assert "ports" not in c, c["name"]


def test_ports_and_probes_point_at_the_health_server(default_docs) -> None:
    c = container(default_docs)
    env = env_of(c)
    assert int(env["EP_BIND_PORT"]) == 7445
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path
        assert get["port"] == int(env["EP_HEALTH_PORT"]) == 7446
        assert get["scheme"] == "HTTP"
        # Host network + loopback listener: the kubelet must probe loopback, not the node IP.
        assert get["host"] == "127.0.0.1"
        assert c[probe]["periodSeconds"] >= 1


def test_probe_host_follows_the_health_bind_address() -> None:
    docs = render({"endpoints": ENDPOINTS, "healthBindAddress": "0.0.0.0", "healthPort": 9000})[0]
    c = container(docs)
    assert c["livenessProbe"]["httpGet"]["host"] == "127.0.0.1"
    assert c["livenessProbe"]["httpGet"]["port"] == 9000
    docs = render({"endpoints": ENDPOINTS, "bindAddress": "127.0.0.5"})[0]
    assert container(docs)["readinessProbe"]["httpGet"]["host"] == "127.0.0.5"
    # The node's own IP: the kubelet probes that address.
    docs = render({"endpoints": ENDPOINTS, "healthBindAddress": "192.0.2.7"})[0]
    c = container(docs)
    assert validate(flag_values(env_of(c))).health_bind_address == "192.0.2.7"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["host"] == "192.0.2.7"
    docs = render({"endpoints": ENDPOINTS, "healthBindAddress": "::"})[0]
    assert container(docs)["livenessProbe"]["httpGet"]["host"] == "::1"


def test_security_context_is_fully_locked_down(default_docs) -> None:
    pod = _pod_spec(default_docs)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == 65534
    assert pod["runAsGroup"] == 65534
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(default_docs)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 65534
    assert sc["runAsGroup"] == 65534
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_resources_are_set(default_docs) -> None:
    res = container(default_docs)["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"]
    assert res["limits"]["memory"]


def test_no_volumes_unless_asked() -> None:
    docs = render({"endpoints": ENDPOINTS, "handoverSocket": "", "stateFile": "",
                   "adminSocket": ""})[0]
    spec = _pod_spec(docs)
    assert "volumes" not in spec
    assert "initContainers" not in spec
    assert "volumeMounts" not in container(docs)
    env = env_of(container(docs))
    assert "EP_HANDOVER_SOCKET" not in env and "EP_STATE_FILE" not in env


def _host_dirs(docs: list[dict[str, Any]]) -> dict[str, str]:
    """mountPath -> hostPath of the container's hostPath volumes."""
    spec = _pod_spec(docs)
    host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container(docs).get("volumeMounts", [])
            if m["name"] in host}


def test_handover_socket_and_state_file_live_on_host_directories(default_docs) -> None:
    env = env_of(container(default_docs))
    config = validate(flag_values(env))
    dirs = _host_dirs(default_docs)
    # Same path inside and outside: the old and the new pod of a node meet there.
    assert dirs == {"/run/extractedprism": "/run/extractedprism",
                    "/var/lib/extractedprism": "/var/lib/extractedprism"}
    assert env["EP_HANDOVER_SOCKET"] == "/run/extractedprism/handover.sock"
    assert env["EP_STATE_FILE"] == "/var/lib/extractedprism/state.json"
    assert config.enable_discovery
    mounts = {m["mountPath"]: m for m in container(default_docs)["volumeMounts"]}
    assert not mounts["/run/extractedprism"].get("readOnly")
    spec = _pod_spec(default_docs)
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in spec["volumes"]
             if "hostPath" in v}
    assert types == {"/run/extractedprism": "DirectoryOrCreate",
                     "/var/lib/extractedprism": "DirectoryOrCreate"}
    # The kubelet creates them root-owned: an init container hands them to the proxy's uid
    # with nothing but CAP_CHOWN.
    (init,) = spec["initContainers"]
    assert init["image"] == container(default_docs)["image"]
    assert init["command"][-4:] == ["65534", "65534", "/run/extractedprism",
                                    "/var/lib/extractedprism"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in init["volumeMounts"]} == set(dirs)


def test_admin_socket_is_on_a_per_pod_memory_volume(default_docs) -> None:
    env = env_of(container(default_docs))
    assert validate(flag_values(env)).admin_socket == "/run/extractedprism-admin/admin.sock"
    volumes = {v["name"]: v for v in _pod_spec(default_docs)["volumes"]}
    assert volumes["admin-socket"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m for m in container(default_docs)["volumeMounts"]}
    assert mounts["admin-socket"]["mountPath"] == "/run/extractedprism-admin"
    # Off: no volume.
    docs = render({"endpoints": ENDPOINTS, "adminSocket": ""})[0]
    assert "admin-socket" not in {v["name"] for v in _pod_spec(docs)["volumes"]}
    assert "EP_ADMIN_SOCKET" not in env_of(container(docs))
    # Sharing a host directory would mount two volumes at one path.
    with pytest.raises(h.HelmError, match=r"adminSocket .* needs a directory of its own"):
        render({"endpoints": ENDPOINTS, "adminSocket": "/run/extractedprism/admin.sock"})


def test_one_directory_for_socket_and_state_when_they_share_it() -> None:
    docs = render({"endpoints": ENDPOINTS, "handoverSocket": "/var/lib/ep/h.sock",
                   "stateFile": "/var/lib/ep/state.json"})[0]
    assert _host_dirs(docs) == {"/var/lib/ep": "/var/lib/ep"}


def test_the_init_container_really_hands_the_directories_over(tmp_path) -> None:
    # Its script, run here as root (tests/deploy/test_image.py runs it in the image with
    # CAP_CHOWN alone).
    import os
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("handing a directory to uid 65534 needs root")
    docs = render({"endpoints": ENDPOINTS})[0]
    (init,) = _pod_spec(docs)["initContainers"]
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir(mode=0o755)
    cmd = [sys.executable, *init["command"][1:], *[str(d) for d in dirs]]
    cmd = [c for c in cmd if not c.startswith("/run/") and not c.startswith("/var/lib/")]
    for _pod in ("first", "surge"):  # the surge pod finds them handed over already
        subprocess.run(cmd, check=True, timeout=30)
        for d in dirs:
            st = d.stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (65534, 65534, 0o700)


def test_without_discovery_no_state_file_and_no_api_access() -> None:
    docs = render({"endpoints": ENDPOINTS, "enableDiscovery": False})[0]
    assert sorted(d["kind"] for d in docs) == ["DaemonSet"]  # no SA, Role, RoleBinding
    spec = _pod_spec(docs)
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec
    env = env_of(container(docs))
    assert "EP_STATE_FILE" not in env  # the program would only warn that it ignores it
    assert _host_dirs(docs) == {"/run/extractedprism": "/run/extractedprism"}


def test_pod_template_carries_no_chart_version(default_docs) -> None:
    # A chart bump that changes nothing in the pod must not roll the pod on every node.
    labels = one(default_docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert "helm.sh/chart" not in labels
    assert "app.kubernetes.io/version" not in labels
    with h.Chart.load(CHART_DIR) as chart:
        version = chart.metadata["version"]
    template = json.dumps(one(default_docs, "DaemonSet")["spec"]["template"])
    assert f"extractedprism-{version}" not in template
    # The objects themselves still say which chart made them.
    assert one(default_docs, "DaemonSet")["metadata"]["labels"]["helm.sh/chart"] == (
        f"extractedprism-{version}")


# --- RBAC ----------------------------------------------------------------------------------


def test_rbac_is_read_only_on_endpointslices_in_default_only(default_docs) -> None:
    assert not by_kind(default_docs, "ClusterRole")
    assert not by_kind(default_docs, "ClusterRoleBinding")
    role = one(default_docs, "Role")
    assert role["metadata"]["namespace"] == "default"
    assert role["rules"] == [{
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }]
    binding = one(default_docs, "RoleBinding")
    assert binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    sa = one(default_docs, "ServiceAccount")
    assert sa["metadata"]["namespace"] == NAMESPACE
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": NAMESPACE}]


def test_rbac_and_service_account_can_be_turned_off() -> None:
    docs = render({"endpoints": ENDPOINTS, "rbac": {"create": False},
                   "serviceAccount": {"create": False, "name": "existing"}})[0]
    assert sorted(d["kind"] for d in docs) == ["DaemonSet"]
    assert _pod_spec(docs)["serviceAccountName"] == "existing"


# --- flags -> EP_ variables ----------------------------------------------------------------


def test_default_render_passes_the_program_defaults(default_docs) -> None:
    env = env_of(container(default_docs))
    for flag in FLAGS:
        if flag.name == "endpoints":
            assert env[flag.env] == ",".join(ENDPOINTS)
        elif flag.name in CHART_DEFAULT_ENV:
            assert env[flag.env] == CHART_DEFAULT_ENV[flag.name], flag.env
        elif flag.default:
            assert env[flag.env] == flag.default, flag.env
        else:  # empty default: not rendered, so the program's own default applies
            assert flag.env not in env, flag.env
    assert set(env) <= {f.env for f in FLAGS}
    config = validate(flag_values(env))
    assert [str(e) for e in config.endpoints] == ENDPOINTS


def test_every_flag_is_reachable_from_values() -> None:
    values = {"endpoints": ENDPOINTS}
    values.update({values_key(f): NON_DEFAULTS[f.name] for f in FLAGS})
    env = env_of(container(render(values)[0]))
    for flag in FLAGS:
        if flag.name == "state-file":  # read only with discovery, so rendered only then
            assert flag.env not in env
            continue
        assert env.get(flag.env) == _as_env(NON_DEFAULTS[flag.name]), flag.env
    with_discovery = env_of(container(render({**values, "enableDiscovery": True})[0]))
    assert with_discovery["EP_STATE_FILE"] == NON_DEFAULTS["state-file"]
    # ... and the program accepts the result as a whole.
    config = validate(flag_values(env))
    assert config.max_connections == 1000000
    assert config.pipe_sched == "normal"
    assert config.enable_discovery is False
    assert config.health_check == "readyz"


def test_endpoints_as_list_string_or_set_expression_render_the_same() -> None:
    as_list = env_of(container(render({"endpoints": ENDPOINTS})[0]))["EP_ENDPOINTS"]
    as_string = env_of(container(render({"endpoints": " , ".join(ENDPOINTS)})[0]))["EP_ENDPOINTS"]
    from_set = h.parse_set_string("endpoints={" + ",".join(ENDPOINTS) + "}")
    as_set = env_of(container(render(from_set)[0]))["EP_ENDPOINTS"]
    escaped = h.parse_set_string("endpoints=" + r"\,".join(ENDPOINTS))
    as_escaped = env_of(container(render(escaped)[0]))["EP_ENDPOINTS"]
    assert as_list == as_string == as_set == as_escaped == ",".join(ENDPOINTS)


def test_extra_env_and_args_are_passed_through() -> None:
    docs = render({"endpoints": ENDPOINTS, "extraArgs": ["--log-level=debug"],
                   "extraEnv": [{"name": "TZ", "value": "UTC"}]})[0]
    c = container(docs)
    assert c["args"] == ["--log-level=debug"]
    assert env_of(c)["TZ"] == "UTC"


# --- readyz credentials, PodMonitor --------------------------------------------------------


def test_readyz_credentials_mount_read_only_from_secret_and_host_path() -> None:
    docs = render({
        "endpoints": ENDPOINTS,
        "healthCheck": "readyz",
        "healthCheckCaFile": "/etc/extractedprism/readyz/ca.crt",
        "healthCheckCertFile": "/var/lib/kubelet/pki/kubelet-client-current.pem",
        "healthCheckKeyFile": "/var/lib/kubelet/pki/kubelet-client-current.pem",
        "readyzCredentials": {"secretName": "readyz-creds",
                              "hostPaths": [{"path": "/var/lib/kubelet/pki", "type": "Directory"}]},
    })[0]
    spec = _pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["readyz-credentials"]["secret"]["secretName"] == "readyz-creds"
    assert volumes["readyz-host-0"]["hostPath"] == {"path": "/var/lib/kubelet/pki",
                                                    "type": "Directory"}
    mounts = {m["name"]: m for m in container(docs)["volumeMounts"]}
    assert mounts["readyz-credentials"] == {"name": "readyz-credentials", "readOnly": True,
                                           "mountPath": "/etc/extractedprism/readyz"}
    assert mounts["readyz-host-0"] == {"name": "readyz-host-0", "readOnly": True,
                                      "mountPath": "/var/lib/kubelet/pki"}
    env = env_of(container(docs))
    assert env["EP_HEALTH_CHECK"] == "readyz"
    assert env["EP_HEALTH_CHECK_CERT_FILE"] == env["EP_HEALTH_CHECK_KEY_FILE"]


def test_readyz_with_the_pods_own_service_account_needs_no_mount() -> None:
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    docs = render({"endpoints": ENDPOINTS, "healthCheck": "readyz",
                   "healthCheckCaFile": f"{sa}/ca.crt", "healthCheckTokenFile": f"{sa}/token"})[0]
    env = env_of(container(docs))
    assert validate(flag_values(env)).health_check_token_file == f"{sa}/token"
    volumes = _pod_spec(docs)["volumes"]
    assert not [v for v in volumes if v["name"].startswith("readyz")]


def test_pod_monitor_is_off_by_default_and_scrapes_the_health_port_when_on() -> None:
    docs = render({"endpoints": ENDPOINTS, "healthBindAddress": "0.0.0.0",
                   "podMonitor": {"enabled": True, "labels": {"release": "prom"}}})[0]
    pm = one(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prom"
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    # No declared ports: the address is the pod (node) IP and the health port.
    relabel = {r["regex"]: r for r in endpoint["relabelings"]
               if r["targetLabel"] == "__address__"}
    assert len(relabel) == 2
    assert all(r["sourceLabels"] == ["__meta_kubernetes_pod_ip"] for r in relabel.values())
    assert relabel["([^:]+)"]["replacement"] == "$1:7446"
    assert relabel["(.*:.*)"]["replacement"] == "[$1]:7446"
    ds_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= ds_labels.items()


# --- failures: required values, render-time checks, schema ---------------------------------


# Every other endpoint list: tests/deploy/test_chart_endpoints.py.
@pytest.mark.parametrize("values", [None, {"endpoints": []}, {"endpoints": ""}],
                         ids=["absent", "empty-list", "empty-string"])
def test_render_without_endpoints_fails_with_a_clear_message(values) -> None:
    with pytest.raises(h.HelmError, match="endpoints is required"):
        render(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"healthCheck": "readyz", "enableDiscovery": False},
     "--health-check=readyz requires --health-check-ca-file"),
    ({"healthCheckCertFile": "/c.pem"}, "must be set together"),
    ({"healthCheckKeyFile": "/k.pem"}, "must be set together"),
    ({"bindPort": 7446}, r"--bind-port \(7446\) and --health-port \(7446\) must differ"),
    ({"podMonitor": {"enabled": True}}, "podMonitor.enabled needs a health server"),
    ({"healthRecheck": "30s", "healthInterval": "20s"},
     r"--health-recheck \(30s\) must not be more than --health-interval \(20s\)"),
    ({"healthRecheck": "500ms"}, r"--health-recheck \(500ms\) must be at least 1s"),
], ids=["readyz-no-ca", "cert-no-key", "key-no-cert", "same-ports", "podmonitor-loopback",
        "recheck-above-interval", "recheck-below-1s"])
def test_render_time_checks_mirror_the_programs_validation(values, message) -> None:
    with pytest.raises(h.HelmError, match=message):
        render({"endpoints": ENDPOINTS, **values})


@pytest.mark.parametrize(("values", "where"), [
    ({"bindPort": 0}, "/bindPort"),
    ({"bindPort": 65536}, "/bindPort"),
    ({"bindPort": "7445"}, "/bindPort"),
    ({"healthPort": -1}, "/healthPort"),
    ({"healthPort": 7446.5}, "/healthPort"),
    ({"upstreamSelection": "fastest"}, "/upstreamSelection"),
    ({"healthCheck": "http"}, "/healthCheck"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"enableDiscovery": "yes"}, "/enableDiscovery"),
    ({"healthInterval": "20 seconds"}, "/healthInterval"),
    ({"drainTimeout": "-1s"}, "/drainTimeout"),
    ({"unreadyDrainTimeout": "-1s"}, "/unreadyDrainTimeout"),
    ({"healthRecheck": "2 s"}, "/healthRecheck"),
    ({"maxConnections": 0}, "/maxConnections"),
    ({"endpoints": [6443]}, "/endpoints"),  # the rules: test_chart_endpoints.py
    ({"endpoints": 6443}, "/endpoints"),
    ({"healthCheckServerName": ""}, "/healthCheckServerName"),
    ({"bindPorts": 7445}, "bindPorts"),
    ({"image": {"repository": "x", "digest": "latest"}}, "/image/digest"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else v)
def test_schema_rejects_bad_values(values, where) -> None:
    with h.Chart.load(CHART_DIR) as chart, pytest.raises(h.HelmValuesError) as err:
        chart.validate_schema({"endpoints": ENDPOINTS, **values})
    assert where in str(err.value)
    with pytest.raises(h.HelmValuesError):  # and an install would fail the same way
        render({"endpoints": ENDPOINTS, **values})


def test_schema_accepts_the_defaults_and_the_non_defaults() -> None:
    with h.Chart.load(CHART_DIR) as chart:
        chart.validate_schema({"endpoints": ENDPOINTS})
        chart.validate_schema({values_key(f): NON_DEFAULTS[f.name] for f in FLAGS})


# --- lint and NOTES ------------------------------------------------------------------------


@pytest.mark.parametrize("values", [
    {"endpoints": ENDPOINTS},
    {"endpoints": ENDPOINTS, "healthBindAddress": "0.0.0.0", "podMonitor": {"enabled": True}},
], ids=["default", "podmonitor"])
def test_helm_lint_is_clean(values) -> None:
    report = h.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == []
    # Severity 1 (info) is only "icon is recommended"; warnings (2) and errors (3) fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_notes_say_how_to_check_pods_and_reach_upstreams() -> None:
    _, notes = render({"endpoints": ENDPOINTS})
    assert f"rollout status daemonset/{RELEASE}" in notes
    assert "get pods" in notes
    assert "/upstreams" in notes
    assert "port-forward" in notes
    assert "WARNING" not in notes
    _, notes = render({"endpoints": ENDPOINTS}, namespace="infra")
    assert "WARNING" in notes and "kube-system" in notes


def test_helm_lint_is_not_vacuous() -> None:
    # Helm lint only logs `fail` (lint mode), but schema and template errors are reported.
    report = h.lint(CHART_DIR, {"endpoints": ENDPOINTS, "bindPort": 0}, strict=True)
    assert any("/bindPort" in e for e in report["errors"])
