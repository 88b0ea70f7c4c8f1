"""A real node (issue 40): a real kubelet, containerd, runc and CNI plugins running the
product's image, on the session's control plane (scripts/realnode, docs/fleet.md).

* The static pod the kubelet boots through: the kubelet's only API path is the node's
  127.0.0.1:7445, served by `extractedprism static-pod`'s manifest; the node is Ready
  and the mirror pod Running and Ready; `kubectl logs` of it works.
* The chart's DaemonSet beside it, for the node's other clients (docs/deploy.md: CNI
  agents, kube-proxy, node agents), on 7447/7448: an image change rolls it with the
  listener handover between two real containers, then `kubectl delete pod` replaces it
  while it drains; a request loop through it on the node (a new TLS connection and `GET
  /readyz` every 50 ms) sees 0 refused and 0 failed, and the kubelet's Lease keeps
  renewing on time.
* One fault: kill -9 of the API server carrying the kubelet's connection; the node stays
  Ready, the longest Lease gap within 15 s (the fleet's target).
* Teardown leaves nothing: no process, mount, namespace, cgroup or changed sysctl.

Skipped, with one line, where the machine lacks what a real node needs (root,
containerd, runc, the CNI plugins, buildah; the fleet's controllers built).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane.conftest import MARKS, fleet_why_not, record, restore
from tests.util import wait_until

_WHY = fleet_why_not()
if _WHY is None:
    from epscripts.realnode import build as _rnbuild
    from epscripts.realnode.node import missing_prerequisites

    _WHY = missing_prerequisites()
    if _WHY is None and _rnbuild.missing():
        _WHY = (f"real-node binaries not built ({', '.join(_rnbuild.missing())}): run "
                "`scripts/realnode build`")
if _WHY:
    pytest.skip(f"real-node tests: {_WHY}", allow_module_level=True)

from epscripts.controlplane import host as cphost  # noqa: E402
from epscripts.controlplane import plane as cpmod  # noqa: E402
from epscripts.fleet import observe  # noqa: E402
from epscripts.fleet.nodes import Fleet  # noqa: E402
from epscripts.realnode.node import KUBELET_ADDRESS_FLAG, RealNodes, image_name  # noqa: E402

from tests.deploy.helpers import render  # noqa: E402
from tests.deploy.test_image import BUILD_TIMEOUT  # noqa: E402
from tests.deploy.test_image import image_archive as _image_fixture  # noqa: E402

pytestmark = [*MARKS, pytest.mark.timeout(BUILD_TIMEOUT + 900)]

NODE = "r1"
NS = "kube-system"
DS_PORT, DS_HEALTH = 7447, 7448
# The kubelet's Lease: 40 s duration, renewed every quarter of it (10 s); the fleet's
# target for the longest gap between renewals through a fault.
LEASE_GAP_MAX = 15.0
# From the kubelet's start to Node Ready: the product's container started by containerd
# (image already imported), its first readyz probes (--health-interval of the profile,
# 5 s, runs the first at once), the kubelet's registration and first status (every 10 s,
# nodeStatusUpdateFrequency). 60 s leave room for a loaded 2-core machine.
READY_BOUND = 60.0
# The chart's DaemonSet pod: container start + readiness (period 5 s) + minReadySeconds.
DS_VALUES: dict[str, Any] = {"bindPort": DS_PORT, "healthPort": DS_HEALTH,
                             "enableDiscovery": False, "healthCheck": "tcp",
                             "shutdownDrainTimeout": "10s", "minReadySeconds": 5,
                             "image": {"pullPolicy": "Never"}}


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> Path:
    """The image test_image.py builds and caches (shared); EP_REALNODE_IMAGE names
    another archive instead (a before/after comparison with an older build)."""
    other = os.environ.get("EP_REALNODE_IMAGE")
    if other:
        return Path(other)
    return Path(request.getfixturevalue("image_archive"))


image_archive = _image_fixture


class LeaseWatch:
    """Samples the node's Lease renewTime every second; the longest gap between two
    renewals seen (and Ready=False ever seen) over its life."""

    def __init__(self, cp: Any, node: str) -> None:
        self.cp, self.node = cp, node
        self.renewals: list[float] = []
        self.not_ready: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(name="test-lease-watch", target=self._run,
                                        daemon=True)

    def start(self) -> LeaseWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        end = time.monotonic() + 900
        while not self._stop.wait(1.0) and time.monotonic() < end:
            leases = observe.lease_renewals(self.cp) or {}
            t = leases.get(self.node)
            if t is not None and (not self.renewals or t != self.renewals[-1]):
                self.renewals.append(t)
            conds = observe.node_conditions(self.cp) or {}
            ready = (conds.get(self.node) or {}).get("ready")
            if ready not in (None, "True"):
                self.not_ready.append(f"{time.strftime('%T')} {ready}")

    def stop(self) -> float:
        """Stops; returns the longest gap between renewals, counting up to now."""
        self._stop.set()
        self._thread.join(10)
        if not self.renewals:
            return float("inf")
        times = [*self.renewals, time.time()]
        return max(b - a for a, b in itertools.pairwise(times))


@pytest.fixture(scope="module")
def own_plane() -> Iterator[Any]:
    """A control-plane run of this module's own: a real node restarts its API servers
    with another flag, kills one, and leaves a Node, controllers and a DaemonSet's history
    behind; the session's run, shared by every other test here, never sees any of it."""
    link = cphost.state_root() / "current"
    before = os.readlink(link) if link.is_symlink() else None
    cp = cpmod.ControlPlane.create(owner_pid=os.getpid())  # points `current` at itself
    try:
        t0 = time.monotonic()
        # kubectl logs dials the kubelet by address (the node's name resolves nowhere
        # here): the API servers of this run start with that flag.
        cp.up()
        restore(cp, [KUBELET_ADDRESS_FLAG])
        record("real node control plane", up_seconds=round(time.monotonic() - t0, 1))
        yield cp
    finally:
        cp.down()
        if before is not None:  # the session's run is `current` again (scripts use it)
            with contextlib.suppress(OSError):
                link.unlink()
            link.symlink_to(before)


@pytest.fixture(scope="module")
def node(own_plane: Any, image: Path) -> Iterator[RealNodes]:
    control_plane = own_plane
    rn = RealNodes(control_plane)
    fleet = Fleet(control_plane)
    try:
        t0 = time.monotonic()
        took = rn.up(NODE, 1, image=image, timeout=READY_BOUND)
        record("real node up", up_seconds=round(time.monotonic() - t0, 1),
               ready_after_kubelet_s=round(took["ready"], 1))
        rn.state["timings"] = took
        yield rn
    finally:
        fleet.down()  # the controllers, if a test started them
        for line in rn.down():
            print(line)
        left = rn.leftovers()
        assert not left, f"the real node left behind: {left}"


def kubectl(cp: Any, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([cp.binary("kubectl"), "--kubeconfig",
                           str(Path(cp.dir) / "admin-api1.kubeconfig"), *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr.strip()}"
    return proc


def pods(cp: Any, selector: str) -> list[dict[str, Any]]:
    out = kubectl(cp, "-n", NS, "get", "pods", "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_static_pod_boots_the_node_through_7445(node: RealNodes) -> None:
    cp = node.cp
    assert node.state["timings"]["ready"] < READY_BOUND
    kubeconfig = yaml.safe_load((node.dir(NODE) / "kubelet.kubeconfig").read_text())
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:7445"
    name = f"extractedprism-{NODE}"

    def mirror_ready() -> bool:
        found = [p for p in pods(cp, "app.kubernetes.io/name=extractedprism")
                 if p["metadata"]["name"] == name]
        return bool(found) and ready(found[0])

    wait_until(mirror_ready, 60, interval=1, message="the mirror pod Running and Ready")
    # The kubelet's connections go through the product: they reach the API servers.
    apis = observe.kubelet_apis(cp, node.fleet, owner="kubelet", nodes=[NODE])[NODE]
    assert apis, "no kubelet connection through 127.0.0.1:7445"
    logs = kubectl(cp, "-n", NS, "logs", name, "-c", "extractedprism").stdout
    assert 'msg="extractedprism started" listen=127.0.0.1:7445' in logs
    pids = node.lb_pids(NODE)
    assert pids, "no product process in the node's cgroups"
    # As runc ran it: uid 65534, no capabilities, a read-only root, the node's network.
    status = Path(f"/proc/{pids[0]}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Uid"].split()[:2] == ["65534", "65534"], fields["Uid"]
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    root = next(line.split() for line in Path(f"/proc/{pids[0]}/mountinfo").read_text()
                .splitlines() if line.split()[4] == "/")
    assert "ro" in root[5].split(","), root
    assert (os.stat(f"/proc/{pids[0]}/ns/net").st_ino
            == os.stat(f"/run/netns/{node.netns(NODE)}").st_ino)


def _chart(cp: Any, node: RealNodes, **values: Any) -> list[dict[str, Any]]:
    run_dir = node.dir(NODE) / "ds"
    docs = render({"endpoints": cp.endpoints, **DS_VALUES,
                   "handoverSocket": str(run_dir / "run" / "handover.sock"),
                   "stateFile": "", **values})[0]
    order = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
             "DaemonSet"]
    return sorted(docs, key=lambda d: order.index(d["kind"]) if d["kind"] in order else 99)


def _apply(cp: Any, docs: list[dict[str, Any]]) -> None:
    kubectl(cp, "apply", "--server-side", "--field-manager=helm", "--force-conflicts",
            "-f", "-", stdin=yaml.safe_dump_all(docs))


def _settled(cp: Any, selector: str, tag: str) -> dict[str, Any] | None:
    """The one DaemonSet pod, when there is exactly one, on ``tag``, Ready."""
    ps = [p for p in pods(cp, selector) if not p["metadata"].get("deletionTimestamp")]
    everything = pods(cp, selector)
    if (len(everything) == 1 and len(ps) == 1 and ready(ps[0])
            and ps[0]["spec"]["containers"][0]["image"].endswith(":" + tag)):
        return ps[0]
    return None


def _roll_state(cp: Any, selector: str) -> str:
    """Where a roll stands: each pod's image, phase, readiness, deletion and container
    states, the DaemonSet's status, and whether the controllers still run."""
    try:
        lines = [f"pod {p['metadata']['name']} image={p['spec']['containers'][0]['image']} "
                 f"phase={(p.get('status') or {}).get('phase')} ready={ready(p)} "
                 f"deleting={bool(p['metadata'].get('deletionTimestamp'))} "
                 f"containers={(p.get('status') or {}).get('containerStatuses')}"
                 for p in pods(cp, selector)]
        ds = kubectl(cp, "-n", NS, "get", "daemonset", "-o", "json", check=False).stdout
        items = json.loads(ds or "{}").get("items", [])
        lines.append(f"daemonsets={[d.get('status') for d in items]}")
        lines.append("controllers running: " + ", ".join(
            f"{n}={cp.pid(n) is not None}" for n in ("kube-controller-manager", "kube-scheduler")))
        return "\n".join(lines)
    except Exception as exc:  # the diagnosis must not hide the failure
        return f"(roll state unavailable: {exc!r})"


def test_daemonset_roll_and_delete_pod_refuse_nothing(node: RealNodes, tmp_path: Path
                                                      ) -> None:
    cp = node.cp
    fleet = node.fleet
    if not fleet.state.get("controllers_api"):
        fleet.start_controllers("api1")  # the DaemonSet controller and the scheduler
    # A second tag of the same image, so the roll is an image change.
    base = image_name()
    version = base.rsplit(":", 1)[1]
    node.ctr(NODE, "images", "tag", "--force", base, f"{base}-b")
    selector = "app.kubernetes.io/instance=extractedprism,app.kubernetes.io/name=extractedprism"
    lease = LeaseWatch(cp, NODE).start()
    stop = tmp_path / "stop"
    loop = None
    try:
        _apply(cp, _chart(cp, node, image={"pullPolicy": "Never", "tag": version}))
        wait_until(lambda: _settled(cp, selector, version) is not None, 120, interval=1,
                   message="the DaemonSet's pod Ready on the real node")
        loop = node.client_loop(NODE, DS_PORT, stop)
        time.sleep(2)  # the loop runs through the first pod before the roll
        t0 = time.monotonic()
        events = {"roll": round(time.time(), 2)}
        _apply(cp, _chart(cp, node, image={"pullPolicy": "Never", "tag": f"{version}-b"}))
        # The roll's own bound is about 35 s (surge pod Ready, minReadySeconds 5, the old
        # one's 10 s drain and its exit); the rest is room for a loaded CI machine. A
        # timeout says where the roll stood.
        try:
            wait_until(lambda: _settled(cp, selector, f"{version}-b") is not None, 240,
                       interval=1, message="the roll done: one pod, the new image, Ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {_roll_state(cp, selector)}") from None
        roll_s = time.monotonic() - t0
        # kubectl delete pod: SIGTERM to it and a replacement at once, beside it.
        victim = _settled(cp, selector, f"{version}-b")
        assert victim is not None
        t0 = time.monotonic()
        events["delete"] = round(time.time(), 2)
        kubectl(cp, "-n", NS, "delete", "pod", victim["metadata"]["name"], "--wait=false")

        def replaced() -> bool:
            p = _settled(cp, selector, f"{version}-b")
            return p is not None and p["metadata"]["uid"] != victim["metadata"]["uid"]

        wait_until(replaced, 120, interval=1, message="the replacement Ready, the old gone")
        delete_s = time.monotonic() - t0
        new = _settled(cp, selector, f"{version}-b")
        assert new is not None
        restarts = new["status"]["containerStatuses"][0]["restartCount"]
        stop.touch()
        out, _ = loop.communicate(timeout=30)
        result = json.loads(out.strip().splitlines()[-1])
        gap = lease.stop()
        record("real node DaemonSet", roll_s=round(roll_s, 1), delete_s=round(delete_s, 1),
               attempts=result["attempts"], failures=result["failures"],
               longest_lease_gap_s=round(gap, 1))
        assert result["failures"] == {}, (result, events)
        assert result["ok"] >= 100, result
        assert restarts == 0, "the replacement crash-looped"
        logs = kubectl(cp, "-n", NS, "logs", new["metadata"]["name"], "-c",
                       "extractedprism").stdout
        assert "handover: took over listeners from pid=" in logs and "pidns=" in logs
        assert gap <= LEASE_GAP_MAX, (gap, lease.renewals)
        assert not lease.not_ready, lease.not_ready
    finally:
        stop.touch()
        if loop is not None and loop.poll() is None:
            loop.kill()
            loop.wait()
        lease.stop()
        kubectl(cp, "-n", NS, "delete", "daemonset", "extractedprism", "--wait=false",
                check=False)


def test_kill_of_the_api_server_carrying_the_kubelet_keeps_the_node_ready(
        node: RealNodes) -> None:
    cp = node.cp
    apis = observe.kubelet_apis(cp, node.fleet, owner="kubelet", nodes=[NODE])[NODE]
    assert apis, "no kubelet connection through 127.0.0.1:7445"
    victim = apis[0]
    lease = LeaseWatch(cp, NODE).start()
    try:
        cp.signal(victim, signal.SIGKILL)
        cp.wait_exit(victim, 10)
        # Two renewal periods after the kill, on the remaining API servers.
        renewals_before = len(lease.renewals)
        wait_until(lambda: len(lease.renewals) >= renewals_before + 2, 40, interval=1,
                   message="two Lease renewals after the kill")
        moved = observe.kubelet_apis(cp, node.fleet, owner="kubelet", nodes=[NODE])[NODE]
        gap = lease.stop()
        record("real node kill -9", api=victim, longest_lease_gap_s=round(gap, 1),
               kubelet_now_on=moved)
        assert victim not in moved
        assert gap <= LEASE_GAP_MAX, (gap, lease.renewals)
        assert not lease.not_ready, lease.not_ready
    finally:
        lease.stop()
        if not cp.running(victim):
            cp.start(victim, [KUBELET_ADDRESS_FLAG])
            cp.wait_ready([victim], timeout=90)
