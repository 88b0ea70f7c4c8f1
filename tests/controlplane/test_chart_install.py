"""The chart and the static pod on a real API server, admitted as a production cluster
admits them, run by real kubelets.

The three kube-apiservers are restarted with a production cluster's admission (every
default-on plugin, which the control plane otherwise turns off, plus NodeRestriction;
PodSecurity's cluster-wide default ``enforce: baseline``, ``warn``/``audit: restricted``:
ControlPlane.production_admission). Three hollow nodes (kubemark: the kubelet's own code
with a fake container runtime; docs/fleet.md) each reach the API through their own
extractedprism, and kube-controller-manager and kube-scheduler run as in production.

* The Pod Security level the chart meets: the rendered DaemonSet is checked by the API
  server's own PodSecurity admission at ``baseline`` and ``restricted``; the checks it
  fails are exactly the ones docs/deploy.md names.
* ``extractedprism static-pod``'s manifest in a hollow kubelet's manifest directory: the
  mirror pod is forbidden while kube-system has no Pod Security label (the cluster default
  is baseline), appears once the label docs/deploy.md recommends is set, and is Running.
* The chart (rendered by Helm's engine as tests/deploy renders it, applied with
  ``kubectl apply --server-side`` in Helm's install order) with its defaults and the
  PodMonitor on: every object accepted (the PodMonitor against a CRD), one pod on every
  node, with priority, service-account token and volumes as admission and the kubelet
  made them.
* An upgrade with a changed value rolls the pods node by node with the strategy the chart
  declares: never a node without an available pod beyond ``maxUnavailable``, never more
  surge pods than ``maxSurge``, the old pod deleted only ``minReadySeconds`` after the new
  one became ready; every pod event is seen through a watch.

kubemark's fake runtime never ends a container (it has no processes), so an init container
never completes there: with the chart's defaults (state file and handover socket, whose host
directories an init container hands to uid 65534) the pods are placed, admitted and their
init container started, and stay at Init:0/1. The roll is therefore done with
``stateFile`` and ``handoverSocket`` empty (no host directories, no init container); the
strategy does not depend on them.

Skipped, with one line, where the control plane cannot run or the fleet's binaries are not
built (`scripts/fleet build`).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane.conftest import INTERVAL, SLACK, TIMEOUT, fleet_why_not, record, restore
from tests.util import wait_until

_WHY = fleet_why_not()
if _WHY:
    pytest.skip(f"fleet tests: {_WHY}", allow_module_level=True)

from epscripts.fleet import observe  # noqa: E402 - scripts/ is on the path (conftest)
from epscripts.fleet.nodes import Fleet  # noqa: E402

from tests.controlplane import harness  # noqa: E402
from tests.deploy.helpers import ENDPOINTS, render  # noqa: E402

# Rendered at import: the first call into Helm's Go runtime opens descriptors it keeps for
# the process's life, which a test's fd-leak guard would blame on that test.
render({"endpoints": ENDPOINTS})

pytestmark = [pytest.mark.controlplane]

NODES = 3
NS = "kube-system"  # docs/deploy.md: system-node-critical is admitted there by default
SELECTOR = "app.kubernetes.io/name=extractedprism,app.kubernetes.io/instance=extractedprism"
PSA = "pod-security.kubernetes.io"
# docs/deploy.md's recommendation for the namespace the proxy runs in.
PRIVILEGED_LABEL = {f"{PSA}/enforce": "privileged"}
SYSTEM_NODE_CRITICAL = 2000001000  # the built-in PriorityClass's value
# Helm installs in kind order (pkg/release/util/kind_sorter.go InstallOrder); kinds it does
# not know (the PodMonitor) come last. `kubectl apply` keeps file order, so the objects are
# sorted the same way: the ServiceAccount must exist before the DaemonSet's first pod.
HELM_ORDER = ["ServiceAccount", "Role", "RoleBinding", "DaemonSet"]
# The Pod Security checks the chart's default pod fails, by level, as PodSecurity names
# them (docs/deploy.md says why each is inherent to a node-local proxy).
BASELINE_FAILS = {"host namespaces", "hostPath volumes", "probe or lifecycle host"}
RESTRICTED_FAILS = {"host namespaces", "restricted volume types", "probe or lifecycle host",
                    "unrestricted capabilities", "runAsNonRoot != true", "runAsUser=0"}
# A bound on one pod's way from creation to Ready on a hollow node (scheduling, admission,
# volume set-up, the fake runtime's start, the status update), generous for a loaded machine.
POD_START = 20.0
WATCH_S = 3  # one server-side watch of the roll's pods (timeoutSeconds)

# The PodMonitor CRD, minimal: only the fields the chart writes, with the types, enums and
# patterns of prometheus-operator's monitoring.coreos.com_podmonitors.yaml (v0.91); the
# full definition is 80 kB of fields the chart never sets. kubectl's server-side apply
# validates strictly, so a field the chart wrote that the CRD lacks would fail as it would
# against the full CRD.
_DURATION = ("^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
             "(([0-9]+)ms)?)$")
_STR = {"type": "string"}
PODMONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "PodMonitor", "listKind": "PodMonitorList",
                       "plural": "podmonitors", "singular": "podmonitor",
                       "shortNames": ["pmon"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                     "apiVersion": _STR, "kind": _STR, "metadata": {"type": "object"},
                     "spec": {"type": "object", "required": ["selector"], "properties": {
                         "selector": {"type": "object", "x-kubernetes-map-type": "atomic",
                                      "properties": {"matchLabels": {
                                          "type": "object", "additionalProperties": _STR}}},
                         "namespaceSelector": {"type": "object", "properties": {
                             "matchNames": {"type": "array", "items": _STR}}},
                         "podMetricsEndpoints": {"type": "array", "items": {
                             "type": "object", "properties": {
                                 "path": _STR,
                                 "scheme": {"type": "string",
                                            "enum": ["http", "https", "HTTP", "HTTPS"]},
                                 "interval": {"type": "string", "pattern": _DURATION},
                                 "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                                 "relabelings": {"type": "array", "items": {
                                     "type": "object", "properties": {
                                         "action": {"type": "string", "default": "replace"},
                                         "sourceLabels": {"type": "array", "items": _STR},
                                         "regex": _STR, "targetLabel": _STR,
                                         "replacement": _STR}}}}}}}}}}}}]},
}


# --- the cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(control_plane: Any) -> Iterator[Fleet]:
    """Production admission on every API server, then three hollow nodes; everything the
    module made is removed at the end (the next test's ``cluster`` restarts the API servers
    with the control plane's own flags)."""
    cp = control_plane
    restart_s = restore(cp, cp.production_admission())
    f = Fleet(cp)
    if f.state["nodes"]:  # a crashed earlier session of this run
        f.down()
    try:
        up_s = f.up(NODES, "extractedprism", ep_cmd=[sys.executable, "-m", "extractedprism"],
                    lb_extra=[f"--health-interval={INTERVAL:g}s",
                              f"--health-timeout={TIMEOUT:g}s"],
                    controllers_api="api1", timeout=90)
        record("chart on the fleet", admission_restart_s=round(restart_s, 1),
               fleet_up_s=round(up_s, 1))
        yield f
    finally:
        for args in (["delete", "daemonset", "extractedprism", "-n", NS, "--wait=false"],
                     ["delete", "crd", "podmonitors.monitoring.coreos.com", "--wait=false"],
                     ["label", "namespace", NS, f"{PSA}/enforce-"]):
            kubectl(cp, *args, check=False)
        _delete_chart_objects(cp)
        f.down()


def kubectl(cp: Any, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The pinned kubectl as the run's admin, against api1; stderr carries the warnings."""
    proc = subprocess.run([cp.binary("kubectl"), "--kubeconfig",
                           str(Path(cp.dir) / "admin-api1.kubeconfig"), *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr.strip()}"
    return proc


def apply(cp: Any, docs: list[dict[str, Any]], *, dry_run: bool = False
          ) -> subprocess.CompletedProcess[str]:
    """``kubectl apply --server-side`` of ``docs`` in Helm's install order."""
    ordered = sorted(docs, key=lambda d: (HELM_ORDER.index(d["kind"]) if d["kind"] in HELM_ORDER
                                          else len(HELM_ORDER)))
    args = ["apply", "--server-side", "--field-manager=helm", "-f", "-"]
    if dry_run:
        args.append("--dry-run=server")
    return kubectl(cp, *args, stdin=yaml.safe_dump_all(ordered))


def chart(cp: Any, **values: Any) -> list[dict[str, Any]]:
    """The chart rendered for this control plane's API servers."""
    return render({"endpoints": cp.endpoints, **values})[0]


def get(cp: Any, path: str) -> dict[str, Any]:
    status, body = cp.request("api1", path)
    assert status == 200, (path, status, body)
    return body  # type: ignore[no-any-return]


def pods(cp: Any) -> list[dict[str, Any]]:
    sel = SELECTOR.replace("=", "%3D").replace(",", "%2C")
    return get(cp, f"/api/v1/namespaces/{NS}/pods?labelSelector={sel}")["items"]


def set_namespace_labels(cp: Any, labels: dict[str, str | None], ns: str = NS) -> None:
    status, body = cp.request("api1", f"/api/v1/namespaces/{ns}", method="PATCH",
                              body={"metadata": {"labels": labels}},
                              content_type="application/merge-patch+json")
    assert status == 200, (status, body)


def _delete_chart_objects(cp: Any) -> None:
    for path in (f"/api/v1/namespaces/{NS}/serviceaccounts/extractedprism",
                 "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles/extractedprism",
                 "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings/"
                 "extractedprism"):
        with contextlib.suppress(OSError):
            cp.request("api1", path, method="DELETE")


def ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def ready_since(pod: dict[str, Any]) -> float:
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    return observe.parse_time(cond["lastTransitionTime"])


def wait_pods_gone(cp: Any, timeout: float) -> None:
    wait_until(lambda: not pods(cp), timeout, interval=0.5, message="the chart's pods gone")


# --- Pod Security ----------------------------------------------------------------


def _violations(stderr: str, level: str) -> set[str]:
    """The check names in PodSecurity's warning: `would violate PodSecurity "L:latest":
    host namespaces (hostNetwork=true), hostPath volumes (volumes ...), ...`."""
    m = re.search(rf'would violate PodSecurity "{level}:latest": (.*)', stderr)
    assert m, f"no PodSecurity {level} warning in: {stderr!r}"
    # Drop the parenthesised details (which may hold commas), then split on commas.
    text = m.group(1)
    for _ in range(10):  # nested parentheses: bounded
        text, n = re.subn(r"\s*\([^()]*\)", "", text)
        if not n:
            break
    return {part.strip() for part in text.split(",") if part.strip()}


@pytest.mark.timeout(300)  # with the module's set-up: API server restarts, fleet up
def test_pod_security_level_the_chart_meets_is_privileged(fleet: Fleet) -> None:
    """The API server's own PodSecurity checks the rendered DaemonSet at each level: it
    fails baseline on exactly the checks docs/deploy.md names, so it needs `privileged`."""
    cp = fleet.cp
    ds = next(d for d in chart(cp) if d["kind"] == "DaemonSet")
    found = {}
    for level in ("baseline", "restricted"):
        ns = f"ep-psa-{level}"
        kubectl(cp, "create", "namespace", ns)
        try:
            set_namespace_labels(cp, {f"{PSA}/enforce": "privileged", f"{PSA}/warn": level},
                                 ns=ns)
            doc = json.loads(json.dumps(ds))
            doc["metadata"]["namespace"] = ns
            found[level] = _violations(apply(cp, [doc], dry_run=True).stderr, level)
        finally:
            kubectl(cp, "delete", "namespace", ns, "--wait=false", check=False)
    record("chart pod security", baseline_fails=sorted(found["baseline"]),
           restricted_fails=sorted(found["restricted"]))
    assert found["baseline"] == BASELINE_FAILS
    assert found["restricted"] == RESTRICTED_FAILS


# --- the static pod --------------------------------------------------------------


@pytest.mark.timeout(180)
def test_static_pod_manifest_runs_on_a_hollow_kubelet(fleet: Fleet) -> None:
    cp = fleet.cp
    node = fleet.nodes[0]
    roots = fleet.kubelet_roots(node)
    assert roots, f"kubelet {node} named no root directory in its log"
    manifests = sorted(roots[-1].glob("static-pods*"))
    assert len(manifests) == 1, manifests
    out = subprocess.run(
        [sys.executable, "-m", "extractedprism", "static-pod",
         f"--endpoints={','.join(cp.endpoints)}", "--kubeconfig=/etc/extractedprism/kubeconfig",
         f"--health-check-ca-file={cp.ca}"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    manifest = manifests[0] / "extractedprism.yaml"
    mirror = f"/api/v1/namespaces/{NS}/pods/extractedprism-{node}"
    set_namespace_labels(cp, {f"{PSA}/enforce": None})  # the cluster default: baseline
    log_mark = len(fleet.log(f"kubelet-{node}"))
    # Renamed into place: the kubelet reads the directory on inotify events and skips
    # dot files, so it never sees half a manifest.
    tmp = manifests[0] / ".extractedprism.yaml"
    tmp.write_text(out)
    tmp.rename(manifest)
    try:
        # Without the label the kubelet runs the pod but the API server refuses its mirror.
        def refused() -> bool:
            return "is forbidden: violates PodSecurity" in fleet.log(f"kubelet-{node}")[log_mark:]

        wait_until(refused, 60, interval=0.5,
                   message=f"kubelet {node} told its mirror pod is forbidden")
        assert cp.request("api1", mirror)[0] == 404
        t_label = time.monotonic()
        set_namespace_labels(cp, PRIVILEGED_LABEL)

        def running() -> bool:
            status, pod = cp.request("api1", mirror)
            return status == 200 and pod["status"].get("phase") == "Running" and ready(pod)

        # The kubelet retries the mirror pod on its next sync of the pod (syncFrequency 10 s
        # in kubemark's configuration).
        wait_until(running, 10 + POD_START, interval=0.5, message=f"mirror pod on {node} Running")
        took = time.monotonic() - t_label
        pod = get(cp, mirror)
        ann = pod["metadata"]["annotations"]
        assert ann["kubernetes.io/config.source"] == "file"
        assert "kubernetes.io/config.mirror" in ann
        assert pod["spec"]["nodeName"] == node
        assert pod["spec"]["priority"] == SYSTEM_NODE_CRITICAL  # Priority admission resolved it
        assert not pod["spec"].get("serviceAccountName")  # a mirror pod may not have one
        record("static pod mirror", node=node, running_after_label_s=round(took, 1))
    finally:
        manifest.unlink(missing_ok=True)
        set_namespace_labels(cp, PRIVILEGED_LABEL)
    wait_until(lambda: cp.request("api1", mirror)[0] == 404, 30 + POD_START, interval=0.5,
               message="mirror pod removed with its manifest")


# --- the chart -------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_chart_is_accepted_and_placed_on_every_node(fleet: Fleet) -> None:
    cp = fleet.cp
    docs = chart(cp, podMonitor={"enabled": True}, healthBindAddress="0.0.0.0")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["DaemonSet", "PodMonitor", "Role", "RoleBinding", "ServiceAccount"], kinds
    apply(cp, [PODMONITOR_CRD])
    kubectl(cp, "wait", "--for=condition=Established",
            "crd/podmonitors.monitoring.coreos.com", "--timeout=30s")
    set_namespace_labels(cp, {f"{PSA}/enforce": None})
    sa = [d for d in docs if d["kind"] == "ServiceAccount"]
    apply(cp, sa)
    # Without the namespace label the cluster default (baseline) refuses the pod itself.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "extractedprism-admission-check", "namespace": NS},
           "spec": next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]}
    status, body = cp.request("api1", f"/api/v1/namespaces/{NS}/pods?dryRun=All",
                              method="POST", body=pod)
    assert status == 403 and 'violates PodSecurity "baseline:latest"' in body["message"], (
        status, body)
    set_namespace_labels(cp, PRIVILEGED_LABEL)
    t0 = time.monotonic()
    out = apply(cp, docs)
    try:
        for d in docs:
            assert f"{_resource(d)} serverside-applied" in out.stdout, (d["kind"], out.stdout)
        pm = get(cp, f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/podmonitors/extractedprism")
        want = next(d for d in docs if d["kind"] == "PodMonitor")["spec"]
        for ep in want["podMetricsEndpoints"]:  # the CRD's default filled in
            for r in ep["relabelings"]:
                r.setdefault("action", "replace")
        assert pm["spec"] == want

        def placed() -> bool:
            ps = pods(cp)
            return (sorted(p["spec"].get("nodeName") or "" for p in ps) == fleet.nodes
                    and all(_init_started(p) for p in ps))

        wait_until(placed, POD_START * 2, interval=0.5,
                   message="one pod on every node, its init container started")
        took = time.monotonic() - t0
        for p in pods(cp):
            spec = p["spec"]
            assert spec["priority"] == SYSTEM_NODE_CRITICAL
            assert spec["serviceAccountName"] == "extractedprism"
            # ServiceAccount admission added the projected token the kubelet mounted.
            assert any(v.get("projected") for v in spec["volumes"]), spec["volumes"]
            assert p["status"]["phase"] == "Pending"  # Init:0/1: the fake runtime never exits
        record("chart install", placed_s=round(took, 1), nodes=fleet.nodes)
    finally:
        kubectl(cp, "delete", "daemonset", "extractedprism", "-n", NS, "--wait=false")
    wait_pods_gone(cp, POD_START * 2)


def _resource(doc: dict[str, Any]) -> str:
    """How kubectl names an object: `daemonset.apps/NAME`, `serviceaccount/NAME`."""
    group = doc["apiVersion"].rpartition("/")[0]
    kind = doc["kind"].lower() + (f".{group}" if group else "")
    return f"{kind}/{doc['metadata']['name']}"


def _init_started(pod: dict[str, Any]) -> bool:
    inits = (pod.get("status") or {}).get("initContainerStatuses") or []
    return bool(inits) and all("running" in (s.get("state") or {}) for s in inits)


# --- the roll --------------------------------------------------------------------


@dataclass
class PodWatch:
    """Every event on the chart's pods from a resourceVersion on, each with the state of
    all of them after it (a watch, so no state between two events is missed)."""

    cp: Any
    resource_version: str
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    states: list[tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=list)
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, initial: list[dict[str, Any]]) -> PodWatch:
        self.pods = {p["metadata"]["name"]: p for p in initial}
        self.states.append((time.time(), dict(self.pods)))
        self._thread = threading.Thread(target=self._run, name="cp-chart-pod-watch",
                                        daemon=True)
        harness.start_live(self, [self._thread])
        return self

    def _run(self) -> None:
        from kubernetes import client as k8s
        from kubernetes import watch

        api = harness.api_client(6443, self.cp.ca, self.cp.token(), host=self.cp.ip("api2"))
        core = k8s.CoreV1Api(api)
        rv = self.resource_version
        deadline = time.monotonic() + harness.MAX_RUN_S
        try:
            # Short server-side watches resumed from the last resourceVersion, as an
            # informer resumes: the stop event is looked at every WATCH_S at the latest.
            for _ in range(int(harness.MAX_RUN_S / WATCH_S) + 1):
                if self._stop.is_set() or time.monotonic() > deadline:
                    break
                for ev in watch.Watch().stream(
                        core.list_namespaced_pod, NS, label_selector=SELECTOR,
                        resource_version=rv, timeout_seconds=WATCH_S,
                        _request_timeout=WATCH_S + 10):
                    obj = api.sanitize_for_serialization(ev["object"])
                    rv = obj["metadata"]["resourceVersion"]
                    name = obj["metadata"]["name"]
                    if ev["type"] == "DELETED":
                        self.pods.pop(name, None)
                    else:
                        self.pods[name] = obj
                    self.states.append((time.time(), dict(self.pods)))
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            api.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(WATCH_S + 15)


def _strategy(docs: list[dict[str, Any]]) -> tuple[int, int, int]:
    spec = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]
    ru = spec["updateStrategy"]["rollingUpdate"]
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    assert isinstance(ru["maxSurge"], int) and isinstance(ru["maxUnavailable"], int), ru
    return ru["maxSurge"], ru["maxUnavailable"], int(spec.get("minReadySeconds") or 0)


def _hash(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"].get("controller-revision-hash"))


@pytest.mark.timeout(300)
def test_upgrade_rolls_with_the_declared_strategy(fleet: Fleet) -> None:
    cp = fleet.cp
    set_namespace_labels(cp, PRIVILEGED_LABEL)
    # No host directories, so no init container (which the fake runtime would never end).
    base = {"stateFile": "", "handoverSocket": ""}
    v1, v2 = chart(cp, **base), chart(cp, **base, logLevel="debug")
    max_surge, max_unavailable, min_ready = _strategy(v1)
    assert _strategy(v2) == (max_surge, max_unavailable, min_ready)
    assert (max_surge, max_unavailable) == (1, 0)  # the chart's defaults, docs/deploy.md
    apply(cp, v1)
    try:
        def settled(n_hashes: int) -> bool:
            ds = get(cp, f"/apis/apps/v1/namespaces/{NS}/daemonsets/extractedprism")
            st = ds.get("status") or {}
            ps = pods(cp)
            return (st.get("observedGeneration") == ds["metadata"]["generation"]
                    and st.get("updatedNumberScheduled") == NODES
                    and st.get("numberAvailable") == NODES and len(ps) == NODES
                    and len({_hash(p) for p in ps}) == n_hashes
                    and all(ready(p) and not p["metadata"].get("deletionTimestamp")
                            for p in ps))

        wait_until(lambda: settled(1), POD_START + min_ready + SLACK * 4, interval=0.5,
                   message="first install: every pod Running and available")
        listing = get(cp, f"/api/v1/namespaces/{NS}/pods")
        old = {p["spec"]["nodeName"]: p["metadata"]["name"] for p in pods(cp)}
        watcher = PodWatch(cp, listing["metadata"]["resourceVersion"]).start(pods(cp))
        t0 = time.monotonic()
        apply(cp, v2)
        # Node by node: a new pod starts, becomes ready and available after minReadySeconds,
        # then the old one goes.
        roll_bound = NODES * (POD_START + min_ready) + SLACK * 4
        wait_until(lambda: settled(1) and set(old.values()).isdisjoint(
            p["metadata"]["name"] for p in pods(cp)), roll_bound, interval=0.5,
            message=f"roll to the new template within {roll_bound:g}s")
        took = time.monotonic() - t0
        wait_until(lambda: not any(n in watcher.pods for n in old.values()), 10, interval=0.2,
                   message="the watch saw the old pods go")
        watcher.stop()
        assert watcher.error is None, f"pod watch failed: {watcher.error!r}"
    finally:
        harness.stop_live()
        kubectl(cp, "delete", "daemonset", "extractedprism", "-n", NS, "--wait=false")
    new_hash = _hash(next(iter(watcher.pods.values())))
    worst_unavailable, worst_surge = _check_roll(watcher, fleet.nodes, new_hash, max_surge,
                                                 max_unavailable)
    waits = _ready_to_delete(watcher, old, new_hash)
    record("chart roll", took_s=round(took, 1), events=len(watcher.states) - 1,
           max_surge=max_surge, max_unavailable=max_unavailable, min_ready_s=min_ready,
           worst_unavailable=worst_unavailable, worst_surge=worst_surge,
           ready_to_old_deleted_s=waits)
    assert worst_unavailable <= max_unavailable
    assert worst_surge <= max_surge
    assert worst_surge == 1  # it did surge: one node at a time had both pods
    # Server timestamps have whole seconds: a second's slack either way.
    assert all(w >= min_ready - 1 for w in waits.values()), waits
    wait_pods_gone(cp, POD_START * 2)


def _check_roll(watcher: PodWatch, nodes: list[str], new_hash: str, max_surge: int,
                max_unavailable: int) -> tuple[int, int]:
    """Worst count, over every state the watch saw, of nodes without an available pod
    (ready and not being deleted) and of nodes with a new pod beside an old one."""
    worst_unavailable = worst_surge = 0
    for _, state in watcher.states:
        live = [p for p in state.values() if not p["metadata"].get("deletionTimestamp")]
        unavailable = sum(1 for n in nodes
                          if not any(p["spec"].get("nodeName") == n and ready(p) for p in live))
        surge = sum(1 for n in nodes
                    if {_hash(p) == new_hash for p in live if p["spec"].get("nodeName") == n}
                    == {True, False})
        worst_unavailable = max(worst_unavailable, unavailable)
        worst_surge = max(worst_surge, surge)
    return worst_unavailable, worst_surge


def _ready_to_delete(watcher: PodWatch, old: dict[str, str], new_hash: str) -> dict[str, float]:
    """Per node: seconds from the new pod's Ready to the old pod's deletion (server times)."""
    out = {}
    for node, old_name in old.items():
        deleted = next(s[old_name] for _, s in watcher.states
                       if old_name in s and s[old_name]["metadata"].get("deletionTimestamp"))
        meta = deleted["metadata"]
        t_delete = (observe.parse_time(meta["deletionTimestamp"])
                    - int(meta.get("deletionGracePeriodSeconds") or 0))
        new = next(p for _, s in watcher.states for p in s.values()
                   if p["spec"].get("nodeName") == node and _hash(p) == new_hash and ready(p))
        out[node] = round(t_delete - ready_since(new), 1)
    return out
