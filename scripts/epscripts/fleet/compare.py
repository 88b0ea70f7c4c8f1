"""scripts/compare: the same faults, one at a time, through each node-local balancer.

For each balancer in turn a fresh control plane (etcd + three kube-apiservers) and a
fleet of hollow nodes behind that balancer (docs/fleet.md), and on it each fault in turn,
each from a healthy fleet (every API server ready, every node Ready, every Lease renewed
twice since):

* ``scaleout``: the fleet starts on two API servers (api3 stopped), then api3 starts;
* ``kill``: kill -9 of the API server carrying most kubelets, restarted 20 s later;
* ``stop``: SIGSTOP of that server for 30 s;
* ``partition``: that server cut off from etcd for 60 s;
* ``rolling``: SIGTERM, wait for the exit, start, wait ready: api1, api2, api3 in turn.

The balancers (LBS): extractedprism as the chart ships it (the production profile, read
from the product: ``extractedprism profile --format args``), HAProxy and nginx with
kubespray's configurations, the Go original (built by hand, ``--go-original-bin``), and
extractedprism with the spec's defaults plus only the profile's ``--stall-timeout``
(the freeze and the partition only).

Each node also runs the extra clients of :mod:`epscripts.fleet.clients` (a kubectl watch
resumed from its last resourceVersion, a request loop) through its balancer, while a
writer updates one ConfigMap every second straight on an API server not under fault.
Measured per cell: nodes that went NotReady, the longest gap between a node's Lease
renewals, the kubelets' failed requests (their own ``rest_client_requests_total``), the
longest watch gap and lost events, the request loop's failures, the connection skew over
the API servers at the end (max/mean of established connections from the nodes, counted
in the API servers' namespaces), each balancer's RSS and CPU (/proc), and the machine's
load average. Results go to a JSON file and docs/compare.md (rendered from it), both
without any path of the measuring machine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from epscripts.controlplane import build as cpbuild
from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpplane
from epscripts.fleet import balancers, cost, observe
from epscripts.fleet.nodes import (
    MAX_NODES,
    Fleet,
    FleetError,
    _descendants,
    default_ep_cmd,
    repo_root,
)

FAULTS = ("scaleout", "quiet", "kill", "stop", "partition", "rolling", "upgrade")
# Faults only some kinds can take: the fleet-wide upgrade hands the listeners over, which
# only extractedprism does (--handover-socket).
KIND_FAULTS = {"upgrade": ("extractedprism",)}
# For the upgrade, extractedprism runs as the chart's DaemonSet does (chart values
# handoverSocket, shutdownDrainTimeout; each pod its own admin socket): the successor takes
# the listeners over, then the old instance gets SIGTERM and closes its connections spread
# over the drain. {node_dir}: the node's own directory (balancers.NODE_DIR).
UPGRADE_FLAGS = [f"--handover-socket={balancers.NODE_DIR}/extractedprism.handover",
                 "--shutdown-drain-timeout=30s"]
UPGRADE_PACE_S = 2.0  # between one node's handover and the next node's
HANDOVER_TIMEOUT = 20.0  # the successor logs that it took the listeners over
PROXY_EXIT_TIMEOUT = 30.0 + 20.0  # the old instance's exit after SIGTERM: drain + shutdown
# extractedprism as the chart ships it: the production profile, read from its one
# definition in the product (PROFILE_MODULE), never typed here, on top of what the fleet
# always passes (docs/fleet.md: the static pod's command line with readyz and the node's
# certificate, discovery with its own identity, a state file).
PROFILE_MODULE = "extractedprism.config.profile"
# Only while the product has no PROFILE_MODULE yet (a checkout before issue 28's profile):
# the values issue 28 names. A run that used it says so in docs/compare.md.
PROFILE_FALLBACK = ["--health-check=readyz", "--health-interval=5s", "--health-timeout=1s",
                    "--health-recheck=1s", "--unready-drain-timeout=3s",
                    "--stall-timeout=2s", "--upstream-selection=least-conn",
                    "--rebalance-interval=15s", "--slow-start=20s"]
# The balancers a run measures, in the document's column order: name -> the fleet's kind,
# which of the profile's flags it gets ("all", "stall": only --stall-timeout, "none"), and
# the faults it is measured for (None: every one). "extractedprism-stall" is the spec's
# defaults plus only the shipped stall check: what an operator who keeps the spec's
# timings gets from the stall check alone, on the faults that leave a server accepting.
LBS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "extractedprism": ("extractedprism", "all", None),
    "haproxy": ("haproxy", "none", None),
    "nginx": ("nginx", "none", None),
    "go-original": ("go-original", "none", None),
    "extractedprism-stall": ("extractedprism", "stall", ("stop", "partition")),
    "extractedprism-spec": ("extractedprism", "none", ("quiet",)),
}
LBS_DEFAULT = "extractedprism,haproxy,nginx,go-original,extractedprism-stall,extractedprism-spec"
# After the roll and the scale-out the fleet is watched this many of the profile's
# rebalance intervals plus its slow start after the last server is ready (at least
# AFTER_S), so rebalancing has had its chance to even the connections out.
SETTLE_REBALANCES = 4
NODES_DEFAULT = 3
NAMESPACE = "compare"
CONFIGMAP = "tick"
WRITE_PERIOD = 1.0  # the writer's updates; the watch gap's floor
REQUEST_PERIOD = 1.0  # each node's request loop
SETTLE_RENEWALS = 2  # Lease renewals per node before a fault
RENEW = 10.0  # the kubelet's Lease renewal period (kubelet default)
# kube-controller-manager defaults: a node is NotReady GRACE s after its last renewal,
# noticed within MONITOR s; every fault is watched at least this long.
GRACE, MONITOR = 50.0, 5.0
WATCH_MIN = GRACE + MONITOR + 10.0
KILL_DOWN_S = 30.0 - 10.0  # kill: restarted this long after the kill
STOP_S = 30.0
PARTITION_S = 60.0
AFTER_S = 30.0  # watched after the fault ends (at least; WATCH_MIN from its start)
READY_TIMEOUT = 120.0
QUIET_S = 300.0  # the quiet window (issue 31: five minutes); --quiet-window
QUIET_WARMUP_S = 30.0  # after the fleet has settled, before the quiet window starts
CLIENT_NODES = 10  # the extra clients run on at most this many nodes (--client-nodes)
CONN_PERIOD = 5.0  # connections per API server sampled this often during a fault
SKEW_TARGET = 1.25
EXIT_TIMEOUT = 90.0  # a SIGTERMed API server's exit; then SIGKILL (and it is reported)
CELL_MAX_S = 600.0  # any one cell, end to end (the clients' own bound)
DOC = "docs/compare.md"
RUN_STARTED = [""]  # this run's start, stamped on each of its cells
RESULTS = "docs/compare.json"
# A run at another size than NODES_DEFAULT keeps its results apart and is rendered into
# its own section of DOC, beside the 3-node tables (compare_doc.FLEET_MARKERS).
RESULTS_FLEET = "docs/compare-fleet.json"


def _log(msg: str) -> None:
    print(f"compare: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


# --- what extractedprism runs ----------------------------------------------------------


def seconds(value: str) -> float:
    """A duration as the program's flags spell it (500ms, 15s, 2m, 1h; bare: seconds)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", value)
    if not m:
        raise ValueError(f"not a duration: {value!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag=value`` (or ``--flag value``) in ``args``, the last one."""
    found = None
    for i, a in enumerate(args):
        if a.startswith(f"{flag}="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(args):
            found = args[i + 1]
    return found


def read_profile(ep_cmd: list[str]) -> tuple[list[str], str]:
    """The production profile's flags as the product prints them for an operator
    (``extractedprism profile --format args``, from PROFILE_MODULE), and where they came
    from; PROFILE_FALLBACK only when the product has no such command."""
    try:
        proc = subprocess.run([*ep_cmd, "profile", "--format", "args"], capture_output=True,
                              text=True, timeout=30, cwd=repo_root(),
                              env={k: v for k, v in os.environ.items()
                                   if not k.startswith("EP_")})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FleetError(f"extractedprism profile --format args: {exc}") from exc
    if proc.returncode == 0 and proc.stdout.split():
        return proc.stdout.split(), f"`extractedprism profile --format args` ({PROFILE_MODULE})"
    if "unrecognized arguments: profile" not in proc.stderr:
        raise FleetError(f"extractedprism profile --format args: exit {proc.returncode}: "
                         f"{proc.stderr.strip()[-500:]}")
    _log(f"this extractedprism has no `profile` command: using PROFILE_FALLBACK {PROFILE_FALLBACK}")
    return list(PROFILE_FALLBACK), "PROFILE_FALLBACK in scripts/epscripts/fleet/compare.py " \
        "(the product had no profile command)"


def faults_for(lb: str, faults: list[str], quiet_only: set[str] = frozenset()) -> list[str]:
    """The faults of ``faults`` that ``lb`` (a name of LBS) is measured for: its variant's
    own, those its kind can take (KIND_FAULTS), only the quiet cell if in ``quiet_only``."""
    kind, _, own = LBS[lb]
    return [f for f in faults if (own is None or f in own)
            and (lb not in quiet_only or f == "quiet")
            and kind in KIND_FAULTS.get(f, (kind,))]


def lb_extra(lb: str, profile: list[str]) -> list[str]:
    """The flags the fleet adds to the balancer's own command line for ``lb``."""
    which = LBS[lb][1]
    if which == "all":
        return list(profile)
    if which == "stall":
        return [a for a in profile if a.split("=", 1)[0] == "--stall-timeout"]
    return []


def settle_after(profile: list[str]) -> float:
    """How long the roll and the scale-out are watched after the last server is ready:
    SETTLE_REBALANCES of the profile's rebalance intervals plus its slow start."""
    interval = flag_value(profile, "--rebalance-interval")
    ramp = flag_value(profile, "--slow-start")
    return max(AFTER_S, SETTLE_REBALANCES * (seconds(interval) if interval else 0)
               + (seconds(ramp) if ramp else 0))


# --- machine paths out of what is committed -----------------------------------------------

# An absolute path on the measuring machine (not an API path such as /api/v1/...).
MACHINE_PATH_RX = re.compile(
    r"(?<![\w.:/-])/(?:work|tmp|root|home|var|run|usr|opt|srv|mnt|proc|etc|nix)"
    r"(?:/[^\s'\"`,;:()\[\]{}]*)?")


def relative_argv(argv: list[str]) -> list[str]:
    """A command line as committed: paths inside the checkout relative to it, the Go
    original's binary and any other path of the machine as ``<path>``."""
    root = str(repo_root())

    def one(word: str) -> str:
        if word.startswith(root + "/"):
            return word[len(root) + 1:]
        return MACHINE_PATH_RX.sub("<path>", word)

    out: list[str] = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--go-original-bin" or a.startswith("--go-original-bin="):
            out.append("--go-original-bin=<path>" if "=" in a else "<path>")
        elif prev == "--ep-cmd" or a.startswith("--ep-cmd="):
            val = a.removeprefix("--ep-cmd=")
            words = " ".join(one(w) for w in val.split())
            out.append(f"--ep-cmd={words}" if a.startswith("--ep-cmd=") else words)
        else:
            out.append(one(a))
    return out


def scrub(obj: Any) -> Any:
    """``obj`` (a result document) with every machine path in its strings replaced."""
    root = str(repo_root())
    if isinstance(obj, str):
        return MACHINE_PATH_RX.sub("<path>", obj.replace(root + "/", ""))
    if isinstance(obj, list):
        return [scrub(x) for x in obj]
    if isinstance(obj, dict):
        return {scrub(k): scrub(v) for k, v in obj.items()}
    return obj


class Stop(Exception):
    """SIGTERM/SIGINT: unwind through every cleanup."""


# --- /proc ---------------------------------------------------------------------


def cpu_ticks(pid: int | None) -> int:
    """utime+stime of a process and its descendants (clock ticks)."""
    if pid is None:
        return 0
    total = 0
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Monitor:
    """Every 2 s: the machine's load average and each balancer's RSS."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.load: list[float] = []
        self.rss_max: dict[str, int] = {}
        self.every = observe.Every("compare-monitor", 2.0, self.tick, CELL_MAX_S)

    def tick(self) -> None:
        self.load.append(loadavg())
        for node in self.fleet.nodes:
            rss = self.fleet.rss_kib(f"lb-{node}") or 0
            self.rss_max[node] = max(self.rss_max.get(node, 0), rss)


# --- the writer ------------------------------------------------------------------


class Writer:
    """Updates ConfigMap ``tick`` (data.seq = 1, 2, ...) every WRITE_PERIOD seconds,
    straight on an API server not in ``avoid`` (over the bridge, never a balancer)."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.avoid: set[str] = set()
        self.seq = 0
        self.written: list[tuple[int, float]] = []  # (seq, time acknowledged)
        self.failures = 0
        self.every = observe.Every("compare-writer", WRITE_PERIOD, self.tick, CELL_MAX_S)

    def tick(self) -> None:
        self.seq += 1
        path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}"
        body = [{"op": "replace", "path": "/data", "value": {"seq": str(self.seq)}}]
        for api in cphost.APISERVERS:
            if api in self.avoid or self.cp.pid(api) is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                if _patch(self.cp, api, path, body)[0] == 200:
                    self.written.append((self.seq, time.time()))
                    return
        self.failures += 1


def _patch(cp: Any, api: str, path: str, body: Any) -> tuple[int, Any]:
    """A JSON patch (cp.request sends application/json; a patch needs its own type)."""
    import ssl
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"https://{cp.endpoint(api)}{path}", method="PATCH",
                                 data=json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {cp.token('admin')}")
    req.add_header("Content-Type", "application/json-patch+json")
    try:
        with cpplane._sni_opener(cp.ssl_context()).open(req, timeout=2) as resp:
            return resp.status, None
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, None
    except ssl.SSLError as exc:
        raise OSError(str(exc)) from exc


# --- one cell ---------------------------------------------------------------------


def kubelet_requests(fleet: Fleet) -> dict[str, dict[str, int]]:
    """Per node, the kubelet's rest_client_requests_total by code (its own metrics,
    read on its port 10250 inside the node's namespace; kubemark serves plain HTTP)."""
    probe = ("import urllib.request,sys;sys.stdout.write(urllib.request.urlopen("
             "'http://127.0.0.1:10250/metrics',timeout=5).read().decode())")
    from concurrent.futures import ThreadPoolExecutor

    rx = re.compile(r'^rest_client_requests_total\{code="([^"]*)".*\}\s+(\S+)$')

    def one(node: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            proc = fleet.in_netns(node, [sys.executable, "-c", probe], timeout=15)
            for line in proc.stdout.splitlines():
                m = rx.match(line)
                if m:
                    counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
        return counts

    # A few at a time: at 100 nodes one after another took longer than a fault.
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="compare-kubelet-metrics") as ex:
        return dict(zip(fleet.nodes, ex.map(one, fleet.nodes), strict=True))


def failed_requests(before: dict[str, int], after: dict[str, int]) -> int:
    """Requests that failed: no answer (``<error>``), 5xx, 429."""
    bad = [c for c in after if c == "<error>" or c.startswith("5") or c == "429"]
    return sum(after.get(c, 0) - before.get(c, 0) for c in bad)


def restore(cp: Any, fleet: Fleet, without: set[str] = frozenset()) -> None:
    """Every API server (but ``without``) running, awake, joined to etcd and ready."""
    for api in cphost.APISERVERS:
        cp.heal(api)
        if cp.pid(api) is not None:
            cp.cont(api)
    for api in cphost.APISERVERS:
        if api in without:
            if cp.pid(api) is not None:
                stop_api(cp, api)
        elif cp.pid(api) is None:
            cp.start(api, cp.extra_args(api))
    cp.wait_ready([a for a in cphost.APISERVERS if a not in without], timeout=READY_TIMEOUT)


def stop_api(cp: Any, api: str) -> bool:
    """SIGTERM and wait for the exit; SIGKILL after EXIT_TIMEOUT. True: exited on TERM."""
    cp.term(api)
    if cp.wait_exit(api, EXIT_TIMEOUT):
        return True
    with contextlib.suppress(cphost.CPError):
        cp.kill(api)
    return False


class Cell:
    """One fault through one balancer: set up, run, measure, always clean up."""

    def __init__(self, cp: Any, fleet: Fleet, fault: str, kubectl: str, lb: str,
                 settle_after_s: float, client_nodes: int = CLIENT_NODES,
                 ep_cmd: list[str] | None = None) -> None:
        self.cp, self.fleet, self.fault, self.kubectl = cp, fleet, fault, kubectl
        self.ep_cmd = ep_cmd or default_ep_cmd()
        self.lb = lb  # the name in the results (a fleet kind, or a variant of one)
        self.settle_after_s = settle_after_s  # watched after the roll / scale-out
        self.notes: list[str] = []
        # The nodes with the extra clients (a kubectl watch, a request loop): every node
        # of a small fleet, an even spread of a large one (100 of each are a load of
        # their own on a 2-CPU machine, and not what is measured).
        self.clients = pick_spread(fleet.nodes, client_nodes)
        self.conn_series: list[tuple[float, dict[str, int]]] = []
        # CPU seconds of each API server and etcd (/proc), sampled with the connections.
        self.cpu_series: list[tuple[float, dict[str, float | None]]] = []
        self.t_ready = 0.0  # roll / scale-out: when the last server was ready
        self.upgrade: dict[str, Any] | None = None  # the fleet-wide upgrade's own figures

    def _avoid(self, apis: set[str]) -> None:
        self.sampler.avoid = set(apis)
        self.writer.avoid = set(apis)

    def _controllers_off(self, api: str) -> None:
        """The controllers must see the fault from a server not under it."""
        if self.fleet.state["controllers_api"] == api:
            other = next(a for a in cphost.APISERVERS
                         if a != api and self.cp.pid(a) is not None)
            self.fleet.move_controllers(other)
            self.notes.append(f"controllers moved to {other}")

    def _sleep_until(self, t: float) -> None:
        for _ in range(int(CELL_MAX_S) + 1):
            if time.time() >= t:
                return
            self.fleet.check_alive()
            time.sleep(min(1.0, max(0.0, t - time.time())))

    def _start_clients(self, duration: float) -> None:
        cp, fleet = self.cp, self.fleet
        status, body = cp.request(fleet_api(cp), f"/api/v1/namespaces/{NAMESPACE}/configmaps/"
                                  f"{CONFIGMAP}")
        if status != 200:
            raise FleetError(f"ConfigMap {NAMESPACE}/{CONFIGMAP}: {status} {body}")
        rv = body["metadata"]["resourceVersion"]
        for node in self.clients:
            d = fleet.node_dir(node)
            kc = d / "clients.kubeconfig"
            kc.write_text(balancers.kubeconfig_text(
                f"https://127.0.0.1:{balancers.LB_PORT}", fleet._node_files(node, []),
                token=cp.token("admin")))
            kc.chmod(0o600)
            out = d / f"clients-{self.fault}.jsonl"
            out.unlink(missing_ok=True)
            fleet.spawn(f"clients-{node}", fleet.netns(node), [
                sys.executable, "-m", "epscripts.fleet.clients", f"--kubectl={self.kubectl}",
                f"--kubeconfig={kc}", f"--ca={cp.ca}", f"--token-file={cp.token_file()}",
                f"--namespace={NAMESPACE}", f"--configmap={CONFIGMAP}", f"--rv={rv}",
                f"--out={out}", f"--duration={duration:.0f}",
                f"--period={REQUEST_PERIOD:g}"],
                {"PYTHONPATH": str(repo_root() / "scripts")})

    def _stop_clients(self) -> None:
        for node in self.clients:
            self.fleet.stop_proc(f"clients-{node}", signal.SIGTERM, timeout=15)
            if self.cp.pid(f"clients-{node}") is not None:
                self.fleet.stop_proc(f"clients-{node}", signal.SIGKILL)

    def run(self) -> dict[str, Any]:
        cp, fleet = self.cp, self.fleet
        t_cell = time.monotonic()
        self.sampler = observe.Sampler(cp, fleet.nodes, period=1.0)
        self.writer = Writer(cp)
        monitor = Monitor(fleet)
        self.pause_watch = observe.PauseWatch(CELL_MAX_S)
        peers = {fleet.state["nodes"][n]["ip"]: n for n in fleet.nodes}

        def conns() -> None:
            cpu = {n: (cost.proc_usage(cp.pid(n), tree=False) or {}).get("cpu_s")
                   for n in (*cphost.APISERVERS, "etcd")}
            self.cpu_series.append((time.time(), cpu))
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                per = observe.connections(cp, peers)
                self.conn_series.append((time.time(), {
                    a: sum(v for k, v in per[a].items() if k in peers.values())
                    for a in cphost.APISERVERS}))

        conn_every = observe.Every("compare-connections", CONN_PERIOD, conns, CELL_MAX_S)
        self._start_clients(CELL_MAX_S)
        self.pause_watch.start()
        self.sampler.start()
        self.writer.every.start()
        monitor.every.start()
        conn_every.start()
        try:
            return self._run(t_cell, monitor)
        finally:
            conn_every.stop()
            self.pause_watch.stop()
            monitor.every.stop()
            self.writer.every.stop()
            self.sampler.stop()
            self._stop_clients()

    def _settle(self) -> float:
        return settle(self.fleet, self.sampler)

    def _run(self, t_cell: float, monitor: Monitor) -> dict[str, Any]:
        cp, fleet = self.cp, self.fleet
        settle_s = self._settle()
        kube_before = kubelet_requests(fleet)
        pid_before = {n: cp.pid(f"lb-{n}") for n in fleet.nodes}
        cpu_before = {n: cpu_ticks(pid_before[n]) for n in fleet.nodes}
        kubelet_apis_before = observe.kubelet_apis(cp, fleet)
        # The kubectl watches' servers (the request loop's connections live ~10 ms).
        watch_apis_before = observe.kubelet_apis(cp, fleet, owner="kubectl", nodes=self.clients)
        req_before = request_snapshot(cp)
        t_wall0 = time.monotonic()
        t_fault = time.time()
        target = self._fault(kubelet_apis_before, watch_apis_before, t_fault)
        t_end = time.time()
        req_after = request_snapshot(cp)
        wall = time.monotonic() - t_wall0
        peers = {fleet.state["nodes"][n]["ip"]: n for n in fleet.nodes}
        conns = observe.connections(cp, peers)
        per_api = {a: sum(v for k, v in conns[a].items() if k in fleet.nodes)
                   for a in cphost.APISERVERS}
        kubelet_apis_after = observe.kubelet_apis(cp, fleet)
        kube_after = kubelet_requests(fleet)
        # A balancer replaced in the window (the upgrade): its successor's CPU from its start
        # (what the old one spent after the window's start is not counted).
        cpu_s = {n: (cpu_ticks(cp.pid(f"lb-{n}"))
                     - (cpu_before[n] if cp.pid(f"lb-{n}") == pid_before[n] else 0))
                 / os.sysconf("SC_CLK_TCK") for n in fleet.nodes}
        self._stop_clients()
        gaps = self.sampler.lease_gaps(since=t_fault, until=t_end)
        not_ready = self.sampler.not_ready(since=t_fault)
        watch = {n: watch_figures(fleet.node_dir(n) / f"clients-{self.fault}.jsonl",
                                  self.writer.written, t_fault, t_end) for n in self.clients}
        mean = sum(per_api.values()) / len(per_api)
        kubelets_per_api = {a: sum(a in v for v in kubelet_apis_after.values())
                            for a in cphost.APISERVERS}
        series = [(round(t - t_fault, 1), c) for t, c in self.conn_series if t >= t_fault - 1]
        ready_rel = round(self.t_ready - t_fault, 1) if self.t_ready else None
        return {
            "fault": self.fault, "lb": self.lb, "target": target,
            "nodes": len(fleet.nodes), "settle_s": round(settle_s, 1),
            "fault_window_s": round(wall, 1), "notes": self.notes,
            "not_ready": {n: [f"+{t - t_fault:.0f}s {why}" for t, why in v[:1]]
                          + [f"{len(v)} samples"] for n, v in not_ready.items()},
            "lease_gap_max_s": round(max(gaps.values()), 2),
            "lease_gaps_s": {n: round(g, 2) for n, g in gaps.items()},
            "kubelet_failed": {n: failed_requests(kube_before[n], kube_after[n])
                               for n in fleet.nodes},
            "kubelet_codes_delta": {n: {c: kube_after[n].get(c, 0) - kube_before[n].get(c, 0)
                                        for c in kube_after[n]
                                        if kube_after[n].get(c, 0) != kube_before[n].get(c, 0)}
                                    for n in fleet.nodes},
            "watch": watch,
            "connections_after": per_api,
            "skew_after": round(max(per_api.values()) / mean, 2) if mean else None,
            "kubelets_after": kubelets_per_api,
            "kubelet_skew_after": skew(kubelets_per_api),
            "connections_series": series,
            "last_ready_s": ready_rel,
            "skew_at_ready": skew_at(series, ready_rel) if ready_rel is not None else None,
            "time_to_skew_s": (time_to_skew(series, ready_rel, SKEW_TARGET)
                               if ready_rel is not None else None),
            "client_nodes": self.clients,
            "upgrade": self.upgrade,
            # The control plane over the fault: each server's requests/s by kind (its own
            # counters; a restarted server's count from its start) and its CPU over 5 s
            # steps (the stampede on the survivors: peak against before the fault).
            "requests_per_s": {a: cost.request_rates(req_before[a], req_after[a],
                                                     t_end - t_fault)
                               for a in cphost.APISERVERS
                               if a in req_before and a in req_after},
            "server_cpu": cpu_peaks(self.cpu_series, t_fault, t_end),
            "kubelet_apis_before": kubelet_apis_before,
            "watch_apis_before": watch_apis_before,
            "exposed": ({"kubelets": len(fleet.nodes), "watches": len(self.clients)}
                        if self.fault == "upgrade" else
                        {"kubelets": sum(1 for v in kubelet_apis_before.values()
                                         if set(v) & set(target.split(","))),
                         "watches": sum(1 for v in watch_apis_before.values()
                                        if set(v) & set(target.split(",")))}),
            "kubelet_apis_after": kubelet_apis_after,
            "lb_cpu_s": {n: round(v, 2) for n, v in cpu_s.items()},
            "lb_cpu_pct": {n: round(100 * v / wall, 1) for n, v in cpu_s.items()},
            "lb_rss_mib": {n: round(v / 1024, 1) for n, v in monitor.rss_max.items()},
            "load": {"mean": round(sum(monitor.load) / max(1, len(monitor.load)), 2),
                     "max": max(monitor.load, default=0.0)},
            "writer_failures": self.writer.failures,
            "sampler_failed_polls": self.sampler.failed_polls,
            # The machine stopped (observe.PauseWatch): [seconds after the fault, seconds].
            "host_pauses": [[round(t - t_fault, 1), d] for t, d in self.pause_watch.pauses],
            "cell_s": round(time.monotonic() - t_cell, 1),
        }

    # -- the faults --

    def _upgrade(self, t0: float) -> str:
        """Every node's balancer replaced, one node after another on each of
        upgrade_surge(N) lanes (a DaemonSet's maxSurge), UPGRADE_PACE_S between two nodes
        of a lane, the old instances draining meanwhile; watched until the last old one
        exited plus AFTER_S."""
        from concurrent.futures import ThreadPoolExecutor

        fleet = self.fleet
        if fleet.state["lb"] != "extractedprism":
            raise FleetError("upgrade: only extractedprism hands its listeners over")
        olds: list[tuple[str, Any, int | None, float]] = []
        took: dict[str, float | None] = {}
        gen = 1 + max((int(m.group(1)) for n in fleet.nodes
                       for a in fleet.state["nodes"][n].get("lb_extra", [])
                       if (m := re.search(r"extractedprism-u(\d+)\.admin", a))), default=0)
        lanes = upgrade_surge(len(fleet.nodes))

        def lane(nodes: list[str]) -> None:
            for node in nodes:
                old, old_pid, took[node] = _upgrade_node(self, node, gen)
                olds.append((node, old, old_pid, time.time()))
                time.sleep(UPGRADE_PACE_S)

        with ThreadPoolExecutor(lanes, thread_name_prefix="compare-upgrade-lane") as ex:
            for f in [ex.submit(lane, fleet.nodes[i::lanes]) for i in range(lanes)]:
                f.result()
        fleet.check_alive()
        t_last = time.time()
        exited: list[float] = []
        killed = []
        for node, old, old_pid, t_term in olds:
            if old is None:
                continue
            try:
                old.wait(max(1.0, t_term + PROXY_EXIT_TIMEOUT - time.time()))
                exited.append(time.time() - t_term)  # an upper bound: waited in turn
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(old_pid, signal.SIGKILL)
                old.wait(10)
                killed.append(node)
        failed = sorted(n for n, v in took.items() if v is None)
        ok = sorted(v for v in took.values() if v is not None)
        self.notes.append(
            f"{len(ok)} of {len(took)} new instances took the listeners over"
            + (f" (median {ok[len(ok) // 2]:.2f} s, max {ok[-1]:.2f} s after start)" if ok else "")
            + (f"; NOT: {', '.join(failed)}" if failed else "")
            + f"; the roll took {t_last - t0:.0f} s on {lanes} lane(s)"
            + (f"; old instances gone within {max(exited):.0f} s of SIGTERM" if exited else "")
            + (f"; SIGKILL after {PROXY_EXIT_TIMEOUT:g} s: {', '.join(killed)}" if killed else ""))
        self.upgrade = {"took_s": took, "not_taken": failed, "killed": killed,
                        "roll_s": round(t_last - t0, 1), "lanes": lanes}
        self._sleep_until(max(t0 + WATCH_MIN, time.time() + AFTER_S))
        return "every balancer"

    def _fault(self, kubelet_apis: dict[str, list[str]], watch_apis: dict[str, list[str]],
               t0: float) -> str:
        cp = self.cp
        if self.fault == "upgrade":
            return self._upgrade(t0)
        if self.fault == "scaleout":
            cp.start("api3", cp.extra_args("api3"))
            took = cp.wait_ready(["api3"], timeout=READY_TIMEOUT)
            self.t_ready = time.time()
            self.notes.append(f"api3 ready and in the slice {took:.1f}s after start")
            self._sleep_until(max(t0 + WATCH_MIN, time.time() + self.settle_after_s))
            return "api3"
        if self.fault == "rolling":
            t_last = t0
            for api in cphost.APISERVERS:
                self._controllers_off(api)
                self._avoid({api})
                t_step = time.time()
                clean = stop_api(cp, api)
                exited = time.time() - t_step
                cp.start(api, cp.extra_args(api))
                ready = cp.wait_ready([api], timeout=READY_TIMEOUT)
                self.notes.append(f"{api}: exited {exited:.1f}s after SIGTERM"
                                  f"{'' if clean else ' (SIGKILL)'}, ready {ready:.1f}s "
                                  "after start")
                t_last = time.time()
            self.t_ready = t_last
            self._avoid(set())
            self._sleep_until(max(t_last + self.settle_after_s, t0 + WATCH_MIN))
            return "api1,api2,api3"
        # The server whose fault reaches the most clients: kubelets first, then watches.
        def reach(a: str) -> tuple[int, int]:
            return (sum(a in v for v in kubelet_apis.values()),
                    sum(a in v for v in watch_apis.values()))

        target = max(cphost.APISERVERS, key=reach)
        self._controllers_off(target)
        self._avoid({target})
        t0 = time.time()  # after a controllers move
        if self.fault == "kill":
            cp.kill(target)
            self._sleep_until(t0 + KILL_DOWN_S)
            cp.start(target, cp.extra_args(target))
            ready = cp.wait_ready([target], timeout=READY_TIMEOUT)
            self.notes.append(f"{target} restarted at +{KILL_DOWN_S:g}s, ready "
                              f"{ready:.1f}s later")
            end = t0 + WATCH_MIN
        else:
            # (start the fault, undo it, how long it lasts); undone also after an error.
            begin, undo, lasts = {"stop": (cp.stop, cp.cont, STOP_S),
                                  "partition": (cp.partition_etcd, cp.heal, PARTITION_S),
                                  }[self.fault]
            begin(target)
            try:
                self._sleep_until(t0 + lasts)
            finally:
                undo(target)
            end = t0 + max(WATCH_MIN, lasts + AFTER_S)
        self._sleep_until(end)
        self._avoid(set())
        return target


def merge_runs(old: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """``--merge``: this run's results document ``doc`` over an earlier one, ``old``. A
    cell (balancer, fault) this run measured replaces the earlier one's; the rest are kept,
    each marked with the run it came from. What describes a kind of cell (the quiet
    window) stays the earlier run's when this run measured no cell of that kind."""
    results = doc["results"]
    mine = {(r["lb"], r["fault"]) for r in results}
    kept = [{"run": old.get("started"), **r} for r in old.get("results", [])
            if (r["lb"], r["fault"]) not in mine]
    merged = dict(doc)
    merged["results"] = kept + results
    merged["runs"] = [*old.get("runs", [{"started": old.get("started"),
                                         "argv": old.get("argv"),
                                         "commit": old.get("commit")}]),
                      {"started": doc["started"], "argv": doc["argv"],
                       "commit": doc.get("commit")}]
    merged["versions"] = {**old.get("versions", {}), **doc["versions"]}
    merged["variants"] = {**old.get("variants", {}), **doc["variants"]}
    merged["faults"] = [f for f in FAULTS if f in set(old.get("faults", [])) | set(doc["faults"])]
    merged["lbs"] = [b for b in LBS if b in set(old.get("lbs", [])) | set(doc["lbs"])]
    merged["skipped"] = {k: v for k, v in {**old.get("skipped", {}),
                                            **doc.get("skipped", {})}.items()
                         if k not in merged["lbs"]}
    if not any(r["fault"] == "quiet" for r in results):
        for key in ("quiet_window_s", "quiet_warmup_s"):
            if key in old:
                merged[key] = old[key]
    return merged


def pick_spread(nodes: list[str], k: int) -> list[str]:
    """At most ``k`` of ``nodes``, evenly spread over the list (all of them if k >= n)."""
    if k >= len(nodes):
        return list(nodes)
    if k <= 0:
        return []
    return [nodes[(i * len(nodes)) // k] for i in range(k)]


def skew(per_api: dict[str, int]) -> float | None:
    """max/mean of connections over the API servers (None with none at all)."""
    if not per_api:
        return None
    mean = sum(per_api.values()) / len(per_api)
    return round(max(per_api.values()) / mean, 2) if mean else None


def skew_at(series: list[tuple[float, dict[str, int]]], t: float) -> float | None:
    """The skew of the first sample at or after ``t`` (seconds from the fault)."""
    return next((skew(c) for ts, c in series if ts >= t), None)


def time_to_skew(series: list[tuple[float, dict[str, int]]], t: float,
                 target: float) -> float | None:
    """Seconds from ``t`` until the skew is at most ``target`` and stays there to the end
    of ``series`` (samples ``(seconds from the fault, {api: connections})``); None when
    it never does (or no sample follows ``t``)."""
    after = [(ts, skew(c)) for ts, c in series if ts >= t]
    if not after:
        return None
    since = None
    for ts, k in after:
        within = k is not None and k <= target
        since = (since if since is not None else ts) if within else None
    return None if since is None else round(since - t, 1)


def settle(fleet: Fleet, sampler: observe.Sampler) -> float:
    """Every node Ready and its Lease renewed SETTLE_RENEWALS times from now (the sampler
    running); seconds it took."""
    t0 = time.time()
    limit = SETTLE_RENEWALS * RENEW + 40 + len(fleet.nodes) * 0.5
    deadline = time.monotonic() + limit
    fresh: dict[str, int] = {}
    last = None
    for _ in range(int(limit / 0.5) + 1):
        fleet.check_alive()
        fresh = {n: sum(1 for t in sampler.renewals.get(n, ()) if t > t0) for n in fleet.nodes}
        last = sampler.samples[-1] if sampler.samples else None
        if (last is not None and last.t > t0 and not last.not_ready
                and min(fresh.values()) >= SETTLE_RENEWALS):
            return time.time() - t0
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    short = {n: c for n, c in fresh.items() if c < SETTLE_RENEWALS}
    raise FleetError(f"fleet not settled in {limit:g}s: nodes renewed fewer than "
                     f"{SETTLE_RENEWALS} times {short}, not ready {last and last.not_ready}")


def request_snapshot(cp: Any, timeout: float = 10.0) -> dict[str, Any]:
    """Each running API server's request counters and open watches (its /metrics)."""
    import ssl

    out = {}
    for api in cphost.APISERVERS:
        if cp.pid(api) is None:
            continue
        with contextlib.suppress(OSError, ssl.SSLError, ValueError):
            status, body = cp.request(api, "/metrics", timeout=timeout)
            if status == 200 and isinstance(body, str):
                out[api] = cost.snapshot_requests(body)
    return out


def cpu_peaks(series: list[tuple[float, dict[str, float | None]]], t0: float, t1: float,
              ) -> dict[str, dict[str, float | None]]:
    """Per server (API servers, etcd), from CPU-seconds samples: its mean CPU (% of a
    core) before ``t0``, over [t0, t1], and its highest between two samples in it."""
    out: dict[str, dict[str, float | None]] = {}
    names = sorted({n for _, c in series for n in c})
    for name in names:
        steps = []
        for (ta, a), (tb, b) in itertools.pairwise(series):
            va, vb = a.get(name), b.get(name)
            if va is None or vb is None or vb < va or tb <= ta:
                continue  # not running, or restarted in between
            steps.append((ta, tb, 100 * (vb - va) / (tb - ta)))

        def mean(xs: list[tuple[float, float, float]]) -> float | None:
            span = sum(b - a for a, b, _ in xs)
            return round(sum((b - a) * v for a, b, v in xs) / span, 1) if span else None

        before = [x for x in steps if x[1] <= t0]
        during = [x for x in steps if x[0] >= t0 and x[1] <= t1]
        out[name] = {"before_pct": mean(before), "during_pct": mean(during),
                     "peak_pct": round(max(v for _, _, v in during), 1) if during else None}
    return out


def cost_snapshot(cp: Any, fleet: Fleet) -> dict[str, Any]:
    """The API servers' request counters and open watches (their own /metrics), CPU, RSS
    and threads of the API servers, etcd, each balancer and each kubelet (/proc), the
    established connections from the nodes per API server."""
    requests = request_snapshot(cp, timeout=30)
    t = time.time()
    procs = {n: cost.proc_usage(cp.pid(n), tree=False) for n in (*cphost.APISERVERS, "etcd")}
    for node in fleet.nodes:
        procs[f"lb-{node}"] = cost.proc_usage(cp.pid(f"lb-{node}"))
        procs[f"kubelet-{node}"] = cost.proc_usage(cp.pid(f"kubelet-{node}"))
    peers = {fleet.state["nodes"][n]["ip"]: n for n in fleet.nodes}
    per = observe.connections(cp, peers)
    conns = {a: sum(v for k, v in per[a].items() if k in fleet.nodes) for a in cphost.APISERVERS}
    return {"t": t, "requests": requests, "procs": procs, "conns": conns}


class QuietCell:
    """No fault: what the fleet and its balancers cost the control plane at rest.

    The fleet settles (every node Ready, every Lease renewed twice) with the sampler on,
    then the sampler stops and nothing but the fleet talks to the API servers (no extra
    clients, no writer) for QUIET_WARMUP_S and the window; the API servers' /metrics and
    /proc are read at its start, middle and end (epscripts.fleet.cost)."""

    def __init__(self, cp: Any, fleet: Fleet, lb: str, window_s: float) -> None:
        self.cp, self.fleet, self.lb, self.window_s = cp, fleet, lb, window_s

    def _sleep_until(self, t: float) -> None:
        for _ in range(int(self.window_s + QUIET_WARMUP_S + CELL_MAX_S)):
            if time.time() >= t:
                return
            self.fleet.check_alive()
            time.sleep(min(1.0, max(0.0, t - time.time())))

    def run(self) -> dict[str, Any]:
        cp, fleet = self.cp, self.fleet
        t_cell = time.monotonic()
        sampler = observe.Sampler(cp, fleet.nodes, period=1.0)
        sampler.start()
        try:
            settle_s = settle(fleet, sampler)
        finally:
            sampler.stop()
        load: list[float] = []
        every = observe.Every("compare-load", 2.0, lambda: load.append(loadavg()),
                              QUIET_WARMUP_S + self.window_s + 120)
        every.start()
        try:
            self._sleep_until(time.time() + QUIET_WARMUP_S)
            snaps = [cost_snapshot(cp, fleet)]
            t0 = snaps[0]["t"]
            n_load0 = len(load)
            self._sleep_until(t0 + self.window_s / 2)
            snaps.append(cost_snapshot(cp, fleet))
            n_load1 = len(load)
            self._sleep_until(t0 + self.window_s)
            snaps.append(cost_snapshot(cp, fleet))
        finally:
            every.stop()
        conds = observe.node_conditions(cp) or {}
        figures = cost.window_figures(snaps, list(cphost.APISERVERS), fleet.nodes)

        def lstat(xs: list[float]) -> dict[str, float]:
            return {"mean": round(sum(xs) / max(1, len(xs)), 2), "max": max(xs, default=0.0)}

        return {
            "fault": "quiet", "lb": self.lb, "nodes": len(fleet.nodes),
            "settle_s": round(settle_s, 1), "window_s": round(snaps[-1]["t"] - t0, 1),
            "warmup_s": QUIET_WARMUP_S, "cost": figures,
            "not_ready_end": sorted(n for n in fleet.nodes
                                    if (conds.get(n) or {}).get("ready") != "True"),
            "load": lstat(load[n_load0:]),
            "load_halves": [lstat(load[n_load0:n_load1]), lstat(load[n_load1:])],
            "cell_s": round(time.monotonic() - t_cell, 1),
        }


_FLEET_STATE = threading.Lock()


def upgrade_surge(n: int) -> int:
    """Nodes upgraded at the same time (the DaemonSet's maxSurge): 1 in a small fleet (the
    chart's maxSurge: 1), 5 % of a large one, so 100 nodes take minutes, not half an hour."""
    return max(1, n // 20)


def _upgrade_node(cell: Cell, node: str, gen: int) -> tuple[Any, int | None, float | None]:
    """One node's balancer replaced as the chart's DaemonSet roll replaces it: the new
    instance (its own admin socket) takes the listeners over through the handover socket,
    then the old one gets SIGTERM. Returns (the old one's Popen, its pid, seconds until
    the new one took over; None: it did not)."""
    cp, fleet = cell.cp, cell.fleet
    name = f"lb-{node}"
    old_pid = cp.pid(name)
    old = cp._children.get(name)  # our Popen of it: reaped by the caller
    log_path = Path(cp.dir) / f"{name}.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    extra = [a for a in fleet.state["nodes"][node].get("lb_extra", [])
             if not a.startswith("--admin-socket=")]
    extra.append(f"--admin-socket={balancers.NODE_DIR}/extractedprism-u{gen}.admin")
    t = time.time()
    with _FLEET_STATE:  # the fleet's and the plane's state are written by one lane at a time
        fleet.start_balancer(node, "extractedprism", cell.ep_cmd, None,
                             fleet._node_files(node, extra))
    took = None
    deadline = time.monotonic() + HANDOVER_TIMEOUT
    while time.monotonic() < deadline and cp.pid(name) is not None:
        with open(log_path, "rb") as f:
            f.seek(offset)
            if b"took over listeners" in f.read():
                took = time.time() - t
                break
        time.sleep(0.1)
    if old_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGTERM)
    return old, old_pid, took


def fleet_api(cp: Any) -> str:
    return next(a for a in cphost.APISERVERS if cp.pid(a) is not None)


def watch_figures(path: Path, written: list[tuple[int, float]], t0: float,
                  t1: float) -> dict[str, Any]:
    """The node's watch in [t0, t1]: longest time without a tick event, reconnects,
    events written in the window (acknowledged 10 s before its end) never received;
    its request loop: failed requests and the longest run without a success."""
    recs = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
    ev = sorted(r["t"] for r in recs if r.get("kind") == "event" and r.get("name") == CONFIGMAP)
    seen = {r["seq"] for r in recs if r.get("kind") == "event" and r.get("seq") is not None}
    before = [t for t in ev if t < t0]
    inside = [t for t in ev if t0 <= t <= t1]
    points = ([before[-1]] if before else [t0]) + inside + [t1]
    gap = max(b - a for a, b in itertools.pairwise(points))
    due = [s for s, t in written if t0 <= t <= t1 - 10]
    lost = [s for s in due if s not in seen]
    reqs = [r for r in recs if r.get("kind") == "req" and t0 <= r["t"] <= t1]
    ok_times = [t0] + [r["t"] for r in reqs if r["ok"]] + [t1]
    errors: dict[str, int] = {}
    for r in reqs:
        if not r["ok"]:
            key = r.get("err", f"HTTP {r.get('status')}").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "gap_max_s": round(gap, 2),
        "reconnects": sum(1 for r in recs if r.get("kind") == "watch-end" and t0 <= r["t"] <= t1),
        "relists": sum(1 for r in recs if r.get("kind") == "relist" and t0 <= r["t"] <= t1),
        "events_due": len(due), "lost": len(lost),
        "requests": len(reqs), "requests_failed": sum(1 for r in reqs if not r["ok"]),
        "request_errors": errors,
        "request_gap_max_s": round(max(b - a for a, b in itertools.pairwise(ok_times)), 2),
    }


# --- one balancer -------------------------------------------------------------------


def run_balancer(lb: str, faults: list[str], nodes: int, ep_cmd: list[str],
                 go_bin: str | None, extra: list[str], settle_after_s: float,
                 results: list[dict[str, Any]], quiet_s: float = QUIET_S,
                 client_nodes: int = CLIENT_NODES) -> None:
    """Every fault of ``faults`` through ``lb`` (a name of LBS) on one control plane."""
    cp = cpplane.ControlPlane.create(owner_pid=os.getpid())
    fleet: Fleet | None = None
    try:
        _log(f"{lb}: control plane {cp.id} up in {cp.up():.1f}s")
        status, body = cp.request("api1", "/api/v1/namespaces", method="POST",
                                  body={"metadata": {"name": NAMESPACE}})
        if status not in (201, 409):
            raise FleetError(f"namespace {NAMESPACE}: {status} {body}")
        status, body = cp.request("api1", f"/api/v1/namespaces/{NAMESPACE}/configmaps",
                                  method="POST", body={"metadata": {"name": CONFIGMAP},
                                                       "data": {"seq": "0"}})
        if status not in (201, 409):
            raise FleetError(f"ConfigMap {CONFIGMAP}: {status} {body}")
        if faults and faults[0] == "scaleout":
            stop_api(cp, "api3")
        fleet = Fleet(cp)
        took = fleet.up(nodes, LBS[lb][0], ep_cmd=ep_cmd, go_original_bin=go_bin, lb_extra=extra,
                        controllers_api="api1", timeout=READY_TIMEOUT + 2 * nodes)
        _log(f"{lb}: {nodes} nodes Ready in {took:.1f}s")
        for fault in faults:
            if fault != "scaleout" or faults[0] != "scaleout":
                restore(cp, fleet, without={"api3"} if fault == "scaleout" else set())
            _log(f"{lb}: {fault} ...")
            try:
                if fault == "quiet":
                    row = QuietCell(cp, fleet, lb, quiet_s).run()
                else:
                    row = Cell(cp, fleet, fault, cp.binary("kubectl"), lb,
                               settle_after_s, client_nodes, ep_cmd).run()
            except (FleetError, cphost.CPError, TimeoutError, OSError) as exc:
                row = {"fault": fault, "lb": lb, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                _log(f"{lb}: {fault} failed: {row['error']}")
                results.append(row)
                if not fleet_alive(fleet):
                    break
                continue
            row["run"] = RUN_STARTED[0]
            results.append(row)
            _log(f"{lb}: {fault}: {summary(row)}")
    finally:
        if fleet is not None:
            for line in fleet.down():
                _log(line)
        for line in cp.down():
            _log(line)
        shutil.rmtree(cp.dir / "etcd-data", ignore_errors=True)


def fleet_alive(fleet: Fleet) -> bool:
    try:
        fleet.check_alive()
        return True
    except FleetError:
        return False


def summary(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"ERROR {row['error'][:200]}"
    if row["fault"] == "quiet":
        c = row["cost"]
        cpu = {a: (v or {}).get("cpu_pct") for a, v in c["servers"].items()}
        return (f"{row['window_s']}s; connections {c['connections']}; requests/s "
                f"{c['requests_per_s_total']}; CPU % {cpu}; balancer {c['balancer']}; "
                f"load {row['load']}")
    w = row["watch"]
    return (f"NotReady {sorted(row['not_ready']) or 'none'}; Lease gap {row['lease_gap_max_s']}s;"
            f" kubelet failed {sum(row['kubelet_failed'].values())}; watch gap "
            f"{max(v['gap_max_s'] for v in w.values())}s lost "
            f"{sum(v['lost'] for v in w.values())}; requests failed "
            f"{sum(v['requests_failed'] for v in w.values())}; skew {row['skew_after']} "
            f"{row['connections_after']}; load {row['load']}")


# --- versions and the document ----------------------------------------------------------


def product_commit() -> str:
    """The checkout's commit (12 digits), with a mark when the product's files differ
    from it (then what ran is not that commit)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo_root()), *args], capture_output=True,
                              text=True, timeout=30).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    dirty = git("status", "--porcelain", "--", "extractedprism", "pyproject.toml")
    return f"{commit} + uncommitted changes" if dirty else commit


def versions(lbs: list[str], ep_cmd: list[str], go_bin: str | None) -> dict[str, str]:
    def out(argv: list[str]) -> str:
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"? ({exc})"
        return (p.stdout + p.stderr).strip().splitlines()[0] if (p.stdout + p.stderr) else "?"

    kinds = {LBS[b][0] for b in lbs}
    v = {"kubernetes": cpbuild.KUBERNETES_VERSION, "etcd": cpbuild.ETCD_VERSION,
         "kernel": platform.release(), "cpus": str(os.cpu_count()),
         "python": out([ep_cmd[0], "--version"])}
    if "haproxy" in kinds:
        v["haproxy"] = out(["haproxy", "-v"])
    if "nginx" in kinds:
        v["nginx"] = out(["nginx", "-v"])
    if "go-original" in kinds and go_bin:
        import hashlib

        v["go-original"] = (f"{out([go_bin, '--version'])}, binary sha256 "
                            f"{hashlib.sha256(Path(go_bin).read_bytes()).hexdigest()[:16]}")
    return v


def main(argv: list[str] | None = None) -> int:
    from epscripts.fleet import compare_doc

    p = argparse.ArgumentParser(prog="scripts/compare", description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, in this order (default: {','.join(FAULTS)})")
    p.add_argument("--lbs", default=LBS_DEFAULT,
                   help=f"comma-separated balancers, of {', '.join(LBS)} (default: all; "
                   "go-original needs --go-original-bin; extractedprism-stall runs only "
                   "the stop and partition faults)")
    p.add_argument("--nodes", type=int, default=NODES_DEFAULT,
                   help=f"hollow nodes per balancer (default {NODES_DEFAULT}; another size "
                   f"writes {RESULTS_FLEET} and its own section of {DOC})")
    p.add_argument("--quiet-window", type=float, default=QUIET_S, metavar="SECONDS",
                   help=f"the quiet cell's window (default {QUIET_S:g})")
    p.add_argument("--quiet-only", default="", metavar="LBS",
                   help="comma-separated balancers measured only in the quiet cell (e.g. "
                   "the faults at fleet size for some balancers, the cost for all, in one run)")
    p.add_argument("--client-nodes", type=int, default=CLIENT_NODES, metavar="K",
                   help="the extra clients (watch, request loop) run on at most K nodes, "
                   f"evenly spread (default {CLIENT_NODES})")
    p.add_argument("--go-original-bin", help="lexfrei/extractedprism, built by hand")
    p.add_argument("--ep-cmd", help="command that runs extractedprism (default: "
                   f"{' '.join(relative_argv(default_ep_cmd()))})")
    p.add_argument("--results", help=f"JSON results (relative: to the repo; default "
                   f"{RESULTS}, or {RESULTS_FLEET} at another --nodes)")
    p.add_argument("--doc", default=DOC, help="the rendered document (relative: to the repo)")
    p.add_argument("--merge", action="store_true",
                   help="keep the cells of --results this run does not measure")
    p.add_argument("--render-only", action="store_true", help="only render --results")
    args = p.parse_args(argv)
    if not 1 <= args.nodes <= MAX_NODES:
        p.error(f"--nodes must be 1..{MAX_NODES}")
    if args.quiet_window < 10:
        p.error("--quiet-window must be at least 10 s")
    section = "main" if args.nodes == NODES_DEFAULT else "fleet"
    results_path = repo_root() / (args.results or (RESULTS if section == "main"
                                                   else RESULTS_FLEET))
    doc_path = repo_root() / args.doc
    if args.render_only:
        compare_doc.write(doc_path, json.loads(results_path.read_text()))
        return 0
    faults = [f for f in args.faults.split(",") if f]
    lbs = [b for b in args.lbs.split(",") if b]
    bad = [f for f in faults if f not in FAULTS] + [b for b in lbs if b not in LBS]
    if bad:
        p.error(f"unknown fault or balancer: {', '.join(bad)}")
    # In the order given (at fleet size: what matters most first), but scaleout first: the
    # fleet starts on two API servers for it.
    faults = sorted(dict.fromkeys(faults), key=lambda f: f != "scaleout")
    # Measured in the order given (at fleet size: what matters most first); the
    # document's columns keep LBS's order.
    lbs = list(dict.fromkeys(lbs))
    ep_cmd = args.ep_cmd.split() if args.ep_cmd else default_ep_cmd()
    skipped: dict[str, str] = {}
    quiet_only = {b for b in args.quiet_only.split(",") if b}
    if quiet_only - set(LBS):
        p.error(f"unknown balancer in --quiet-only: {', '.join(sorted(quiet_only - set(LBS)))}")
    lb_faults = {b: faults_for(b, faults, quiet_only) for b in lbs}
    for lb in list(lbs):
        why = balancers.missing(LBS[lb][0], ep_cmd, args.go_original_bin)
        if why or not lb_faults[lb]:
            if why:
                skipped[lb] = why
                _log(f"skipping {lb}: {why}")
            lbs.remove(lb)
    profile, profile_source = ([], "")
    if any(LBS[b][0] == "extractedprism" for b in lbs):
        profile, profile_source = read_profile(ep_cmd)
        _log(f"extractedprism's profile: {' '.join(profile)} (from {profile_source})")
    extras = {b: lb_extra(b, profile) + (UPGRADE_FLAGS if "upgrade" in lb_faults[b] else [])
              for b in lbs}
    if "extractedprism-stall" in lbs and not extras["extractedprism-stall"]:
        skipped["extractedprism-stall"] = "the profile has no --stall-timeout"
        lbs.remove("extractedprism-stall")
    settle_s = settle_after(profile)
    why = cphost.missing_prerequisites() or (
        f"fleet binaries missing: {cpbuild.missing(fleet=True)} (scripts/fleet build)"
        if cpbuild.missing(fleet=True) else None)
    if why:
        _log(why)
        return 1
    os.environ.setdefault("EP_CONTROLPLANE_STATE", "/tmp/extractedprism-compare")
    for line in cpplane.down_stale():
        _log(line)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    old: dict[str, Any] = {}
    if args.merge and results_path.exists():
        old = json.loads(results_path.read_text())
    results: list[dict[str, Any]] = []
    t0 = time.time()
    RUN_STARTED[0] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0))
    commit = product_commit()
    run_argv = relative_argv(["scripts/compare",
                              *(argv if argv is not None else sys.argv[1:])])
    doc = {"started": RUN_STARTED[0], "argv": run_argv, "commit": commit,
           "section": section, "nodes": args.nodes, "faults": faults,
           "lbs": [b for b in LBS if b in lbs],
           "skipped": skipped, "quiet_window_s": args.quiet_window,
           "quiet_warmup_s": QUIET_WARMUP_S, "client_nodes": args.client_nodes,
           "profile": profile, "profile_source": profile_source,
           "variants": {b: {"kind": LBS[b][0], "extra": extras[b], "faults": lb_faults[b]}
                        for b in lbs},
           "versions": versions(lbs, ep_cmd, args.go_original_bin),
           "timing": {"kill_down_s": KILL_DOWN_S, "stop_s": STOP_S,
                      "partition_s": PARTITION_S, "watch_min_s": WATCH_MIN,
                      "after_s": AFTER_S, "settle_after_s": settle_s,
                      "settle_rebalances": SETTLE_REBALANCES,
                      "write_period_s": WRITE_PERIOD, "request_period_s": REQUEST_PERIOD},
           "results": results}

    def save() -> None:
        merged = scrub(merge_runs(old, doc) if old else dict(doc))
        results_path.write_text(json.dumps(merged, indent=1) + "\n")
        compare_doc.write(doc_path, merged)

    rc = 0
    try:
        for lb in lbs:
            n = len(results)
            try:
                run_balancer(lb, lb_faults[lb], args.nodes, ep_cmd, args.go_original_bin,
                             extras[lb], settle_s, results, args.quiet_window,
                             args.client_nodes)
            except (FleetError, cphost.CPError, TimeoutError, OSError) as exc:
                _log(f"{lb}: {type(exc).__name__}: {exc}")
                done = {r["fault"] for r in results[n:]}
                results.extend({"fault": f, "lb": lb, "error": f"{type(exc).__name__}: "
                                f"{str(exc)[:500]}"} for f in lb_faults[lb] if f not in done)
                rc = 1
            save()
    except Stop as exc:
        _log(f"stopped by {exc}; what was measured is saved")
        rc = 130
    finally:
        doc["took_s"] = round(time.time() - t0)
        save()
        _log(f"wrote {results_path} and {doc_path} ({doc['took_s']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
