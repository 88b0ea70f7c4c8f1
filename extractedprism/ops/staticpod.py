"""``extractedprism static-pod [flags]``: the kubelet-safe way to run the proxy.

The kubelet cannot depend on a DaemonSet for its own API access (at boot, and during the
DaemonSet's rollout, it would need the API to start the pod that gives it the API), but it
starts static pods from /etc/kubernetes/manifests by itself. This prints such a pod for the
same flags the server takes, validated exactly like the server (exit 2, every problem
named), with what the chart's pod has: the node's network and resolver, node-critical
priority, liveness on /healthz and readiness on /readyz of the health port, the chart's
security context, and every file a flag names mounted from the host at the same path.

A static pod has no service-account token, so discovery reads a kubeconfig given with
--kubeconfig (mounted read-only from the host; a warning on stderr when discovery is on
without one); see docs/deploy.md for the least-privilege identity to put in it.

The pod runs the production profile (config/profile.py) for every flag of it not given:
what the chart ships, so every deployment path behaves alike. Its readyz check needs
--health-check-ca-file (the cluster CA on the node); ``--profile=none`` keeps the spec's
defaults instead.
"""

from __future__ import annotations

import math
import posixpath
import sys
from collections.abc import Sequence
from typing import Any

from extractedprism import __version__
from extractedprism.config import profile
from extractedprism.config.parser import build_parser as server_parser
from extractedprism.config.parser import join_dash_values
from extractedprism.config.table import (
    FLAG_BY_NAME,
    FLAGS,
    READYZ_NEEDS_CA,
    Config,
    ConfigError,
    validate,
)

# This project's image, named as scripts/image names it and as the chart's values.yaml
# does (image.repository + appVersion); tests/deploy checks that the three agree.
IMAGE_REPOSITORY = "localhost/extractedprism"
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
NAMESPACE = "kube-system"
NAME = "extractedprism"
MANIFEST_PATH = "/etc/kubernetes/manifests/extractedprism.yaml"

# The chart's podSecurityContext / securityContext / resources / probe timings.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "runAsGroup": 65534,
    "seccompProfile": {"type": "RuntimeDefault"},
}
SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "runAsGroup": 65534,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESOURCES: dict[str, Any] = {"requests": {"cpu": "50m", "memory": "40Mi"},
                             "limits": {"memory": "256Mi"}}
LIVENESS_TIMING = {"initialDelaySeconds": 5, "periodSeconds": 10, "timeoutSeconds": 3,
                   "failureThreshold": 3}
READINESS_TIMING = {"initialDelaySeconds": 2, "periodSeconds": 5, "timeoutSeconds": 3,
                    "failureThreshold": 2}
# What static-pod says instead of the table's READYZ_NEEDS_CA when readyz came from the
# production profile rather than from the operator.
PROFILE_READYZ_NEEDS_CA = (
    "--health-check=readyz (the production profile's) requires --health-check-ca-file: give "
    "the cluster CA on the node (/etc/kubernetes/pki/ca.crt with kubeadm), or "
    "--health-check=tcp, or --profile=none for the spec's defaults")
# The program's own shutdown after the drain: 5 s for the proxy, 5 s for the health server.
SHUTDOWN_BUDGET = 10
GRACE_MARGIN = 5

# Hands the writable host directories (created root-owned by the kubelet) to uid 65534,
# once: a later start finds them handed over already, and changing their mode then would
# need CAP_FOWNER. The same script as the chart's init container.
_CHOWN_SCRIPT = (
    "import os, sys\n"
    "uid, gid = int(sys.argv[1]), int(sys.argv[2])\n"
    "for d in sys.argv[3:]:\n"
    "    st = os.stat(d)\n"
    "    if (st.st_uid, st.st_gid) != (uid, gid):\n"
    "        os.chmod(d, 0o700)\n"
    "        os.chown(d, uid, gid)\n"
)


def build_parser() -> Any:
    parser = server_parser()
    parser.prog = "extractedprism static-pod"
    parser.description = (
        "Print a static pod manifest that runs extractedprism with these flags, for "
        f"{MANIFEST_PATH} (the kubelet starts it before it can reach any API server). "
        "Takes every flag of the server, validated the same way, plus --image.")
    parser.add_argument("--image", default=IMAGE, metavar="IMAGE",
                        help=f"Container image (default: {IMAGE})")
    parser.add_argument("--profile", choices=tuple(profile.PROFILES), default=profile.NAME,
                        help="Values for the flags not given: production (the profile the "
                        "chart ships, `extractedprism profile` lists it; its readyz check "
                        "needs --health-check-ca-file) or none (the program's defaults, the "
                        f"spec's) (default: {profile.NAME})")
    return parser


def probe_host(config: Config) -> str:
    """The address the kubelet probes: the listener's, loopback for a wildcard listener."""
    addr = config.health_bind_address
    if addr == "0.0.0.0":
        return "127.0.0.1"
    if addr == "::":
        return "::1"
    return addr


def _read_only_files(config: Config) -> list[str]:
    names = ("kubeconfig", "health_check_ca_file", "health_check_cert_file",
             "health_check_key_file", "health_check_token_file")
    out: list[str] = []
    for name in names:
        path = str(getattr(config, name, "") or "").strip()
        if path and path not in out:
            out.append(path)
    return out


def _writable_dirs(config: Config) -> list[str]:
    out: list[str] = []
    for name in ("handover_socket", "state_file"):
        path = str(getattr(config, name, "") or "").strip()
        if name == "state_file" and not config.enable_discovery:
            continue  # the program does not read it without discovery
        if path and posixpath.dirname(path) not in out:
            out.append(posixpath.dirname(path))
    return out


def manifest(config: Config, env: dict[str, str], image: str) -> dict[str, Any]:
    """The Pod object for a validated configuration and the flag values given (as EP_ env)."""
    files = _read_only_files(config)
    dirs = _writable_dirs(config)
    admin_socket = str(getattr(config, "admin_socket", "") or "").strip()
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, path in enumerate(files):
        volumes.append({"name": f"host-file-{i}", "hostPath": {"path": path, "type": "File"}})
        mounts.append({"name": f"host-file-{i}", "mountPath": path, "readOnly": True})
    dir_mounts = []
    for i, path in enumerate(dirs):
        volumes.append({"name": f"host-dir-{i}",
                        "hostPath": {"path": path, "type": "DirectoryOrCreate"}})
        dir_mounts.append({"name": f"host-dir-{i}", "mountPath": path})
    mounts.extend(dir_mounts)
    if config.enable_discovery and config.kubeconfig:
        # The Kubernetes client writes a kubeconfig's embedded certificate data to temporary
        # files; the root filesystem stays read-only, /tmp is a small memory volume.
        volumes.append({"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
    if admin_socket:
        volumes.append({"name": "admin-socket",
                        "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        mounts.append({"name": "admin-socket", "mountPath": posixpath.dirname(admin_socket)})

    drain = float(getattr(config, "shutdown_drain_timeout", 0.0) or 0.0)
    host = probe_host(config)
    container: dict[str, Any] = {
        "name": NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "livenessProbe": {"httpGet": {"host": host, "path": "/healthz",
                                      "port": config.health_port, "scheme": "HTTP"},
                          **LIVENESS_TIMING},
        "readinessProbe": {"httpGet": {"host": host, "path": "/readyz",
                                       "port": config.health_port, "scheme": "HTTP"},
                           **READINESS_TIMING},
        "securityContext": dict(SECURITY_CONTEXT),
        "resources": RESOURCES,
    }
    if mounts:
        container["volumeMounts"] = mounts
    spec: dict[str, Any] = {
        # The node's own network, before (and without) the CNI plugin; the node's resolver,
        # before cluster DNS exists.
        "hostNetwork": True,
        "dnsPolicy": "Default",
        "priorityClassName": "system-node-critical",
        # A static pod gets no service-account token; discovery uses --kubeconfig.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": math.ceil(drain) + SHUTDOWN_BUDGET + GRACE_MARGIN,
        "securityContext": dict(POD_SECURITY_CONTEXT),
    }
    if dirs:
        spec["initContainers"] = [{
            "name": "host-dirs",
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["/opt/venv/bin/python", "-c", _CHOWN_SCRIPT,
                        str(SECURITY_CONTEXT["runAsUser"]), str(SECURITY_CONTEXT["runAsGroup"]),
                        *dirs],
            "securityContext": {
                "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                "privileged": False,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": dir_mounts,
        }]
    spec["containers"] = [container]
    if volumes:
        spec["volumes"] = volumes
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": NAME,
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/name": NAME,
                       "app.kubernetes.io/component": "apiserver-proxy",
                       "tier": "node"},
        },
        "spec": spec,
    }


def warnings(config: Config) -> list[str]:
    """What the pod would do that the operator probably does not want (it still starts)."""
    if config.enable_discovery and not config.kubeconfig.strip():
        return ["discovery is on but --kubeconfig is not given: a static pod has no "
                "service-account token, so discovery will only log errors and the static "
                "--endpoints are all it uses; give --kubeconfig PATH (a file on the node) or "
                "--enable-discovery=false"]
    return []


def render(argv: Sequence[str]) -> tuple[dict[str, Any], Config]:
    """Parse and validate like the server; raise ConfigError with every problem."""
    ns = vars(build_parser().parse_args(join_dash_values(list(argv))))
    image = str(ns.pop("image") or "").strip()
    settings = profile.PROFILES[ns.pop("profile")]
    from_profile = set()
    for setting in settings:
        dest = FLAG_BY_NAME[setting.flag].dest
        if ns.get(dest) is None:  # not given on the command line nor in an EP_ variable
            ns[dest] = setting.value
            from_profile.add(setting.flag)
    problems: list[str] = []
    config: Config | None = None
    try:
        config = validate(ns)
    except ConfigError as exc:
        for problem in exc.problems:
            if "health-check" in from_profile and problem == READYZ_NEEDS_CA:
                problem = PROFILE_READYZ_NEEDS_CA
            problems.append(problem)
    if not image:
        problems.append("--image must not be empty")
    if problems or config is None:
        raise ConfigError(problems)
    # The values as given, so the pod says exactly what was asked; defaults stay defaults.
    env = {f.env: str(ns[f.dest]) for f in FLAGS if ns.get(f.dest) is not None}
    return manifest(config, env, image), config


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        pod, config = render(args)
    except ConfigError as exc:
        print("extractedprism: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    for warning in warnings(config):
        print(f"extractedprism static-pod: warning: {warning}", file=sys.stderr)
    sys.stdout.write(f"# {MANIFEST_PATH}: generated by extractedprism {__version__} "
                     "static-pod; the kubelet runs it without any API server.\n")
    sys.stdout.write(dump(pod))
    return 0


def dump(pod: dict[str, Any]) -> str:
    """Plain YAML: no anchors and aliases (``&id001`` / ``*id001``) where two containers
    share an object (the host directories' mounts), which read as noise to an operator."""
    # PyYAML comes with the kubernetes client, a dependency of the proxy itself.
    import yaml

    class PlainDumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(pod, Dumper=PlainDumper, sort_keys=False, default_flow_style=False)
