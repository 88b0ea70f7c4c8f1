"""What a control-plane run needs from this machine and names itself by: the fixed names and
addresses, the state root, `ip`, the prerequisites check, and CPError."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

from epscripts.controlplane import build as cpbuild

APISERVERS = ("api1", "api2", "api3")
# API servers a run can add and remove (api4: scale-out/in, scripts/chaos; api5-api7: a
# whole control plane on new addresses, tests/controlplane/test_stale_membership.py):
# their addresses are reserved and in the serving certificate from the start, their
# namespaces are made only by ControlPlane.add_apiserver, and they are never in
# APISERVERS (the static --endpoints).
SPARE_APISERVERS = ("api4", "api5", "api6", "api7")
PORT = 6443
ETCD_PORT = 2379
SUBNET_POOL = [ipaddress.ip_network(f"192.168.{n}.0/24") for n in range(200, 255)]
HOST_INDEX = {"bridge": 1, "etcd": 10, "api1": 11, "api2": 12, "api3": 13, "api4": 14,
              "api5": 15, "api6": 16, "api7": 17}
DEAD_MAC = "02:00:00:00:de:ad"  # locally administered; no interface has it
SERVER_NAME = "kubernetes.default.svc"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
NODE_NAME = "node1"  # the node whose client certificate the run issues
UP_TIMEOUT = 120.0  # from nothing to three ready apiservers listed in the slice
STATE_ROOT_DEFAULT = "/tmp/extractedprism-controlplane"

# Default-on admission plugins the tests never exercise; off, the apiservers start faster
# and need less memory. NamespaceLifecycle stays (namespaces are used and deleted).
DISABLED_ADMISSION = ",".join([
    "ServiceAccount", "TaintNodesByCondition", "PodSecurity", "Priority",
    "DefaultTolerationSeconds", "DefaultStorageClass", "StorageObjectInUseProtection",
    "PersistentVolumeClaimResize", "RuntimeClass", "CertificateApproval",
    "CertificateSigning", "ClusterTrustBundleAttest", "CertificateSubjectRestriction",
    "DefaultIngressClass", "MutatingAdmissionWebhook", "ValidatingAdmissionWebhook",
    "ValidatingAdmissionPolicy", "ResourceQuota", "LimitRanger",
])

# What a production cluster admits with, for a start that asks for it
# (ControlPlane.production_admission): every default-on plugin (nothing disabled) plus
# NodeRestriction, which kubeadm enables; PodSecurity's cluster-wide default is "baseline"
# as hardened clusters set it (warn and audit "restricted"), no namespace exempt, so only
# a namespace's own label lets a privileged pod in.
PRODUCTION_ADMISSION_ENABLE = "NodeRestriction"
POD_SECURITY_DEFAULTS = {"enforce": "baseline", "warn": "restricted", "audit": "restricted"}


class CPError(Exception):
    """A control-plane operation failed; the message says which and why."""


def state_root() -> Path:
    return Path(os.environ.get("EP_CONTROLPLANE_STATE") or STATE_ROOT_DEFAULT)


def say(msg: str) -> None:
    print(f"controlplane: {msg}", file=sys.stderr, flush=True)


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise CPError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def missing_prerequisites() -> str | None:
    """What this machine lacks for a control plane, in one line (None: nothing)."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    if run_ip("netns", "list", check=False).returncode != 0:
        return "`ip netns` does not work here"
    if shutil.which("openssl") is None:
        return "no `openssl` command (needed for the run's PKI)"
    if cpbuild.missing() and cpbuild.find_go() is None:
        return "no Go toolchain to build etcd/kube-apiserver (set GO= or install Go)"
    return None
