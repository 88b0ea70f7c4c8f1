"""Faults on a real node (``scripts/realnode fault KIND``), each measured the same way:
a client loop through the node's 127.0.0.1:7445 (a new TLS connection and ``GET /readyz``
every 50 ms, clientloop.py), the node's Ready condition and its Lease's renewals sampled
every second, from before the fault until ``settle`` seconds after it was undone.

Kinds:

* ``container-kill``: SIGKILL to the product's process in its container (the static
  pod); the kubelet restarts the container.
* ``container-term``: SIGTERM to it, as the kubelet stops a container whose liveness
  probe failed; it drains and exits, and the kubelet starts the container again.
* ``api-kill``, ``api-stop``, ``api-partition``: the API server carrying the kubelet's
  connection is killed (-9; started again after ``hold``), frozen (SIGSTOP for ``hold``,
  then SIGCONT) or cut from etcd for ``hold``.
* ``rotation``: k0s's balancer test (inttest/nllb): for each API server in turn, stop
  the node's kubelet, stop that API server, start the kubelet while it is down, wait for
  the node to be Ready, start the API server again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from epscripts.controlplane import host as cphost
from epscripts.fleet import observe

KINDS = ("container-kill", "container-term", "api-kill", "api-stop", "api-partition", "rotation")


class Sampler:
    """Ready and Lease renewals of one node, every second, on a thread."""

    def __init__(self, cp: Any, node: str) -> None:
        self.cp, self.node = cp, node
        self.renewals: list[float] = []
        self.not_ready: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(name="realnode-sampler", target=self._run,
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        end = time.monotonic() + 1800
        while not self._stop.wait(1.0) and time.monotonic() < end:
            with contextlib.suppress(Exception):
                t = (observe.lease_renewals(self.cp) or {}).get(self.node)
                if t is not None and (not self.renewals or t != self.renewals[-1]):
                    self.renewals.append(t)
                ready = ((observe.node_conditions(self.cp) or {}).get(self.node)
                         or {}).get("ready")
                if ready not in (None, "True"):
                    self.not_ready.append(f"{time.strftime('%T')} {ready}")

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10)
        times = [*self.renewals, time.time()]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return {"longest_lease_gap_s": round(max(gaps), 1) if gaps else None,
                "renewals": len(self.renewals), "not_ready_samples": self.not_ready}


def carrier(rn: Any, node: str) -> str:
    apis = observe.kubelet_apis(rn.cp, rn.fleet, owner="kubelet", nodes=[node])[node]
    if not apis:
        raise RuntimeError("no kubelet connection through 127.0.0.1:7445 found")
    return str(apis[0])


def run(rn: Any, node: str, kind: str, hold: float = 30.0, settle: float = 20.0
        ) -> dict[str, Any]:
    cp = rn.cp
    stop_file = Path(tempfile.mkdtemp(prefix="realnode-fault-")) / "stop"
    loop = rn.client_loop(node, 7445, stop_file, max_s=hold * 4 + settle + 600)
    sampler = Sampler(cp, node)
    out: dict[str, Any] = {"kind": kind, "hold_s": hold}
    try:
        time.sleep(3)
        t0 = time.monotonic()
        if kind in ("container-kill", "container-term"):
            pids = rn.lb_pids(node)
            os.kill(pids[0], signal.SIGKILL if kind == "container-kill" else signal.SIGTERM)
            out["killed_host_pid"] = pids[0]
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                now = rn.lb_pids(node)
                if now and now != pids:
                    break
                time.sleep(0.1)
            out["new_process_after_s"] = round(time.monotonic() - t0, 1)
        elif kind in ("api-kill", "api-stop", "api-partition"):
            api = carrier(rn, node)
            out["api"] = api
            if kind == "api-kill":
                cp.signal(api, signal.SIGKILL)
                cp.wait_exit(api, 10)
            elif kind == "api-stop":
                cp.stop(api)
            else:
                cp.partition_etcd(api)
            time.sleep(hold)
            out["kubelet_during"] = observe.kubelet_apis(cp, rn.fleet, owner="kubelet",
                                                         nodes=[node])[node]
            if kind == "api-kill":
                cp.start(api, cp.extra_args(api))
            elif kind == "api-stop":
                cp.cont(api)
            else:
                cp.heal(api)
            cp.wait_ready([api], timeout=120)
        elif kind == "rotation":
            steps = []
            for api in cphost.APISERVERS:
                s0 = time.monotonic()
                rn.fleet.stop_proc(f"kubelet-{node}", signal.SIGTERM, 30)
                cp.term(api)
                cp.wait_exit(api, 60)
                started = time.time()
                rn.start_kubelet(node)
                # Ready, and renewed by the new kubelet (the Node's Ready of the old one
                # would still read True: nothing marks it within seconds).
                deadline = time.monotonic() + 120
                while (time.monotonic() < deadline
                       and ((observe.lease_renewals(cp) or {}).get(node, 0.0) < started
                            or ((observe.node_conditions(cp) or {}).get(node) or {}
                                ).get("ready") != "True")):
                    time.sleep(0.5)
                ready_s = time.monotonic() - s0
                cp.start(api, cp.extra_args(api))
                cp.wait_ready([api], timeout=120)
                steps.append({"api": api, "ready_after_s": round(ready_s, 1)})
            out["steps"] = steps
            out["daemonset"] = daemonset_check(rn, node)
        else:
            raise ValueError(f"unknown fault {kind!r}; one of {', '.join(KINDS)}")
        out["fault_s"] = round(time.monotonic() - t0, 1)
        time.sleep(settle)
    finally:
        stop_file.touch()
        try:
            text, _ = loop.communicate(timeout=60)
            out["clients"] = json.loads(text.strip().splitlines()[-1])
        except Exception as exc:  # the loop's figures are a report, not a precondition
            loop.kill()
            loop.wait()
            out["clients"] = f"no result: {exc!r}"
        out.update(sampler.stop())
        shutil.rmtree(stop_file.parent, ignore_errors=True)
    return out


def daemonset_check(rn: Any, node: str, timeout: float = 120.0) -> dict[str, Any]:
    """k0s's last step: a new DaemonSet's pod Running on every node, its log readable with
    `kubectl logs`. The pod runs the product's image's Python (present on the node),
    prints one line and sleeps; host network, so no CNI is involved."""
    import subprocess

    from epscripts.realnode.node import image_name

    cp = rn.cp
    if not rn.fleet.state.get("controllers_api"):
        rn.fleet.start_controllers("api1")
    kubectl = [cp.binary("kubectl"), "--kubeconfig", str(Path(cp.dir) / "admin.kubeconfig")]
    name = "realnode-check"
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet",
          "metadata": {"name": name, "namespace": "default"},
          "spec": {"selector": {"matchLabels": {"app": name}},
                   "template": {"metadata": {"labels": {"app": name}}, "spec": {
                       "hostNetwork": True, "automountServiceAccountToken": False,
                       "containers": [{"name": "c", "image": image_name(),
                                       "imagePullPolicy": "Never",
                                       "command": ["/opt/venv/bin/python", "-c",
                                                   "import time; print('hello from the "
                                                   "node', flush=True); time.sleep(3600)"]}]}}}}
    t0 = time.monotonic()
    subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps(ds), check=True,
                   capture_output=True, text=True, timeout=60)
    out: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        # Every real node of the run, as k0s checks every worker.
        while time.monotonic() < deadline and len(out) < len(rn.nodes):
            got = subprocess.run([*kubectl, "-n", "default", "get", "pods", "-l",
                                  f"app={name}", "-o", "json"], capture_output=True,
                                 text=True, timeout=30)
            items = json.loads(got.stdout or "{}").get("items") or []
            for pod in items:
                where = pod["spec"].get("nodeName")
                if (where not in rn.nodes or where in out
                        or pod.get("status", {}).get("phase") != "Running"):
                    continue
                logs = subprocess.run([*kubectl, "-n", "default", "logs",
                                       pod["metadata"]["name"]], capture_output=True,
                                      text=True, timeout=30)
                text = (logs.stdout or logs.stderr).strip()
                if "hello from the node" in text:
                    out[where] = {"running_after_s": round(time.monotonic() - t0, 1),
                                  "logs": text}
            time.sleep(1)
    finally:
        subprocess.run([*kubectl, "-n", "default", "delete", "daemonset", name,
                        "--wait=false"], capture_output=True, timeout=60)
    return out
