"""`extractedprism static-pod`: the manifest it prints is a valid Pod (kubernetes-validate,
strict) with the chart's hardening, its flags are validated exactly like the server's, and
the examples (kubeadm static pod, Talos, systemd unit) agree with it."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import extractedprism
from extractedprism.config import profile
from extractedprism.config.flags import parse_duration
from extractedprism.config.table import FLAGS, ConfigError, validate
from extractedprism.ops import staticpod
from tests.deploy.helpers import CHART_DIR, EXAMPLES_DIR, KUBE_VERSION, load_yaml_docs
from tests.util import ROOT

ENV_NAMES = {f.env for f in FLAGS}
ENDPOINTS = "192.0.2.11:6443,192.0.2.12:6443,192.0.2.13:6443"
KUBECONFIG = "/etc/extractedprism/kubeconfig"
# The production profile's readyz needs the cluster CA (tests/deploy/test_profile.py).
CA_ARG = "--health-check-ca-file=/etc/kubernetes/pki/ca.crt"


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EP_")}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extractedprism", *args], capture_output=True,
                          text=True, timeout=60, env=_clean_env(), cwd=ROOT)


def pod_for(*args: str) -> dict[str, Any]:
    proc = run_cli("static-pod", *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    (doc,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return doc


def k8s_validate(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"Pod invalid at {path}: {exc.message}") from None


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    (c,) = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"]}


def config_of(pod: dict[str, Any]) -> Any:
    env = env_of(pod)
    assert set(env) <= ENV_NAMES, f"unknown EP_ variables {set(env) - ENV_NAMES}"
    return validate({f.dest: env.get(f.env) for f in FLAGS})


CASES: dict[str, list[str]] = {
    "static-only": [f"--endpoints={ENDPOINTS}", "--enable-discovery=false", CA_ARG],
    "static-only-spec-defaults": [f"--endpoints={ENDPOINTS}", "--enable-discovery=false",
                                  "--profile=none"],
    "discovery-readyz-kubelet-cert": [
        f"--endpoints={ENDPOINTS}", f"--kubeconfig={KUBECONFIG}", "--health-check=readyz",
        "--health-check-ca-file=/etc/kubernetes/pki/ca.crt",
        "--health-check-cert-file=/var/lib/kubelet/pki/kubelet-client-current.pem",
        "--health-check-key-file=/var/lib/kubelet/pki/kubelet-client-current.pem",
        "--health-check-token-file=/etc/extractedprism/token"],
    "wildcard-health-other-ports": [
        f"--endpoints={ENDPOINTS}", "--enable-discovery=false", "--bind-port=17445",
        "--health-port=17446", "--health-bind-address=0.0.0.0", "--image=registry.example/ep:1",
        CA_ARG],
    "node-ip-health": [f"--endpoints={ENDPOINTS}", "--enable-discovery=false",
                       "--health-bind-address=192.0.2.50", CA_ARG],
    "state-file-and-drain": [
        f"--endpoints={ENDPOINTS}", f"--kubeconfig={KUBECONFIG}", CA_ARG,
        "--state-file=/var/lib/extractedprism/state.json", "--shutdown-drain-timeout=20s"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_is_a_valid_static_pod_with_the_charts_hardening(case: str) -> None:
    args = CASES[case]
    pod = pod_for(*args)
    k8s_validate(pod)
    assert pod["metadata"]["namespace"] == "kube-system"
    spec = pod["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "Default"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is False
    values = _values()
    assert spec["securityContext"] == values["podSecurityContext"]
    (c,) = spec["containers"]
    assert c["securityContext"] == values["securityContext"]
    assert c["resources"] == values["resources"]
    assert "ports" not in c
    config = config_of(pod)  # the program accepts what the pod passes it
    want_host = {"0.0.0.0": "127.0.0.1"}.get(config.health_bind_address,
                                            config.health_bind_address)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert (get["host"], get["port"], get["path"]) == (want_host, config.health_port, path)
    # Every file a flag names is on a read-only hostPath at the same path.
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    for name in ("kubeconfig", "health_check_ca_file", "health_check_cert_file",
                 "health_check_key_file", "health_check_token_file"):
        path = getattr(config, name)
        if path:
            mount = mounts[path]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["hostPath"] == {"path": path, "type": "File"}
    if config.enable_discovery:
        # The client writes embedded kubeconfig certificates to temporary files.
        assert volumes[mounts["/tmp"]["name"]]["emptyDir"]["medium"] == "Memory"
    else:
        assert "/tmp" not in mounts
    # The writable directories (state file) are host directories handed to uid 65534.
    state = getattr(config, "state_file", "")
    if state:
        mount = mounts[os.path.dirname(state)]
        assert not mount.get("readOnly")
        assert volumes[mount["name"]]["hostPath"]["type"] == "DirectoryOrCreate"
        (init,) = spec["initContainers"]
        assert init["command"][-1] == os.path.dirname(state)
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    drain = getattr(config, "shutdown_drain_timeout", 0.0)
    assert spec["terminationGracePeriodSeconds"] > drain + 10
    image = next((a.split("=", 1)[1] for a in args if a.startswith("--image=")),
                 staticpod.IMAGE)
    assert c["image"] == image


def test_the_env_is_exactly_the_flags_given_and_the_profile() -> None:
    args = CASES["discovery-readyz-kubelet-cert"]
    given = {}
    for arg in args:
        name, value = arg[2:].split("=", 1)
        given["EP_" + name.upper().replace("-", "_")] = value
    # The production profile fills in what was not given; a given value wins.
    assert env_of(pod_for(*args, "--health-interval=10s")) == {
        **profile.env(), **given, "EP_HEALTH_INTERVAL": "10s"}
    assert env_of(pod_for(*args, "--profile=none")) == given


def test_default_image_is_the_one_named_in_the_chart_and_the_examples() -> None:
    values = _values()
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert f"{values['image']['repository']}:{chart['appVersion']}" == staticpod.IMAGE
    assert f"{staticpod.IMAGE_REPOSITORY}:{extractedprism.__version__}" == staticpod.IMAGE
    assert f'IMAGE_NAME="{staticpod.IMAGE_REPOSITORY}"' in (ROOT / "scripts/image").read_text()
    images = []
    (kubeadm,) = load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "extractedprism.yaml")
    images.append(kubeadm["spec"]["containers"][0]["image"])
    (talos,) = load_yaml_docs(EXAMPLES_DIR / "talos" / "machine-config-patch.yaml")
    images += [c["image"] for p in talos["machine"]["pods"] for c in p["spec"]["containers"]]
    assert set(images) == {staticpod.IMAGE}
    for path in EXAMPLES_DIR.rglob("*"):
        if path.is_file():
            assert "ghcr.io/lexfrei" not in path.read_text(), f"{path}: another project's image"


BAD: dict[str, list[str]] = {
    "timeout-not-below-interval": ["--health-interval=10s"],
    "threshold-not-above-interval": ["--liveness-threshold=5s"],
    "sub-second-interval": ["--health-interval=500ms", "--health-timeout=400ms"],
    "readyz-without-ca": ["--health-check=readyz"],
    "cert-without-key": ["--health-check-cert-file=/c.pem"],
    "blank-server-name": ["--health-check-server-name= "],
    "same-ports": ["--bind-port=7446"],
    "bad-duration": ["--drain-timeout=soon"],
    "bad-choice": ["--upstream-selection=fastest"],
    "no-endpoints": ["--endpoints="],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_flags_are_validated_exactly_like_the_server(case: str) -> None:
    args = [f"--endpoints={ENDPOINTS}", "--enable-discovery=false", *BAD[case]]
    server = run_cli(*args)  # exits 2 before it opens any port
    assert server.returncode == 2, server.stderr
    pod = run_cli("static-pod", "--profile=none", *args)  # the server's defaults too
    assert pod.returncode == 2
    assert pod.stdout == ""
    assert pod.stderr == server.stderr  # the same problems, the same words
    assert "--" in pod.stderr.splitlines()[1]  # names the flag


def test_discovery_without_a_kubeconfig_is_accepted_like_the_server_but_warned() -> None:
    # The server accepts discovery without in-cluster credentials (it logs the failure), so
    # static-pod does too; it says once, on stderr, that discovery cannot work like that.
    proc = run_cli("static-pod", f"--endpoints={ENDPOINTS}", CA_ARG)
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.splitlines()
    assert "warning" in warning and "--kubeconfig" in warning and "--enable-discovery" in warning
    (pod,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    k8s_validate(pod)
    assert config_of(pod).enable_discovery
    with pytest.raises(ConfigError) as err:
        staticpod.render([f"--endpoints={ENDPOINTS}", "--image= "])
    assert "--image must not be empty" in err.value.problems


def test_help_names_the_subcommand_and_the_image_flag() -> None:
    proc = run_cli("static-pod", "--help")
    assert proc.returncode == 0
    assert "extractedprism static-pod" in proc.stdout
    assert "--image" in proc.stdout and staticpod.IMAGE in proc.stdout
    assert "/etc/kubernetes/manifests" in proc.stdout


def test_kubeadm_example_is_what_static_pod_prints() -> None:
    text = (EXAMPLES_DIR / "kubeadm" / "extractedprism.yaml").read_text()
    (example,) = load_yaml_docs(EXAMPLES_DIR / "kubeadm" / "extractedprism.yaml")
    command = [line.lstrip("# ").rstrip(" \\") for line in text.splitlines()
               if line.startswith("#   ") or line.startswith("#     ")]
    args = " ".join(command).split()
    assert args[:2] == ["extractedprism", "static-pod"], command
    assert example == pod_for(*args[2:]), "regenerate examples/kubeadm/extractedprism.yaml"


# --- systemd -------------------------------------------------------------------------------

SYSTEMD = EXAMPLES_DIR / "systemd"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((SYSTEMD / "extractedprism.service").read_text())
    return parser


def _env_file() -> dict[str, str]:
    out = {}
    for line in (SYSTEMD / "extractedprism.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _profile_env_file() -> dict[str, str]:
    out = {}
    for line in (SYSTEMD / "profile.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_systemd_env_file_is_a_configuration_the_program_accepts() -> None:
    env = _env_file()
    unit = _unit()
    # Two EnvironmentFile lines (profile.env, then this one); configparser keeps the last.
    assert unit["Service"]["EnvironmentFile"] == "/etc/extractedprism/extractedprism.env"
    for key, value in _profile_env_file().items():
        env.setdefault(key, value)
    for line in unit["Service"]["Environment"].split():
        key, _, value = line.partition("=")
        env[key] = value.replace("%d", "/run/credentials/extractedprism.service")
    assert set(env) <= ENV_NAMES, f"unknown EP_ variables {set(env) - ENV_NAMES}"
    config = validate({f.dest: env.get(f.env) for f in FLAGS})
    assert config.kubeconfig == "/run/credentials/extractedprism.service/kubeconfig"
    assert unit["Service"]["LoadCredential"] == f"kubeconfig:{KUBECONFIG}"
    assert config.bind_address == "127.0.0.1" and config.bind_port == 7445
    stop = parse_duration(unit["Service"]["TimeoutStopSec"])
    assert stop > getattr(config, "shutdown_drain_timeout", 0.0) + 10
    state = getattr(config, "state_file", "")
    assert state.startswith("/var/lib/" + unit["Service"]["StateDirectory"] + "/")


def test_systemd_unit_runs_unprivileged_before_the_kubelet() -> None:
    unit = _unit()
    assert "kubelet.service" in unit["Unit"]["Before"].split()
    service = unit["Service"]
    assert service["ExecStart"] == "/opt/extractedprism/bin/extractedprism"
    assert service["DynamicUser"] == "yes"
    assert service["NoNewPrivileges"] == "yes"
    assert service["CapabilityBoundingSet"] == ""
    assert service["ProtectSystem"] == "strict"
    assert service["Restart"] == "always"
    dropin = configparser.ConfigParser(interpolation=None)
    dropin.read_string((SYSTEMD / "kubelet-after-extractedprism.conf").read_text())
    assert dropin["Unit"]["After"] == dropin["Unit"]["Wants"] == "extractedprism.service"
    readme = (SYSTEMD / "README.md").read_text()
    for f in ("extractedprism.service", "extractedprism.env", "kubelet-after-extractedprism.conf"):
        assert f in readme


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # Verified with ExecStart pointing at the console script this test environment has.
    exe = Path(sys.executable).parent / "extractedprism"
    text = (SYSTEMD / "extractedprism.service").read_text().replace(
        "/opt/extractedprism/bin/extractedprism", str(exe))
    unit = tmp_path / "extractedprism.service"
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "extractedprism.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


# --- plain YAML (issue 30 item 6) --------------------------------------------------------

ANCHOR = re.compile(r"(^|[\s:\-\[{,])[&*][A-Za-z0-9_]+")


def test_output_is_plain_yaml_without_anchors_and_parses_to_the_same_pod() -> None:
    # The init container and the proxy share the host directories' mounts: the case that
    # printed `- &id001 ...` / `- *id001` before.
    args = [f"--endpoints={ENDPOINTS}", f"--kubeconfig={KUBECONFIG}", CA_ARG,
            "--state-file=/var/lib/extractedprism/state.json",
            "--handover-socket=/run/extractedprism/handover.sock"]
    proc = run_cli("static-pod", *args)
    assert proc.returncode == 0, proc.stderr
    assert not [line for line in proc.stdout.splitlines() if ANCHOR.search(line)], proc.stdout
    pod, _ = staticpod.render(args)
    (init,) = pod["spec"]["initContainers"]
    assert any(m in init["volumeMounts"] for m in pod["spec"]["containers"][0]["volumeMounts"])
    (printed,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert printed == pod
    # The pattern does find an anchor where PyYAML's own dumper writes one.
    assert ANCHOR.search(yaml.safe_dump(pod, sort_keys=False))
