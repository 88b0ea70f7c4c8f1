"""scripts/bench footprint: what each proxy costs a node at rest, side by side (issue 25).

Every target is started in the configuration an operator runs, against the same three
upstreams: three fake kube-apiservers (tests/fakes, real TLS, one per loopback address
127.0.0.1-3, each serving the same three EndpointSlices and ``/readyz``), and measured
after ``--uptime`` seconds (default 60) with the kubelet's probes running against it
(liveness every 10 s, readiness every 5 s, as the chart and kubespray set them):

* ``extractedprism``: the chart's DaemonSet defaults, flag for flag as the chart renders
  them (in-cluster discovery through its own listener, readyz verified with the
  service-account CA, logfmt at info, the admin socket, the handover socket, the state
  file, the 30 s shutdown drain). The service account is mounted where a pod has it
  (/var/run/secrets/kubernetes.io/serviceaccount) in a private mount namespace
  (``unshare -m``, a tmpfs over /run), so the process reads exactly a pod's paths;
* ``ep-static``: the chart with ``enableDiscovery=false`` (tcp checks, no state file);
* ``ep-spec``: like ``extractedprism`` but with the program's (the spec's) defaults in
  place of the production profile (config/profile.py), what the chart shipped before it:
  the profile's cost side by side (not in the default ``--targets``);
* ``haproxy`` and ``nginx``: kubespray's node-local load balancer configurations
  (HAProxy mode tcp, leastconn, ``option httpchk GET /healthz`` over TLS, a /healthz
  monitor frontend; nginx stream with least_conn and two workers);
* ``go``: the Go original (lexfrei/extractedprism) with in-cluster discovery, when
  ``--go-binary`` points at a build of it (scripts/bench cannot download it).

The package is byte-compiled first (``compileall``, as the image's build does), so a
start reads code rather than compiling it, as on a node.

For each: exec to listening (the first accepted TCP connect, polled every 2 ms), then RSS,
PSS and threads (summed over the target's processes) at idle and with ``--idle-conns``
idle proxied connections, each a TLS connection holding an open watch on an upstream
(the shape of a kubelet's connections), and for extractedprism the name of every thread
(SIGUSR1's grouped dump).

``--churn N`` then runs N short proxied connections through ``ep-static`` (its
upstreams: nginx on 127.0.0.1-3; wrk with ``Connection: close``, 64 at a time, in
bounded slices of ``--churn-slice`` seconds, within ``--churn-seconds``), and reports RSS
after the first 1,000 (made 64 at a time too, once the pool is back to its warm
threads) and at the end, and how long the thread count takes to return to its idle
level (the threads of a proxy that served nothing, plus the pool's warm threads).
Everything is bounded in time and count; only loopback is used; every child runs in its
own session and is killed by group on exit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from epscripts.bench.config import HarnessError
from epscripts.bench.parse import parse_wrk, settled_rss
from epscripts.bench.services import Proc, Procs, nginx_config, raise_nofile
from epscripts.common import ROOT, free_port, wait_until
from epscripts.fleet import balancers
from extractedprism.config import profile
from tests.fakes.fake_apiserver import FakeApiServer, make_slice

TARGETS = ("extractedprism", "ep-static", "ep-spec", "haproxy", "nginx", "go")
UPSTREAM_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
WATCH_PATH = ("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices?watch=true"
              "&labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes&timeoutSeconds=3600")
# The kubelet's probes (path, period): the chart's pod (values.yaml livenessProbe,
# readinessProbe) and the Go original's; kubespray's static pods probe /healthz for both.
PROBES = {"extractedprism": (("/healthz", 10.0), ("/readyz", 5.0)),
          "go": (("/healthz", 10.0), ("/readyz", 5.0)),
          "kubespray": (("/healthz", 10.0), ("/healthz", 5.0))}
# In a private mount namespace: a tmpfs over /run, the service account bound where a pod
# has it, then exec the target (same pid: the measurement follows it).
MOUNT_SA = ('mount -t tmpfs tmpfs /run && mkdir -p /run/secrets/kubernetes.io/serviceaccount'
            ' && mount --bind "$0" /run/secrets/kubernetes.io/serviceaccount && exec "$@"')


def chart_env(tmp: Path, port: int, hport: int, endpoints: str, discovery: bool,
              with_profile: bool = True) -> dict[str, str]:
    """The EP_ variables the chart renders with its default values (values.yaml), with
    the ports and the host directories moved into ``tmp``; ``with_profile=False``: the
    program's defaults where the chart ships the production profile."""
    env = {
        "EP_ENDPOINTS": endpoints, "EP_BIND_ADDRESS": "127.0.0.1", "EP_BIND_PORT": str(port),
        "EP_HEALTH_PORT": str(hport), "EP_HEALTH_INTERVAL": "20s", "EP_HEALTH_TIMEOUT": "15s",
        "EP_ENABLE_DISCOVERY": "true" if discovery else "false", "EP_LOG_LEVEL": "info",
        "EP_LIVENESS_INTERVAL": "5s", "EP_LIVENESS_THRESHOLD": "15s",
        "EP_DRAIN_TIMEOUT": "30s", "EP_UPSTREAM_SELECTION": "random",
        "EP_HEALTH_CHECK": "readyz" if discovery else "tcp",
        "EP_HEALTH_CHECK_SERVER_NAME": "kubernetes.default.svc",
        "EP_MAX_CONNECTIONS": "4096", "EP_PIPE_SCHED": "batch", "EP_GIL_CPU": "auto",
        "EP_RELAY": "auto", "EP_DIAL_HEDGE_DELAY": "250ms",
        "EP_HANDOVER_SOCKET": str(tmp / "handover" / "handover.sock"),
        "EP_SHUTDOWN_DRAIN_TIMEOUT": "30s", "EP_STATIC_ENDPOINTS": "always",
        "EP_LOG_FORMAT": "logfmt", "EP_ADMIN_SOCKET": str(tmp / "admin" / "admin.sock"),
    }
    if with_profile:  # the chart's health check stays its own rule (readyz with discovery)
        env.update({k: v for k, v in profile.env().items() if k != "EP_HEALTH_CHECK"})
    if discovery:
        env["EP_HEALTH_CHECK_CA_FILE"] = f"{SA_PATH}/ca.crt"
        env["EP_STATE_FILE"] = str(tmp / "state" / "state.json")
    for key in ("EP_HANDOVER_SOCKET", "EP_ADMIN_SOCKET", "EP_STATE_FILE"):
        if key in env:
            Path(env[key]).parent.mkdir(parents=True, exist_ok=True)
    return env


def haproxy_kubespray(port: int, hport: int, upstreams: list[tuple[str, int]]) -> str:
    """kubespray's haproxy.cfg.j2 as the fleet renders it, on this run's loopback ports."""
    return balancers.haproxy_cfg([f"{h}:{p}" for h, p in upstreams], port=port,
                                 health=f"127.0.0.1:{hport}")


def nginx_kubespray(tmp: Path, port: int, hport: int, upstreams: list[tuple[str, int]]
                    ) -> str:
    """kubespray's nginx.conf.j2 as the fleet renders it, with a pid file and temporary
    paths of this run's own (nginx runs here outside a container)."""
    user = "user root;\n" if os.geteuid() == 0 else ""
    temps = "".join(f"  {k}_temp_path {tmp}/nginx-fp-{v};\n" for k, v in (
        ("client_body", "body"), ("proxy", "proxy"), ("fastcgi", "fastcgi"),
        ("uwsgi", "uwsgi"), ("scgi", "scgi")))
    return balancers.nginx_conf([f"{h}:{p}" for h, p in upstreams], port=port,
                                health=f"127.0.0.1:{hport}",
                                head=f"{user}pid {tmp}/nginx-fp.pid;\ndaemon off;\n",
                                http=f"  access_log off;\n{temps}")


# --- measuring a process group ------------------------------------------------------------


def group_pids(leader: int) -> list[int]:
    """The leader and every process in its process group (nginx's workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader:  # pgrp
            pids.append(int(entry))
    return sorted(pids)


def _kib(text: str, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def sample(leader: int) -> dict:
    """RSS, PSS, anonymous RSS, threads and descriptors summed over the group."""
    out = {"rss_kib": 0, "pss_kib": 0, "rss_anon_kib": 0, "threads": 0, "fds": 0,
           "processes": 0}
    for pid in group_pids(leader):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        out["rss_kib"] += _kib(status, "VmRSS")
        out["rss_anon_kib"] += _kib(status, "RssAnon")
        out["pss_kib"] += _kib(rollup, "Pss")
        m = re.search(r"^Threads:\s+(\d+)", status, re.M)
        out["threads"] += int(m.group(1)) if m else 0
        out["fds"] += fds
        out["processes"] += 1
    return out


def settled(leader: int) -> dict:
    """A sample of the group once its RSS stops moving."""
    return settled_rss(leader, timeout=10.0, interval=0.5, read=sample)


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


# --- the kubelet's probes and the idle connections ------------------------------------------


class Prober:
    """GETs each probe path at its period on its own thread until stopped, like the
    kubelet; counts the answers that were not 200."""

    def __init__(self, hport: int, probes: tuple[tuple[str, float], ...]) -> None:
        self.hport, self.probes, self.failed, self.done = hport, probes, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="footprint-probes", daemon=True)

    def _run(self) -> None:
        due = [0.0] * len(self.probes)
        while not self.stop.is_set():
            now = time.monotonic()
            for i, (path, period) in enumerate(self.probes):
                if now >= due[i]:
                    due[i] = now + period
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{self.hport}{path}",
                                                    timeout=3) as r:
                            ok = r.status == 200
                    except OSError:
                        ok = False
                    self.done += 1
                    self.failed += 0 if ok else 1
            self.stop.wait(0.2)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def open_watches(port: int, n: int, ca: ssl.SSLContext, token: str, deadline: float
                 ) -> list[socket.socket]:
    """n TLS connections through the proxy at ``port``, each with a watch open (its 200
    and headers read), then left idle."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(socks)} of {n} watches opened in time")
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            tls = ca.wrap_socket(raw, server_hostname="kubernetes.default.svc")
            socks.append(tls)
            tls.sendall(f"GET {WATCH_PATH} HTTP/1.1\r\nHost: kubernetes.default.svc\r\n"
                        f"Authorization: Bearer {token}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    raise ConnectionError("a watch closed before its answer")
                head += chunk
            if not head.startswith(b"HTTP/1.1 200"):
                raise ConnectionError(f"a watch answered {head[:40]!r}")
        return socks
    except BaseException:
        for s in socks:
            s.close()
        raise


# --- the run --------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    procs: Procs
    tmp: Path
    apis: list[FakeApiServer] = field(default_factory=list)
    sa: Path | None = None
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        print(f"  ! {text}", flush=True)
        self.notes.append(text)

    @property
    def upstreams(self) -> list[tuple[str, int]]:
        return [(a.host, a.port) for a in self.apis]

    def precompile(self) -> None:
        """Byte-compile the package as the image does, so the targets start as on a node
        (this environment may set PYTHONDONTWRITEBYTECODE, and a start that compiles
        11,000 lines is slower and leaves the heap fuller)."""
        pkg = Path(self.args.ep_pythonpath or ROOT) / "extractedprism"
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=False,
                       capture_output=True, timeout=120)

    def start_apis(self) -> None:
        # One port on the three addresses, as a cluster's API servers all use 6443: one
        # EndpointSlice with three endpoints (the Go original takes a slice's port for
        # all of its addresses).
        for _ in range(20):
            port = free_port()
            try:
                for host in UPSTREAM_HOSTS:
                    self.apis.append(FakeApiServer(host=host, port=port).start())
                break
            except OSError:
                for api in self.apis:
                    api.stop()
                self.apis.clear()
        else:
            raise HarnessError("no port free on 127.0.0.1-3 for the fake API servers")
        for api in self.apis:
            api.set_slice(make_slice("kubernetes", UPSTREAM_HOSTS, port=port))
        self.sa = self.apis[0].write_service_account(self.tmp / "sa")
        # One bundle verifies all three (each fake has its own CA).
        (self.sa / "ca.crt").write_bytes(b"".join(a.ca_pem() for a in self.apis))

    def client_ssl(self) -> ssl.SSLContext:
        assert self.sa is not None
        ctx = ssl.create_default_context(cafile=str(self.sa / "ca.crt"))
        return ctx

    def ep_env(self, port: int, hport: int, discovery: bool, endpoints: str,
               with_profile: bool = True) -> dict:
        env = dict(os.environ)
        env = {k: v for k, v in env.items() if not k.startswith("EP_")}
        env["PYTHONPATH"] = self.args.ep_pythonpath or str(ROOT)
        env.update(chart_env(self.tmp, port, hport, endpoints, discovery, with_profile))
        return env

    def argv_env(self, target: str, port: int, hport: int
                 ) -> tuple[list[str], dict | None] | None:
        endpoints = ",".join(f"{h}:{p}" for h, p in self.upstreams)
        ep = [sys.executable, "-m", "extractedprism"]
        in_pod = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_SA,
                  str(self.sa)]
        if target == "extractedprism":
            return [*in_pod, *ep], self.ep_env(port, hport, True, endpoints)
        if target == "ep-spec":
            return [*in_pod, *ep], self.ep_env(port, hport, True, endpoints, with_profile=False)
        if target == "ep-static":
            return ep, self.ep_env(port, hport, False, endpoints)
        if target == "haproxy":
            cfg = self.tmp / "haproxy-fp.cfg"
            cfg.write_text(haproxy_kubespray(port, hport, self.upstreams))
            return ["haproxy", "-db", "-f", str(cfg)], None
        if target == "nginx":
            cfg = self.tmp / "nginx-fp.conf"
            cfg.write_text(nginx_kubespray(self.tmp, port, hport, self.upstreams))
            return ["nginx", "-p", str(self.tmp), "-c", str(cfg),
                    "-e", str(self.tmp / "nginx-fp-error.log")], None
        if not self.args.go_binary:
            self.note("go skipped: no --go-binary (build lexfrei/extractedprism from source)")
            return None
        env = dict(os.environ, KUBERNETES_SERVICE_HOST="127.0.0.1",
                   KUBERNETES_SERVICE_PORT=str(self.apis[0].port))
        return [*in_pod, self.args.go_binary, "--endpoints", endpoints,
                "--bind-port", str(port), "--health-port", str(hport)], env

    def measure(self, target: str) -> None:
        port, hport = free_port(), free_port()
        spec = self.argv_env(target, port, hport)
        if spec is None:
            return
        argv, env = spec
        print(f"== {target}", flush=True)
        t0 = time.monotonic()
        proc = self.procs.start(f"fp-{target}", argv, env=env, cwd=self.tmp)
        listening = wait_until(lambda: _connects(port) or not proc.alive(), 20, interval=0.002)
        exec_ms = (time.monotonic() - t0) * 1000
        if not listening or not proc.alive():
            self.note(f"{target} did not listen: {self.procs.log_tail(proc)}")
            self.procs.stop(proc)
            return
        res: dict = {"exec_to_listening_ms": round(exec_ms, 1)}
        try:
            kind = {"ep-static": "extractedprism", "ep-spec": "extractedprism",
                    "haproxy": "kubespray",
                    "nginx": "kubespray"}.get(target, target)
            with Prober(hport, PROBES[kind]) as probes:
                uptime_end = t0 + self.args.uptime
                while time.monotonic() < uptime_end and proc.alive():
                    time.sleep(0.5)
                idle = settled(proc.popen.pid)
                if target in ("extractedprism", "ep-static", "ep-spec"):
                    res["thread_names"] = self.thread_names(proc)
                deadline = time.monotonic() + 60
                socks = open_watches(port, self.args.idle_conns, self.client_ssl(),
                                     next(iter(self.apis[0].tokens)), deadline)
                try:
                    loaded = settled(proc.popen.pid)
                finally:
                    for s in socks:
                        s.close()
                res["probes"] = {"answered": probes.done, "not_200": probes.failed}
        except (OSError, TimeoutError, ConnectionError) as e:
            self.note(f"{target}: {e}")
            res["error"] = str(e)
            self.results[target] = res
            self.procs.stop(proc, timeout=40)
            return
        res["idle"], res["with_conns"] = idle, loaded
        self.results[target] = res
        print(f"  exec->listening {exec_ms:.0f} ms; idle RSS {mib(idle['rss_kib'])} MiB "
              f"(PSS {mib(idle['pss_kib'])}) threads {idle['threads']} procs "
              f"{idle['processes']}; with {self.args.idle_conns} conns RSS "
              f"{mib(loaded['rss_kib'])} MiB threads {loaded['threads']}; probes "
              f"{probes.done} ({probes.failed} not 200)", flush=True)
        for line in res.get("thread_names", []):
            print(f"    {line}", flush=True)
        self.procs.stop(proc, timeout=40)

    def thread_names(self, proc: Proc) -> list[str]:
        """The group headers of SIGUSR1's dump: ``N threads: names parked in where``."""
        before = proc.log.read_text(errors="replace").count("thread dump")
        os.kill(proc.popen.pid, signal.SIGUSR1)
        if not wait_until(lambda: proc.log.read_text(errors="replace").count("thread dump")
                          > before, 10):
            return ["(no thread dump)"]
        text = proc.log.read_text(errors="replace")
        line = [ln for ln in text.splitlines() if "thread dump" in ln][-1]
        m = re.search(r'dump="((?:[^"\\]|\\.)*)"', line)
        dump = json.loads(f'"{m.group(1)}"') if m else ""
        return [h[4:] for h in dump.splitlines() if h.startswith("--- ")]

    # -- churn ---------------------------------------------------------------------------

    def churn(self) -> None:
        total = self.args.churn
        print(f"== churn: {total} connections through ep-static (wrk, Connection: close)",
              flush=True)
        www = self.tmp / "www"
        www.mkdir(exist_ok=True)
        (www / "index.html").write_bytes(b"x" * 127 + b"\n")
        up = free_port()
        conf = self.tmp / "nginx-churn.conf"
        conf.write_text(nginx_config(self.tmp, up, UPSTREAM_HOSTS))
        srv = self.procs.start("nginx-churn", ["nginx", "-p", str(self.tmp), "-c", str(conf),
                                               "-e", str(self.tmp / "nginx-error.log")])
        port, hport = free_port(), free_port()
        env = self.ep_env(port, hport, False, ",".join(f"{h}:{up}" for h in UPSTREAM_HOSTS))
        proc = self.procs.start("fp-churn", [sys.executable, "-m", "extractedprism"],
                                env=env, cwd=self.tmp)
        try:
            if not wait_until(lambda: _connects(port) and _connects(up), 20):
                raise HarnessError(f"churn target not listening: {self.procs.log_tail(proc)}")
            # Idle: the threads of a proxy that has served nothing, plus the warm pipe
            # threads the pool keeps once it has (datapath/pool.py WARM_THREADS).
            idle_threads = settled(proc.popen.pid)["threads"] + warm_threads(env)
            # The first 1,000, 64 at a time as the churn runs them, then the pool back to
            # its warm threads: the level the churn must come back to.
            with concurrent.futures.ThreadPoolExecutor(64, "footprint-first") as pool:
                list(pool.map(lambda _: _one_request(port), range(1000)))
            wait_until(lambda: sample(proc.popen.pid)["threads"] <= idle_threads, 90,
                       interval=0.5)
            first = settled(proc.popen.pid)
            done, timeline = 1000, [{"connections": 1000, **first}]
            deadline = time.monotonic() + self.args.churn_seconds
            while done < total and time.monotonic() < deadline:
                secs = max(1, min(self.args.churn_slice, int(deadline - time.monotonic())))
                res = subprocess.run(
                    ["wrk", "-t", "1", "-c", "64", "-d", f"{secs}s", "--timeout", "2s", "--latency",
                     "-H", "Connection: close", f"http://127.0.0.1:{port}/"],
                    capture_output=True, text=True, timeout=secs + 30, check=False)
                try:
                    r = parse_wrk(res.stdout)
                except ValueError as e:
                    raise HarnessError(f"wrk: {e}: {res.stderr[-300:]}") from e
                done += r["requests"]
                now = sample(proc.popen.pid)
                timeline.append({"connections": done, **now})
                print(f"  {done:>9} connections  RSS {mib(now['rss_kib'])} MiB  threads "
                      f"{now['threads']}  ({r['rps']:.0f} conn/s, {r['errors']} errors)",
                      flush=True)
            t_end = time.monotonic()
            after: list[tuple[float, int, int]] = []  # (seconds after the churn, threads, RSS)

            def back_to_idle() -> bool:
                now = sample(proc.popen.pid)
                after.append((round(time.monotonic() - t_end, 1), now["threads"],
                              now["rss_kib"]))
                return now["threads"] <= idle_threads

            back = wait_until(back_to_idle, 90, interval=0.5)
            threads_back_s = round(time.monotonic() - t_end, 1) if back else None
            end = settled(proc.popen.pid)
        finally:
            self.procs.stop(proc, timeout=40)
            self.procs.stop(srv)
        self.results["churn"] = {
            "asked": total, "connections": done, "idle_threads": idle_threads,
            "after_first_1000": first, "at_end": end,
            "rss_growth_kib": end["rss_kib"] - first["rss_kib"],
            "threads_back_to_idle_s": threads_back_s, "timeline": timeline,
            "after_churn": after}
        print(f"  RSS after the first 1,000: {mib(first['rss_kib'])} MiB; after {done}: "
              f"{mib(end['rss_kib'])} MiB ({end['rss_kib'] - first['rss_kib']:+d} KiB); "
              f"threads back to {idle_threads} after "
              f"{threads_back_s if back else 'more than 90'} s", flush=True)


def _one_request(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        while s.recv(4096):
            pass


def warm_threads(env: dict) -> int:
    """WARM_THREADS of the package the target runs (its PYTHONPATH)."""
    code = "from extractedprism.datapath.pool import WARM_THREADS; print(WARM_THREADS)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=30, check=False)
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else 0


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench footprint", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="extractedprism,ep-static,haproxy,nginx,go",
                   help=f"comma-separated subset of {','.join(TARGETS)} (empty: none, e.g. "
                        "for --churn alone)")
    p.add_argument("--uptime", type=float, default=60.0,
                   help="seconds each target runs, probed, before the idle sample (default 60)")
    p.add_argument("--idle-conns", type=int, default=100,
                   help="idle proxied connections (open watches) of the second sample")
    p.add_argument("--go-binary", default=os.environ.get("EP_GO_BINARY", ""),
                   help="the Go original's binary (lexfrei/extractedprism built from source)")
    p.add_argument("--ep-pythonpath", default=None,
                   help="PYTHONPATH for extractedprism (default: the repository)")
    p.add_argument("--churn", type=int, default=0,
                   help="also run this many proxied connections through ep-static (0: off)")
    p.add_argument("--churn-seconds", type=int, default=600,
                   help="time bound of the churn (default 600)")
    p.add_argument("--churn-slice", type=int, default=20,
                   help="seconds of each wrk run between samples (default 20)")
    p.add_argument("--out", default=None, help="JSON path (default bench-results/"
                                               "footprint-<ts>.json)")
    p.add_argument("--keep-tmp", action="store_true")
    a = p.parse_args(argv)
    a.targets = [t for t in a.targets.split(",") if t]
    for t in a.targets:
        if t not in TARGETS:
            p.error(f"unknown target {t!r}")
    if not 1 <= a.idle_conns <= 1000:
        p.error("--idle-conns must be 1-1000")
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for tool in ("haproxy", "nginx", "wrk", "unshare"):
        if shutil.which(tool) is None:
            print(f"bench footprint: {tool} not found on PATH", file=sys.stderr)
            return 2
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="ep-footprint-"))
    run = Run(args, Procs(tmp), tmp)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    load_before = os.getloadavg()
    failed = False
    try:
        run.precompile()
        run.start_apis()
        for target in args.targets:
            run.measure(target)
        if args.churn:
            run.churn()
    except HarnessError as e:
        run.note(f"harness error: {e}")  # the figures so far are still written
        failed = True
    finally:
        run.procs.stop_all()
        for api in run.apis:
            api.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"timestamp": stamp, "elapsed_s": round(time.monotonic() - started, 1),
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()},
              "settings": {k: v for k, v in vars(args).items()},
              "results": run.results, "notes": run.notes}
    out = Path(args.out) if args.out else ROOT / "bench-results" / f"footprint-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(render(run.results, args.idle_conns))
    print(f"JSON: {out}")
    return 2 if failed else 0


def render(results: dict, n: int) -> str:
    head = ("target", "exec->listen ms", "idle RSS MiB", "idle PSS MiB", "threads",
            f"RSS +{n} conns", f"threads +{n}")
    rows = [head]
    for target, r in results.items():
        if target == "churn" or "idle" not in r:
            continue
        i, w = r["idle"], r["with_conns"]
        rows.append((target, f"{r['exec_to_listening_ms']:.0f}", f"{mib(i['rss_kib'])}",
                     f"{mib(i['pss_kib'])}", str(i["threads"]), f"{mib(w['rss_kib'])}",
                     str(w["threads"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(wd) for cell, wd in zip(row, widths, strict=True))
                     for row in rows)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main(sys.argv[1:]))
