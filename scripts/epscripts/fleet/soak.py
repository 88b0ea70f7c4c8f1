"""scripts/chaos: a seeded chaos soak against a fleet of hollow nodes (docs/chaos.md).

A fresh control plane (etcd + three kube-apiservers, scripts/controlplane) and N hollow
nodes (scripts/fleet), each behind its own extractedprism configured as the production
profile, with the extra clients scripts/compare runs on every node (a kubectl watch resumed
from its last resourceVersion, a request loop on new connections) and its writer. Then a
random sequence, drawn from ``--seed``, of

* the five API-server faults of scripts/compare: ``kill`` (kill -9 of the server carrying
  most kubelets, restarted later), ``stop`` (SIGSTOP, then SIGCONT), ``partition`` (that
  server cut off from etcd), ``rolling`` (SIGTERM, exit, start, ready: api1, api2, api3),
  ``scale`` (a fourth server api4 started, discovered, then SIGTERMed and drained);
* the proxy's own restarts on one node: ``proxy-term`` (SIGTERM, start again),
  ``proxy-kill`` (SIGKILL, start again), ``proxy-handover`` (a new instance takes the
  listeners over through ``--handover-socket``, then the old one gets SIGTERM:
  docs/lifecycle.md).

Every second, on every node: the proxy's ``/upstreams`` and ``/metrics`` and the node's
connections to API servers, checked by :mod:`epscripts.fleet.invariants`; Node readiness
and Lease renewals (observe.Sampler). At the end: nodes NotReady, watch events lost,
request-loop failures beyond those in flight, the kubelets' failed requests (their own
``rest_client_requests_total``), the proxies' RSS, threads and fds at the start and end of
each process lifetime, and every invariant violation. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from epscripts.controlplane import build as cpbuild
from epscripts.controlplane import host as cphost
from epscripts.controlplane import plane as cpplane
from epscripts.fleet import balancers, compare, observe
from epscripts.fleet.invariants import Checker, metric_value, parse_proc_net_tcp
from epscripts.fleet.nodes import Fleet, FleetError, default_ep_cmd, repo_root

API_FAULTS = ("kill", "stop", "partition", "rolling", "scale")
PROXY_FAULTS = ("proxy-term", "proxy-kill", "proxy-handover")
KINDS = API_FAULTS + PROXY_FAULTS
SPARE = cphost.SPARE_APISERVERS[0]
# The provisional production profile (issue 28 "Better out of the box", before its one
# definition landed), used by --profile provisional: readyz with these timings, least-conn,
# rebalancing, slow start, the stall check.
PROVISIONAL = ["--health-check=readyz", "--health-interval=5s", "--health-timeout=1s",
               "--health-recheck=1s", "--unready-drain-timeout=3s", "--stall-timeout=2s",
               "--upstream-selection=least-conn", "--rebalance-interval=15s",
               "--slow-start=20s"]
# Every node's proxy also gets a handover socket of its own (the chart's default), so a
# new instance can take its listeners over.
HANDOVER = f"--handover-socket={balancers.NODE_DIR}/extractedprism.handover"
CLONE_NEWNET = 0x40000000
RECOVER_TIMEOUT = 150.0  # every server ready and every proxy seeing them so again
PROXY_START_TIMEOUT = 30.0
HANDOVER_TIMEOUT = 20.0  # the successor logs that it took the listeners
PROXY_EXIT_TIMEOUT = 20.0  # the spec's 5 s shutdown, on a loaded machine
# "No growth beyond noise" between the start and the end of a proxy's lifetime, both read
# at a quiet point (every server ready, before the next fault).
NOISE = {"rss_kib": 4096, "threads": 2, "fds": 8}


@dataclass(frozen=True)
class Timing:
    kill_down_s: float  # kill: restarted this long after SIGKILL
    stop_s: float
    partition_s: float
    scale_hold_s: float  # api4 serving before its SIGTERM
    proxy_down_s: float  # proxy-term / proxy-kill: started again after this
    pause_s: tuple[float, float]  # before each event, drawn from the seed
    tail_s: float  # watched after the last event
    duration_s: float  # the sequence is drawn until this much is planned


LONG = Timing(kill_down_s=20, stop_s=30, partition_s=60, scale_hold_s=60, proxy_down_s=2,
              pause_s=(10, 30), tail_s=65, duration_s=1200)
SHORT = Timing(kill_down_s=5, stop_s=10, partition_s=15, scale_hold_s=10, proxy_down_s=1,
               pause_s=(2, 5), tail_s=15, duration_s=0)


def _log(msg: str) -> None:
    print(f"chaos: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


class Stop(Exception):
    """SIGTERM/SIGINT: unwind through every cleanup."""


# --- the sequence --------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str
    node: str | None  # the proxy restarted (proxy faults)
    pause_s: float  # quiet time before it


def estimate_s(kind: str, timing: Timing) -> float:
    """A rough length of one event with its recovery, for planning the sequence only."""
    return {"kill": timing.kill_down_s + 15, "stop": timing.stop_s + 10,
            "partition": timing.partition_s + 15, "rolling": 45,
            "scale": timing.scale_hold_s + 45}.get(kind, timing.proxy_down_s + 10)


def plan(seed: int, nodes: list[str], timing: Timing, short: bool) -> list[Step]:
    """The sequence for ``seed``: rounds of all eight kinds, each round shuffled (short:
    one round; long: enough rounds for three times ``timing.duration_s`` by a rough
    estimate, of which the soak runs the events that start within ``duration_s``). Same
    seed, same sequence; a run executes a prefix of it."""
    rng = random.Random(seed)
    steps: list[Step] = []
    planned = 0.0
    for _ in range(1000):  # bounded: a round is eight events
        kinds = list(KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            node = rng.choice(nodes) if kind in PROXY_FAULTS else None
            pause = round(rng.uniform(*timing.pause_s), 1)
            steps.append(Step(kind, node, pause))
            planned += pause + estimate_s(kind, timing)
        if short or planned >= 3 * timing.duration_s:
            break
    return steps


# --- the profile -----------------------------------------------------------------

_PROFILE_PROBE = r"""
import json, sys
try:
    from extractedprism.config import profile as p
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
def flags(v):
    if callable(v):
        v = v()
    if isinstance(v, dict):
        return [f"--{k.replace('_', '-').lstrip('-')}={x}" for k, x in v.items()]
    if isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v):
        return list(v)
    return None
for name in ("args", "ARGS", "FLAGS", "PRODUCTION_ARGS", "PRODUCTION_FLAGS", "flags",
             "argv", "production_args", "production_flags", "PRODUCTION", "PROFILE",
             "production"):
    if hasattr(p, name):
        got = flags(getattr(p, name))
        if got:
            print(json.dumps({"name": f"extractedprism.config.profile.{name}",
                              "args": got})); sys.exit(0)
print(json.dumps({"error": "no flag list found in extractedprism.config.profile: "
                  + ", ".join(n for n in dir(p) if not n.startswith("_"))}))
"""


def supported_flags(ep_cmd: list[str]) -> str:
    proc = subprocess.run([*ep_cmd, "--help"], capture_output=True, text=True, timeout=60,
                          cwd=str(repo_root()))
    return proc.stdout + proc.stderr


def profile_args(choice: str, ep_cmd: list[str]) -> tuple[str, list[str], list[str]]:
    """(which profile, its flags, flags left out because this build lacks them)."""
    helptext = supported_flags(ep_cmd)

    def keep(args: list[str]) -> tuple[list[str], list[str]]:
        ok = [a for a in args if a.split("=", 1)[0] in helptext]
        return ok, [a for a in args if a not in ok]

    if choice in ("auto", "shipped"):
        # `extractedprism profile --format args` prints the shipped profile's flags.
        proc = subprocess.run([*ep_cmd, "profile", "--format", "args"], capture_output=True,
                              text=True, timeout=60, cwd=str(repo_root()))
        words = proc.stdout.split()
        if proc.returncode == 0 and words and all(w.startswith("--") for w in words):
            args, dropped = keep(words)
            return "shipped (`extractedprism profile`)", args, dropped
        proc = subprocess.run([ep_cmd[0], "-c", _PROFILE_PROBE], capture_output=True,
                              text=True, timeout=60, cwd=str(repo_root()))
        try:
            got = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            got = {"error": (proc.stderr or proc.stdout)[-300:]}
        if "args" in got:
            args, dropped = keep(got["args"])
            return f"shipped ({got['name']})", args, dropped
        if choice == "shipped":
            raise FleetError(f"no shipped profile: {got['error']}")
        _log(f"no shipped profile ({got['error']}); running extractedprism as scripts/fleet "
             "does")
    if choice in ("auto", "fleet"):
        return "fleet (scripts/fleet's own flags only)", [], []
    args, dropped = keep(PROVISIONAL)
    return "provisional (issue 28's values before the profile landed)", args, dropped


# --- looking at each node from inside its namespace -------------------------------------


def _enter_netns(ns: str) -> None:
    """Move the calling thread (only it) into network namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class NodeWatch:
    """Every second, inside the node's namespace: /upstreams and /metrics on one keep-alive
    connection (so both come from the same process, also during a handover) and the
    namespace's connections to API servers; fed to the node's Checker."""

    node: str
    netns: str
    checker: Checker
    max_s: float
    period: float = 1.0
    last_doc: dict[str, Any] | None = None
    last_t: float = 0.0
    failed: int = 0
    docs: int = 0
    peak: dict[str, int] = field(default_factory=dict)  # most connections per upstream
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"soak-watch-{self.node}",
                                        daemon=True)
        self._conn: http.client.HTTPConnection | None = None

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _get(self, path: str) -> bytes:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", balancers.HEALTH_PORT,
                                                    timeout=3)
        self._conn.request("GET", path)
        resp = self._conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"GET {path}: {resp.status}")
        return body

    def _run(self) -> None:
        _enter_netns(self.netns)
        deadline = time.monotonic() + self.max_s
        for _ in range(int(self.max_s / self.period) + 1):
            if self._stop.is_set() or time.monotonic() > deadline:
                return
            t0 = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def poll(self) -> None:
        t = time.time()
        try:
            doc = json.loads(self._get("/upstreams"))
            metric = metric_value(self._get("/metrics").decode(errors="replace"),
                                  "extractedprism_connections_total")
        except (OSError, ValueError, http.client.HTTPException):
            # The proxy restarting (or not listening yet): no observation this second.
            self.failed += 1
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return
        try:
            text = Path("/proc/thread-self/net/tcp").read_text()
        except OSError:
            text = ""
        sockets = parse_proc_net_tcp(text, cphost.PORT)
        with self.lock:
            self.checker.observe(t, doc, metric, sockets)
            self.last_doc, self.last_t = doc, t
            self.docs += 1
            for u in doc.get("upstreams") or []:
                a = u["address"]
                self.peak[a] = max(self.peak.get(a, 0), int(u.get("active_connections") or 0))


def proc_stats(pid: int | None) -> dict[str, Any] | None:
    """RSS, threads and descriptors of one process (sockets and pipes apart)."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    out: dict[str, Any] = {"pid": pid, "rss_kib": 0, "threads": 0, "fds": len(fds),
                           "sockets": 0, "pipes": 0}
    for line in status:
        if line.startswith("VmRSS:"):
            out["rss_kib"] = int(line.split()[1])
        elif line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                out["sockets"] += 1
            elif target.startswith("pipe:"):
                out["pipes"] += 1
    return out


# --- the soak ----------------------------------------------------------------------


@dataclass
class Event:
    n: int
    kind: str
    target: str = ""
    pause_s: float = 0.0
    t_start: float = 0.0  # after its pause: the fault's first action
    t_inject: list[float] = field(default_factory=list)  # every signal / cut it made
    t_undone: float = 0.0
    t_end: float = 0.0  # recovered: every server ready, every proxy sees them so
    proxy_down: tuple[float, float] | None = None  # no proxy listened on the node
    notes: list[str] = field(default_factory=list)
    kubelet_failed: int = 0
    lease_gap_max_s: float = 0.0
    error: str = ""


class Soak:
    def __init__(self, cp: Any, fleet: Fleet, steps: list[Step], timing: Timing,
                 ep_cmd: list[str], max_s: float) -> None:
        self.cp, self.fleet, self.steps, self.timing = cp, fleet, steps, timing
        self.ep_cmd = ep_cmd
        self.max_s = max_s
        self.events: list[Event] = []
        self.findings: list[str] = []
        self.quiet: list[dict[str, Any]] = []  # per quiet point: node -> proc stats
        self.sampler = observe.Sampler(cp, fleet.nodes, period=1.0, max_s=max_s)
        self.writer = compare.Writer(cp)
        self.writer.every = observe.Every("soak-writer", compare.WRITE_PERIOD,
                                          self.writer.tick, max_s)
        interval, timeout = 5.0, 1.0
        self.watches = {n: NodeWatch(n, fleet.netns(n), Checker(
            n, leak_s=max(5.0, 2 * timeout + 3), slack_s=2.0), max_s) for n in fleet.nodes}
        self.interval = interval
        self.cell = compare.Cell(cp, fleet, "soak", cp.binary("kubectl"))
        self.t0 = 0.0
        self.t1 = 0.0

    # -- helpers --

    def _avoid(self, apis: set[str]) -> None:
        self.sampler.avoid = set(apis)
        self.writer.avoid = set(apis)

    def _controllers_off(self, api: str, ev: Event) -> None:
        if self.fleet.state["controllers_api"] == api:
            other = next(a for a in cphost.APISERVERS
                         if a != api and self.cp.pid(a) is not None)
            self.fleet.move_controllers(other)
            ev.notes.append(f"controllers moved to {other}")

    def _sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while time.monotonic() < end:
            self._check_kubelets()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    def _check_kubelets(self) -> None:
        for node in self.fleet.nodes:
            if self.cp.pid(f"kubelet-{node}") is None:
                raise FleetError(f"kubelet-{node} exited; log tail:\n"
                                 f"{self.fleet.log(f'kubelet-{node}')[-2000:]}")

    def _proxies_alive(self, ev: Event | None) -> None:
        """A proxy that exited on its own is a finding: say so, start it again."""
        for node in self.fleet.nodes:
            if self.cp.pid(f"lb-{node}") is None:
                tail = self.fleet.log(f"lb-{node}")[-1500:]
                self.findings.append(f"proxy on {node} exited on its own"
                                     f"{f' during event {ev.n} ({ev.kind})' if ev else ''}; "
                                     f"log tail:\n{tail}")
                _log(self.findings[-1])
                self._start_proxy(node)

    def _start_proxy(self, node: str) -> int:
        return self.fleet.start_balancer(node, "extractedprism", self.ep_cmd, None)

    def _sees_all(self, want: set[str], gone: set[str]) -> bool:
        """Every node's proxy lists ``want`` healthy, ready and not draining, and not
        ``gone``, in an observation of the last two seconds."""
        now = time.time()
        for w in self.watches.values():
            with w.lock:
                doc, t = w.last_doc, w.last_t
            if doc is None or now - t > 2.5:
                return False
            ups = {u["address"]: u for u in doc.get("upstreams") or []}
            if gone & set(ups):
                return False
            for a in want:
                u = ups.get(a)
                if (u is None or not u.get("healthy") or u.get("draining_reason")
                        or u.get("readiness") not in ("ready", "n/a")):
                    return False
        return True

    def recover(self, ev: Event | None) -> float:
        """Every server ready, api4 gone, every proxy seeing them so; seconds taken."""
        t0 = time.monotonic()
        compare.restore(self.cp, self.fleet)
        if self.cp.running(SPARE):
            compare.stop_api(self.cp, SPARE)
        self._proxies_alive(ev)
        want = set(self.cp.endpoints)
        gone = {self.cp.endpoint(SPARE)}
        while not self._sees_all(want, gone):
            if time.monotonic() - t0 > RECOVER_TIMEOUT:
                docs = {n: [(u["address"], u.get("state"), u.get("readiness"))
                            for u in (w.last_doc or {}).get("upstreams", [])]
                        for n, w in self.watches.items()}
                msg = (f"not every proxy saw every server ready within "
                       f"{RECOVER_TIMEOUT:g}s after event {ev.n if ev else '-'}: {docs}")
                self.findings.append(msg)
                _log(msg)
                break
            self._check_kubelets()
            time.sleep(0.5)
        return time.monotonic() - t0

    def quiet_point(self, label: str) -> None:
        self.quiet.append({"label": label, "t": time.time(), "nodes": {
            n: proc_stats(self.cp.pid(f"lb-{n}")) for n in self.fleet.nodes}})

    # -- the run --

    def run(self) -> None:
        self.cell._start_clients(self.max_s)  # compare's clients, one set per node
        self.sampler.start()
        self.writer.every.start()
        for w in self.watches.values():
            w.start()
        try:
            self.recover(None)
            self.t0 = time.time()
            self.kube_start = compare.kubelet_requests(self.fleet)
            for i, step in enumerate(self.steps, 1):
                if self.timing.duration_s and time.time() - self.t0 >= self.timing.duration_s:
                    break  # long mode: no event starts after --duration
                ev = Event(i, step.kind, target=step.node or "", pause_s=step.pause_s)
                self.events.append(ev)
                self._sleep(step.pause_s)
                self.quiet_point(f"before {i}")
                kube_before = compare.kubelet_requests(self.fleet)
                _log(f"event {i}/{len(self.steps)}: {step.kind}"
                     f"{f' on {step.node}' if step.node else ''}")
                ev.t_start = time.time()
                try:
                    self.fault(ev)
                except (FleetError, cphost.CPError, TimeoutError, OSError) as exc:
                    ev.error = f"{type(exc).__name__}: {exc}"[:1500]
                    self.findings.append(f"event {i} ({step.kind}) failed: {ev.error}")
                    _log(self.findings[-1])
                finally:
                    self._avoid(set())
                self.recover(ev)
                ev.t_end = time.time()
                gaps = self.sampler.lease_gaps(since=ev.t_start, until=ev.t_end)
                ev.lease_gap_max_s = round(max(gaps.values()), 2) if gaps else 0.0
                kube_after = compare.kubelet_requests(self.fleet)
                ev.kubelet_failed = sum(compare.failed_requests(
                    kube_before.get(n, {}), kube_after.get(n, {})) for n in self.fleet.nodes)
                _log(f"event {i} {ev.kind} {ev.target}: done in {ev.t_end - ev.t_start:.1f}s;"
                     f" Lease gap {ev.lease_gap_max_s}s; kubelet failed {ev.kubelet_failed}; "
                     f"violations so far {self.violation_count()}")
            self._sleep(self.timing.tail_s)
            self.quiet_point("end")
            self.kube_end = compare.kubelet_requests(self.fleet)
            self.t1 = time.time()
        finally:
            for w in self.watches.values():
                w.stop()
            self.writer.every.stop()
            self.sampler.stop()
            self.cell._stop_clients()

    def violation_count(self) -> int:
        return sum(len(w.checker.violations) for w in self.watches.values())

    # -- the faults --

    def fault(self, ev: Event) -> None:
        cp = self.cp
        if ev.kind in PROXY_FAULTS:
            return self.proxy_fault(ev)
        if ev.kind == "rolling":
            ev.target = "api1,api2,api3"
            for api in cphost.APISERVERS:
                self._controllers_off(api, ev)
                self._avoid({api})
                t = time.time()
                ev.t_inject.append(t)
                clean = compare.stop_api(cp, api)
                exited = time.time() - t
                cp.start(api, cp.extra_args(api))
                ready = cp.wait_ready([api], timeout=compare.READY_TIMEOUT)
                ev.notes.append(f"{api} exited {exited:.1f}s after SIGTERM"
                                f"{'' if clean else ' (SIGKILL)'}, ready {ready:.1f}s after start")
            ev.t_undone = time.time()
            return None
        if ev.kind == "scale":
            return self.scale(ev)
        target, _ = observe.busiest_for_kubelets(cp, self.fleet)
        ev.target = target
        self._controllers_off(target, ev)
        self._avoid({target})
        ev.t_inject.append(time.time())
        if ev.kind == "kill":
            cp.kill(target)
            self._sleep(self.timing.kill_down_s)
            cp.start(target, cp.extra_args(target))
            ev.t_undone = time.time()
            ready = cp.wait_ready([target], timeout=compare.READY_TIMEOUT)
            ev.notes.append(f"{target} restarted after {self.timing.kill_down_s:g}s, ready "
                            f"{ready:.1f}s later")
            return None
        begin, undo, hold = {"stop": (cp.stop, cp.cont, self.timing.stop_s),
                             "partition": (cp.partition_etcd, cp.heal,
                                           self.timing.partition_s)}[ev.kind]
        begin(target)
        try:
            self._sleep(hold)
        finally:
            undo(target)
            ev.t_undone = time.time()
        return None

    def scale(self, ev: Event) -> None:
        cp = self.cp
        ev.target = SPARE
        addr = cp.endpoint(SPARE)
        cp.add_apiserver(SPARE)
        t = time.time()
        cp.start(SPARE)
        ready = cp.wait_ready([SPARE], timeout=compare.READY_TIMEOUT)
        deadline = time.monotonic() + 60
        while not self._sees_all({addr}, set()):
            if time.monotonic() > deadline:
                ev.notes.append(f"not every proxy saw {SPARE} ready within 60s")
                break
            time.sleep(0.5)
        ev.notes.append(f"{SPARE} ready {ready:.1f}s after start, in every proxy "
                        f"{time.time() - t:.1f}s after start")
        self._sleep(self.timing.scale_hold_s)
        peak = {n: w.peak.get(addr, 0) for n, w in self.watches.items()}
        ev.t_inject.append(time.time())
        t = time.time()
        clean = compare.stop_api(cp, SPARE)
        ev.t_undone = time.time()
        deadline = time.monotonic() + 120
        while not self._sees_all(set(), {addr}):
            if time.monotonic() > deadline:
                ev.notes.append(f"{SPARE} still listed by a proxy 120s after its SIGTERM")
                break
            time.sleep(0.5)
        ev.notes.append(f"{SPARE} carried up to {peak} connections; exited "
                        f"{ev.t_undone - t:.1f}s after SIGTERM{'' if clean else ' (SIGKILL)'}"
                        f", gone from every proxy {time.time() - t:.1f}s after it")

    def proxy_fault(self, ev: Event) -> None:
        node = ev.target
        assert node
        name = f"lb-{node}"
        cp, fleet = self.cp, self.fleet
        old_pid = cp.pid(name)
        if ev.kind in ("proxy-term", "proxy-kill"):
            sig = signal.SIGTERM if ev.kind == "proxy-term" else signal.SIGKILL
            t = time.time()
            ev.t_inject.append(t)
            fleet.stop_proc(name, sig, timeout=PROXY_EXIT_TIMEOUT)
            if cp.pid(name) is not None:
                ev.notes.append(f"pid {old_pid} still running {PROXY_EXIT_TIMEOUT:g}s "
                                f"after {sig.name}: SIGKILL")
                fleet.stop_proc(name, signal.SIGKILL)
                self.findings.append(f"event {ev.n}: proxy on {node} (pid {old_pid}) did not "
                                     f"exit within {PROXY_EXIT_TIMEOUT:g}s of SIGTERM")
            exited = time.time() - t
            self._sleep(self.timing.proxy_down_s)
            new_pid = self._start_proxy(node)
            t_up = time.time()
            ev.proxy_down = (t, t_up)
            ev.t_undone = t_up
            ev.notes.append(f"pid {old_pid} exited {exited:.2f}s after {sig.name}; pid "
                            f"{new_pid} listening {t_up - t:.2f}s after the signal")
            return
        # Handover: the successor takes the listeners, then the old one gets SIGTERM.
        old = cp._children.get(name)  # our Popen of it: reaped here, not by the plane
        log_path = Path(cp.dir) / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        t = time.time()
        ev.t_inject.append(t)
        new_pid = self._start_proxy(node)
        deadline = time.monotonic() + HANDOVER_TIMEOUT
        took = False
        while time.monotonic() < deadline:
            with open(log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if "took over listeners" in text:
                took = True
                break
            if cp.pid(name) is None:
                break
            time.sleep(0.1)
        t_took = time.time()
        if not took:
            self.findings.append(f"event {ev.n}: the new proxy on {node} (pid {new_pid}) did "
                                 f"not take the listeners over; its log:\n{text[-1500:]}")
        assert old_pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGTERM)
        ev.t_inject.append(time.time())
        exited = None
        if old is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.wait(PROXY_EXIT_TIMEOUT)
                exited = time.time() - t_took
        if exited is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old_pid, signal.SIGKILL)
            if old is not None:
                old.wait(10)
            self.findings.append(f"event {ev.n}: old proxy pid {old_pid} on {node} did not "
                                 f"exit within {PROXY_EXIT_TIMEOUT:g}s of SIGTERM")
        ev.t_undone = time.time()
        if not took and cp.pid(name) is None:
            new_pid = self._start_proxy(node)
            ev.proxy_down = (t_took, time.time())
        ev.notes.append(f"pid {new_pid} took the listeners {t_took - t:.2f}s after its start"
                        f"{'' if took else ' (NOT)'}; old pid {old_pid} exited "
                        f"{exited if exited is None else round(exited, 2)}s after SIGTERM")


# --- figures -------------------------------------------------------------------


def request_failures(soak: Soak) -> dict[str, Any]:
    """The request loops' failures, each classified: ``in_flight`` (its connection began
    before a signal or cut of an event and failed after it), ``proxy_down`` (refused while
    its node had no proxy listening: a bare restart, docs/lifecycle.md), ``beyond`` (the
    rest: the ones that count)."""
    injects = sorted(t for ev in soak.events for t in ev.t_inject)
    out: dict[str, Any] = {"requests": 0, "failed": 0, "in_flight": 0, "proxy_down": 0,
                           "beyond": 0, "beyond_list": []}
    for node in soak.fleet.nodes:
        path = soak.fleet.node_dir(node) / "clients-soak.jsonl"
        downs = [ev.proxy_down for ev in soak.events
                 if ev.target == node and ev.proxy_down is not None]
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("kind") != "req" or not soak.t0 <= r["t"] <= soak.t1:
                    continue
                out["requests"] += 1
                if r["ok"]:
                    continue
                out["failed"] += 1
                end, begin = r["t"], r["t"] - float(r.get("dt") or 0)
                if any(begin < t <= end for t in injects):
                    out["in_flight"] += 1
                elif any(a - 0.5 <= begin <= b + 0.5 for a, b in downs):
                    out["proxy_down"] += 1
                else:
                    out["beyond"] += 1
                    ev = event_at(soak.events, begin)
                    when = (f"during event {ev.n} {ev.kind} {ev.target}".rstrip() if ev
                            else "between events")
                    out["beyond_list"].append(
                        f"{time.strftime('%H:%M:%S', time.gmtime(begin))} {node} "
                        f"{r.get('err') or 'HTTP ' + str(r.get('status'))} ({when}, "
                        f"+{begin - ev.t_start:.1f}s)" if ev else f"({when})")
    return out


def event_at(events: list[Event], t: float) -> Event | None:
    for ev in events:
        if ev.t_start <= t <= (ev.t_end or t):
            return ev
    return None


def lifetimes(soak: Soak) -> list[dict[str, Any]]:
    """Per proxy process seen at two quiet points or more: its stats at the first and the
    last, and their difference."""
    seen: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = {}
    for q in soak.quiet:
        for node, st in q["nodes"].items():
            if st:
                seen.setdefault((node, st["pid"]), []).append((q["label"], st))
    out = []
    for (node, pid), pts in seen.items():
        (la, a), (lb, b) = pts[0], pts[-1]
        out.append({"node": node, "pid": pid, "from": la, "to": lb, "points": len(pts),
                    "start": a, "end": b,
                    "growth": {k: b[k] - a[k] for k in ("rss_kib", "threads", "fds",
                                                        "sockets", "pipes")}})
    return out


def report(soak: Soak, meta: dict[str, Any]) -> dict[str, Any]:
    fleet = soak.fleet
    not_ready = soak.sampler.not_ready(since=soak.t0)
    gaps = soak.sampler.lease_gaps(since=soak.t0, until=soak.t1)
    watch = {}
    for node in fleet.nodes:
        watch[node] = compare.watch_figures(fleet.node_dir(node) / "clients-soak.jsonl",
                                            soak.writer.written, soak.t0, soak.t1)
    kube = {n: compare.failed_requests(soak.kube_start.get(n, {}), soak.kube_end.get(n, {}))
            for n in fleet.nodes}
    kube_total = {n: sum(soak.kube_end.get(n, {}).values())
                  - sum(soak.kube_start.get(n, {}).values()) for n in fleet.nodes}
    violations = sorted((v for w in soak.watches.values() for v in w.checker.violations),
                        key=lambda v: v.t)
    life = lifetimes(soak)
    grew = [x for x in life if x["points"] >= 2 and any(
        x["growth"][k] > lim for k, lim in NOISE.items())]
    reqs = request_failures(soak)
    return {
        **meta,
        "sequence": [{"n": ev.n, "kind": ev.kind, "target": ev.target,
                      "pause_s": ev.pause_s,
                      "took_s": round(ev.t_end - ev.t_start, 1) if ev.t_end else None,
                      "lease_gap_max_s": ev.lease_gap_max_s,
                      "kubelet_failed": ev.kubelet_failed, "notes": ev.notes,
                      "error": ev.error} for ev in soak.events],
        "soak_s": round(soak.t1 - soak.t0, 1),
        "not_ready": {n: [(round(t - soak.t0, 1), why) for t, why in v]
                      for n, v in not_ready.items()},
        "lease_gap_max_s": round(max(gaps.values()), 2) if gaps else None,
        "lease_gaps_s": {n: round(g, 2) for n, g in gaps.items()},
        "watch": watch,
        "watch_lost": sum(w["lost"] for w in watch.values()),
        "requests": reqs,
        "kubelet_failed": kube, "kubelet_requests": kube_total,
        "lifetimes": life, "growth_beyond_noise": grew, "noise": NOISE,
        "observations": {n: w.checker.observations for n, w in soak.watches.items()},
        "observations_failed": {n: w.failed for n, w in soak.watches.items()},
        "violations": [asdict(v) | {"line": v.line()} for v in violations],
        "findings": soak.findings,
        "writer": {"written": len(soak.writer.written), "failures": soak.writer.failures},
        "sampler_failed_polls": soak.sampler.failed_polls,
    }


def verdict(rep: dict[str, Any]) -> list[tuple[bool, str]]:
    """The pass lines of a report."""
    v = len(rep["violations"])
    req = rep["requests"]
    return [
        (not rep["not_ready"], f"nodes NotReady: {sorted(rep['not_ready']) or 0} (target 0); "
         f"longest Lease gap {rep['lease_gap_max_s']}s"),
        (rep["watch_lost"] == 0, f"watch events lost: {rep['watch_lost']} (target 0)"),
        (req["beyond"] == 0, f"request-loop failures beyond those in flight: {req['beyond']} "
         f"of {req['requests']} (in flight {req['in_flight']}, refused while the node's "
         f"proxy was restarting {req['proxy_down']})"),
        (v == 0, f"/upstreams invariant violations: {v} in "
         f"{sum(rep['observations'].values())} observations"),
        (not rep["growth_beyond_noise"], f"proxy lifetimes with growth beyond noise "
         f"{rep['noise']}: {len(rep['growth_beyond_noise'])} of {len(rep['lifetimes'])}"),
        (not rep["findings"], f"findings: {len(rep['findings'])}"),
    ]


def render(rep: dict[str, Any]) -> str:
    lines = [f"seed {rep['seed']}; profile: {rep['profile']} {' '.join(rep['profile_args'])}"
             + (f" (left out, not in this build: {' '.join(rep['profile_dropped'])})"
                if rep["profile_dropped"] else ""),
             f"commit {rep['commit']}; {rep['nodes']} nodes; soak {rep['soak_s']}s; load "
             f"average {rep.get('load_min')}-{rep.get('load_max')} (mean {rep.get('load_mean')})",
             "sequence:"]
    for e in rep["sequence"]:
        lines.append(f"  {e['n']:2d}. {e['kind']:<15} {e['target']:<15} pause {e['pause_s']}s, "
                     f"took {e['took_s']}s, Lease gap {e['lease_gap_max_s']}s, kubelet "
                     f"failed {e['kubelet_failed']}; {'; '.join(e['notes'])}"
                     + (f" ERROR {e['error']}" if e["error"] else ""))
    lines.append("kubelet requests failed: " + ", ".join(
        f"{n} {f} of {rep['kubelet_requests'][n]}" for n, f in rep["kubelet_failed"].items()))
    for node, w in rep["watch"].items():
        lines.append(f"watch {node}: gap {w['gap_max_s']}s, reconnects {w['reconnects']}, "
                     f"relists {w['relists']}, lost {w['lost']} of {w['events_due']}; requests "
                     f"{w['requests']}, failed {w['requests_failed']} {w['request_errors']}")
    for x in rep["lifetimes"]:
        a, b = x["start"], x["end"]
        lines.append(f"proxy {x['node']} pid {x['pid']} ({x['from']} -> {x['to']}, "
                     f"{x['points']} points): RSS {a['rss_kib'] // 1024} -> "
                     f"{b['rss_kib'] // 1024} MiB, threads {a['threads']} -> {b['threads']}, "
                     f"fds {a['fds']} -> {b['fds']} (sockets {a['sockets']} -> {b['sockets']},"
                     f" pipes {a['pipes']} -> {b['pipes']})")
    for v in rep["violations"]:
        lines.append(f"VIOLATION {v['line']}")
    for f in rep["findings"]:
        lines.append(f"FINDING {f}")
    for r in rep["requests"]["beyond_list"][:50]:
        lines.append(f"request failed beyond in flight: {r}")
    ok = verdict(rep)
    lines += [f"{'PASS' if p else 'FAIL'} {text}" for p, text in ok]
    lines.append(f"RESULT: {'PASS' if all(p for p, _ in ok) else 'FAIL'}")
    return "\n".join(lines)


# --- the command -----------------------------------------------------------------


def run(cp: Any, *, seed: int, short: bool, nodes: int, timing: Timing, ep_cmd: list[str],
        profile: str, fleet_ready_timeout: float = compare.READY_TIMEOUT,
        ) -> dict[str, Any]:
    """Fleet up on ``cp`` (running), the sequence, the report; the fleet is taken down."""
    name, args, dropped = profile_args(profile, ep_cmd)
    fleet = Fleet(cp)
    if fleet.state["nodes"]:
        fleet.down()
    status, body = cp.request("api1", "/api/v1/namespaces", method="POST",
                              body={"metadata": {"name": compare.NAMESPACE}})
    if status not in (201, 409):
        raise FleetError(f"namespace {compare.NAMESPACE}: {status} {body}")
    status, body = cp.request("api1", f"/api/v1/namespaces/{compare.NAMESPACE}/configmaps",
                              method="POST", body={"metadata": {"name": compare.CONFIGMAP},
                                                   "data": {"seq": "0"}})
    if status not in (201, 409):
        raise FleetError(f"ConfigMap {compare.CONFIGMAP}: {status} {body}")
    loads: list[float] = []
    monitor = observe.Every("soak-load", 5.0, lambda: loads.append(compare.loadavg()),
                            10_000)
    monitor.start()
    try:
        took = fleet.up(nodes, "extractedprism", ep_cmd=ep_cmd, lb_extra=[*args, HANDOVER],
                        controllers_api="api1", timeout=fleet_ready_timeout)
        _log(f"{nodes} nodes Ready in {took:.1f}s; profile {name}: {' '.join(args)}")
        steps = plan(seed, fleet.nodes, timing, short)
        _log(f"seed {seed}: " + ", ".join(
            f"{s.kind}{f'@{s.node}' if s.node else ''}" for s in steps))
        bound = sum(s.pause_s + estimate_s(s.kind, timing) * 3 + RECOVER_TIMEOUT
                    for s in steps) + timing.tail_s + 120
        soak = Soak(cp, fleet, steps, timing, ep_cmd, bound)
        soak.run()
        meta = {"seed": seed, "short": short, "nodes": nodes, "profile": name,
                "profile_args": [*args, HANDOVER.replace(balancers.NODE_DIR, "<node>")],
                "profile_dropped": dropped, "timing": asdict(timing),
                "commit": commit(), "started": time.strftime(
                    "%Y-%m-%d %H:%M UTC", time.gmtime(soak.t0)),
                "versions": {"kubernetes": cpbuild.KUBERNETES_VERSION,
                             "etcd": cpbuild.ETCD_VERSION}}
        monitor.stop()
        meta.update(load_min=min(loads, default=None), load_max=max(loads, default=None),
                    load_mean=round(sum(loads) / len(loads), 1) if loads else None)
        return report(soak, meta)
    finally:
        monitor.stop()
        for line in fleet.down():
            _log(line)


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(repo_root()), *a], capture_output=True,
                              text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--",
                                                 "extractedprism") else ""
    return git("rev-parse", "--short=12", "HEAD") + dirty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, help="the sequence's seed (default: a random one, "
                   "printed)")
    p.add_argument("--short", action="store_true",
                   help="one round of the eight events with short holds (CI, ~3-5 min)")
    p.add_argument("--duration", type=float, default=LONG.duration_s,
                   help="seconds of events to plan (long mode; default %(default)g)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--profile", choices=("auto", "shipped", "provisional", "fleet"),
                   default="auto", help="auto: the shipped profile (`extractedprism "
                   "profile`) if this checkout has one, else scripts/fleet's flags only "
                   "(fleet); provisional: issue 28's values before the profile landed")
    p.add_argument("--ep-cmd", help="command that runs extractedprism (default: "
                   f"{' '.join(default_ep_cmd())})")
    p.add_argument("--plan-only", action="store_true", help="print the sequence and exit")
    p.add_argument("--json", help="write the report as JSON here too")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    timing = SHORT if args.short else Timing(**{**asdict(LONG), "duration_s": args.duration})
    if args.plan_only:
        nodes = [f"n{i}" for i in range(1, args.nodes + 1)]
        print(f"seed {seed}")
        for i, s in enumerate(plan(seed, nodes, timing, args.short), 1):
            print(f"{i:2d}. {s.kind}{f' {s.node}' if s.node else ''} (pause {s.pause_s}s)")
        return 0
    print(f"seed {seed}", flush=True)
    why = cphost.missing_prerequisites() or (
        f"fleet binaries missing: {cpbuild.missing(fleet=True)} (scripts/fleet build)"
        if cpbuild.missing(fleet=True) else None)
    if why:
        _log(f"SKIP: {why}")
        return 2
    ep_cmd = args.ep_cmd.split() if args.ep_cmd else default_ep_cmd()

    def on_signal(signum: int, _frame: Any) -> None:
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for line in cpplane.down_stale():
        _log(line)
    cp = cpplane.ControlPlane.create(owner_pid=os.getpid())
    try:
        _log(f"control plane {cp.id} up in {cp.up():.1f}s")
        rep = run(cp, seed=seed, short=args.short, nodes=args.nodes, timing=timing,
                  ep_cmd=ep_cmd, profile=args.profile)
    except Stop as exc:
        _log(f"stopped by {exc}")
        return 130
    finally:
        for line in cp.down():
            _log(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    print(render(rep))
    return 0 if all(ok for ok, _ in verdict(rep)) else 1


if __name__ == "__main__":
    sys.exit(main())
