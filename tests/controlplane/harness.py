"""Clients and observers for the real-control-plane tests.

Everything here talks to the cluster through the proxy under test, as a node's clients
would, with TLS verified as ``kubernetes.default.svc`` against the run's CA:

* :class:`Load`: threads of the Python ``kubernetes`` client doing GETs (some on
  keep-alive connections, some on a fresh connection per request), counting failures
  (an exception that reaches the caller after the client's own retries) and latency.
* :class:`Writer`: one thread patching a ConfigMap ``tick`` (``data.seq``) at a fixed
  period, so that watches have events to carry.
* :class:`Watcher`: one long-lived ``kubectl`` watch (client-go over HTTP/2) of the
  test namespace's ConfigMaps; when its stream ends it is started again from the last
  resourceVersion it saw, as an informer would. It records every event and every end.
* :class:`Sampler`: polls the proxy's ``/upstreams`` (and ``/readyz``), and optionally
  each apiserver's own ``/readyz``, every ``POLL`` seconds into a timeline the tests
  read their figures from.

Threads are named ``cp-*`` and take named methods; every loop is bounded by a stop
event, a deadline and a count.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s

SERVER_NAME = "kubernetes.default.svc"
POLL = 0.1  # sampler period
MAX_RUN_S = 600.0  # hard cap on any background loop, on top of its stop event
CLIENT_CONNECT_TIMEOUT = 5.0
CLIENT_READ_TIMEOUT = 10.0


def mono() -> float:
    return time.monotonic()


# Every background client started and not yet stopped, so a failing test's teardown
# (tests/controlplane/conftest.py) stops them all: no kubectl outlives its test.
LIVE: list[Any] = []


def stop_live() -> None:
    while LIVE:
        with contextlib.suppress(Exception):
            LIVE.pop().stop()


_Client = TypeVar("_Client")


def start_live(client: _Client, threads: list[threading.Thread]) -> _Client:
    """Start a background client's ``threads``, listed in LIVE first so that a failing
    test's teardown stops it."""
    LIVE.append(client)
    for t in threads:
        t.start()
    return client


class ClientGoRetry(urllib3.Retry):
    """Retries the way client-go does: a GET whose connection broke (urllib3's default:
    idempotent methods on connect and read errors), and *any* verb answered 429 or 503
    with ``Retry-After``, which the apiserver sends when it refused the request without
    processing it ("apiserver is shutting down" on a connection that was open when it
    got SIGTERM). client-go's rest.Request retries those up to 10 times; the Python
    client retries nothing by status on its own."""

    retried_after: int = 0  # across all clients: answers retried after Retry-After
    _count_lock = threading.Lock()

    def is_retry(self, method: str, status_code: int, has_retry_after: bool = False) -> bool:
        if self.total and has_retry_after and status_code in (429, 503):
            with ClientGoRetry._count_lock:
                ClientGoRetry.retried_after += 1
            return True
        return False


def client_go_retries() -> ClientGoRetry:
    return ClientGoRetry(total=10, connect=3, read=3, redirect=0, status=10,
                         respect_retry_after_header=True)


def api_client(port: int, ca: str, token: str, *, fresh_connections: bool = False,
               host: str = "127.0.0.1") -> k8s.ApiClient:
    """A Python kubernetes client that reaches the cluster through the proxy on ``port``."""
    cfg = k8s.Configuration(host=f"https://{host}:{port}")
    cfg.ssl_ca_cert = ca
    cfg.verify_ssl = True
    cfg.tls_server_name = SERVER_NAME
    cfg.proxy = None
    cfg.retries = client_go_retries()
    cfg.api_key["BearerToken"] = token
    cfg.api_key_prefix["BearerToken"] = "Bearer"
    api = k8s.ApiClient(cfg)
    if fresh_connections:
        # The server closes after each answer: every request is a new TCP+TLS connection
        # through the proxy, i.e. a new pick.
        api.set_default_header("Connection", "close")
    return api


# --- load -----------------------------------------------------------------------


@dataclass
class LoadStats:
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    # (start, duration) of each request, fresh-connection threads only
    fresh_latencies: list[tuple[float, float]] = field(default_factory=list)


class Load:
    """``threads`` client threads doing GETs through the proxy until stopped."""

    def __init__(self, port: int, ca: str, token: str, *, keepalive: int = 2, fresh: int = 2,
                 period: float = 0.05, max_requests: int = 20_000,
                 read_timeout: float = CLIENT_READ_TIMEOUT) -> None:
        self.port, self.ca, self.token = port, ca, token
        self.period = period
        self.max_requests = max_requests
        self.read_timeout = read_timeout
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(False,), daemon=True,
                                          name=f"cp-load-keepalive-{i}")
                         for i in range(keepalive)]
        self._threads += [threading.Thread(target=self._run, args=(True,), daemon=True,
                                           name=f"cp-load-fresh-{i}") for i in range(fresh)]

    def start(self) -> Load:
        return start_live(self, self._threads)

    def _run(self, fresh: bool) -> None:
        api = api_client(self.port, self.ca, self.token, fresh_connections=fresh)
        core = k8s.CoreV1Api(api)
        deadline = mono() + MAX_RUN_S
        try:
            for _ in range(self.max_requests):
                if self._stop.is_set() or mono() > deadline:
                    break
                t0 = mono()
                try:
                    core.read_namespace("default", _request_timeout=(CLIENT_CONNECT_TIMEOUT,
                                                                     self.read_timeout))
                    ok, err = True, ""
                except Exception as exc:  # any failure the caller would see
                    ok, err = False, f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}"
                dt = mono() - t0
                with self._lock:
                    if ok:
                        self.stats.ok += 1
                    else:
                        self.stats.failed += 1
                        if len(self.stats.errors) < 20:
                            self.stats.errors.append(err[:300])
                    if fresh:
                        self.stats.fresh_latencies.append((t0, dt))
                self._stop.wait(self.period)
        finally:
            api.close()

    def stop(self) -> LoadStats:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_CONNECT_TIMEOUT + 3 * self.read_timeout + 5)
        return self.stats


# --- writer ---------------------------------------------------------------------


class Writer:
    """Patches ConfigMap ``tick`` in ``namespace`` every ``period`` seconds."""

    def __init__(self, port: int, ca: str, token: str, namespace: str, period: float = 0.25,
                 max_writes: int = 5000) -> None:
        self.namespace = namespace
        self.period = period
        self.max_writes = max_writes
        self.api = api_client(port, ca, token)
        self.core = k8s.CoreV1Api(self.api)
        self.seq = 0
        self.ok = 0
        self.failed = 0
        self.errors: list[str] = []
        self.written: list[tuple[float, int, str]] = []  # (time, seq, resourceVersion)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cp-writer", daemon=True)

    def create(self) -> None:
        self.core.create_namespaced_config_map(
            self.namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="tick"),
                                            data={"seq": "0"}))

    def start(self) -> Writer:
        return start_live(self, [self._thread])

    def _run(self) -> None:
        deadline = mono() + MAX_RUN_S
        for _ in range(self.max_writes):
            if self._stop.wait(self.period) or mono() > deadline:
                break
            self.seq += 1
            try:
                cm = self.core.patch_namespaced_config_map(
                    "tick", self.namespace, {"data": {"seq": str(self.seq)}},
                    _request_timeout=(CLIENT_CONNECT_TIMEOUT, CLIENT_READ_TIMEOUT))
                self.ok += 1
                self.written.append((mono(), self.seq, cm.metadata.resource_version))
            except Exception as exc:
                self.failed += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{time.strftime('%H:%M:%S')} seq={self.seq} "
                                       f"{type(exc).__name__}: "
                                       f"{getattr(exc, 'body', None) or str(exc)[:300]}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CLIENT_CONNECT_TIMEOUT + 3 * CLIENT_READ_TIMEOUT + 5)
        self.api.close()


# --- kubectl watches ------------------------------------------------------------


@dataclass
class StreamEnd:
    at: float
    returncode: int | None
    stderr: str
    last_event_at: float | None


class Watcher:
    """One long-lived kubectl watch, started again from its last resourceVersion on end.

    ``kubectl get --raw '/api/v1/namespaces/NS/configmaps?watch=1&resourceVersion=RV'``:
    kubectl's own client-go REST client over HTTP/2, one request on one connection, and
    its output is the server's event stream line by line, so each event is timed as it
    arrives. (``kubectl get --watch`` cannot resume from a resourceVersion; an informer
    can, and this loop does what an informer does.)
    """

    def __init__(self, kubectl: str, kubeconfig: str, namespace: str, name: str,
                 max_streams: int = 100) -> None:
        self.kubectl, self.kubeconfig, self.namespace = kubectl, kubeconfig, namespace
        self.name = name
        self.max_streams = max_streams
        self.events: list[tuple[float, str, str, int | None]] = []  # (t, type, rv, seq)
        self.ends: list[StreamEnd] = []
        self.gone = 0  # 410s met (then the loop re-watches from "now")
        self.streams = 0
        self.rv = ""
        self.first_event = threading.Event()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"cp-watch-{name}", daemon=True)

    def start(self) -> Watcher:
        return start_live(self, [self._thread])

    def _command(self) -> list[str]:
        q = "watch=1&timeoutSeconds=900"
        if self.rv:
            q += f"&resourceVersion={self.rv}"
        return [self.kubectl, "--kubeconfig", self.kubeconfig, "--request-timeout=0",
                "get", "--raw", f"/api/v1/namespaces/{self.namespace}/configmaps?{q}"]

    def _run(self) -> None:
        deadline = mono() + MAX_RUN_S
        env = {**os.environ, "HOME": str(Path(self.kubeconfig).parent)}
        while not self._stop.is_set() and mono() < deadline and self.streams < self.max_streams:
            self.streams += 1
            with self._lock:
                if self._stop.is_set():
                    break
                self._proc = subprocess.Popen(self._command(), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                              env=env)
            proc = self._proc
            assert proc.stdout is not None and proc.stderr is not None
            last = None
            try:
                for line in proc.stdout:
                    now = mono()
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            self.gone += 1
                            self.rv = ""
                        continue
                    rv = (obj.get("metadata") or {}).get("resourceVersion", "")
                    seq_s = (obj.get("data") or {}).get("seq")
                    seq = int(seq_s) if seq_s and seq_s.isdigit() else None
                    self.events.append((now, ev.get("type", ""), rv, seq))
                    last = now
                    if rv:
                        self.rv = rv
                    self.first_event.set()
                rc = proc.wait()
                err = proc.stderr.read().decode(errors="replace")[-300:]
            finally:
                proc.stdout.close()
                proc.stderr.close()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if not self._stop.is_set():
                self.ends.append(StreamEnd(mono(), rc, err.strip(), last))
                self._stop.wait(0.05)  # a tight loop if kubectl fails at once

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(signal.SIGTERM)
        self._thread.join(15)

    def seqs(self) -> set[int]:
        return {s for _, _, _, s in self.events if s is not None}

    def max_gap(self, t0: float, t1: float) -> float:
        """Longest time without an event inside [t0, t1]."""
        times = [t0] + [t for t, *_ in self.events if t0 <= t <= t1] + [t1]
        return max(b - a for a, b in itertools.pairwise(times))


def sigterm_and_wait(cp: Any, api: str, timeout: float = 90.0) -> float:
    """SIGTERM ``api`` (a graceful stop) and wait for it to exit; the seconds it took."""
    t = mono()
    cp.term(api)
    assert cp.wait_exit(api, timeout), f"{api} did not exit within {timeout:g}s of SIGTERM"
    return mono() - t


def events_lost(writer: Writer, watchers: list[Watcher], timeout: float = 60.0
                ) -> dict[str, list[int]]:
    """Once every watch has received the writer's last successful write (failing the
    test after ``timeout``): per watch, the successful writes it never received (the
    first 10; a watch that lost none is left out)."""
    from tests.util import wait_until

    final = max((s for _, s, _ in writer.written), default=0)
    wait_until(lambda: all(final in w.seqs() for w in watchers), timeout,
               message="every watch caught up with the last write")
    written = {s for _, s, _ in writer.written}
    return {w.name: sorted(written - w.seqs())[:10] for w in watchers if written - w.seqs()}


# --- proxy observation ---------------------------------------------------------------


def http_json(url: str, timeout: float = 2.0) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_status(url: str, timeout: float = 2.0) -> int | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        exc.close()
        return int(exc.code)
    except OSError:
        return None


@dataclass
class Sample:
    t: float
    ups: dict[str, dict[str, Any]]  # address -> /upstreams entry
    readyz: int | None  # the proxy's own /readyz
    direct: dict[str, Any]  # whatever the test's ``direct`` callable observed


class Sampler:
    """Timeline of the proxy's /upstreams, its /readyz and optionally apiservers' /readyz."""

    def __init__(self, health_port: int, direct: Callable[[], dict[str, Any]] | None = None,
                 period: float = POLL) -> None:
        self.base = f"http://127.0.0.1:{health_port}"
        self.direct = direct
        self.period = period
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cp-sampler", daemon=True)

    def start(self) -> Sampler:
        return start_live(self, [self._thread])

    def _run(self) -> None:
        deadline = mono() + MAX_RUN_S
        while not self._stop.is_set() and mono() < deadline:
            t = mono()
            try:
                ups = {u["address"]: u for u in http_json(f"{self.base}/upstreams")["upstreams"]}
            except (OSError, ValueError, KeyError):
                ups = {}
            rz = http_status(f"{self.base}/readyz")
            direct = self.direct() if self.direct else {}
            self.samples.append(Sample(t, ups, rz, direct))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, t0: float, t1: float | None = None) -> Iterator[Sample]:
        for s in list(self.samples):
            if s.t >= t0 and (t1 is None or s.t <= t1):
                yield s

    def first(self, pred: Callable[[Sample], bool], after: float) -> Sample | None:
        return next((s for s in self.window(after) if pred(s)), None)

    def wait_for(self, pred: Callable[[Sample], bool], after: float, timeout: float,
                 what: str) -> Sample:
        deadline = mono() + timeout
        while mono() < deadline:
            s = self.first(pred, after)
            if s is not None:
                return s
            time.sleep(self.period / 2)
        last = self.samples[-1] if self.samples else None
        raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}; "
                             f"last /upstreams: {json.dumps(last.ups if last else None)[:1500]}")


def upstreams(health_port: int) -> dict[str, dict[str, Any]]:
    return {u["address"]: u for u in
            http_json(f"http://127.0.0.1:{health_port}/upstreams")["upstreams"]}


# --- the product under test ---------------------------------------------------------


@dataclass
class Proxy:
    """One extractedprism process (``python -m extractedprism``) in front of a run."""

    proc: subprocess.Popen[bytes]
    port: int
    health_port: int
    args: list[str]
    log_path: Path
    kubeconfig: Path  # admin, through this proxy (for test clients)
    cp: Any

    def upstreams(self) -> dict[str, dict[str, Any]]:
        return upstreams(self.health_port)

    def metrics(self) -> str:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.health_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float | None:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == name or key == f"{name}{{{want}}}":
                return float(value)
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, fresh: bool = False) -> k8s.ApiClient:
        return api_client(self.port, self.cp.ca, self.cp.token("admin"),
                          fresh_connections=fresh)

    def watcher(self, namespace: str, name: str) -> Watcher:
        return Watcher(self.cp.binary("kubectl"), str(self.kubeconfig), namespace, name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_proxy(cp: Any, workdir: Path, *, interval: float, timeout: float,
                endpoints: list[str] | None = None, drain: str = "30s",
                discovery: bool = True, readyz: bool = True, extra: list[str] | None = None,
                name: str = "ep", hosts: Path | None = None,
                root: Path | None = None) -> Proxy:
    """Start extractedprism on 127.0.0.1 (free ports) in front of the run ``cp``.

    Discovery goes through the proxy's own listener, verified as kubernetes.default.svc,
    with the RBAC the chart grants (get/list/watch EndpointSlices); the readyz probe
    verifies the serving certificates against the run's CA.

    ``hosts``: a hosts file the proxy resolves names with instead of the machine's
    /etc/hosts, bind-mounted over it in a private mount namespace of the proxy's own
    (the machine's file is never touched). The resolver reads it on every lookup, so a
    test that rewrites it in place (same inode) moves a name, as a DNS change would.
    ``root``: run the extractedprism of another checkout (a before/after comparison in
    one run); default this one.
    """
    from tests.util import PYTHON, ROOT, start_on_free_ports

    eps = endpoints if endpoints is not None else cp.endpoints
    log_path = workdir / f"{name}.log"
    kc_self = workdir / f"{name}-discovery.kubeconfig"
    kc_admin = workdir / f"{name}-admin.kubeconfig"
    holder: dict[str, Any] = {}

    def spawn(ports: list[int]) -> subprocess.Popen[bytes]:
        bind, health = ports
        cp.proxy_kubeconfig(bind, kc_self, who="extractedprism")
        cp.proxy_kubeconfig(bind, kc_admin, who="admin")
        args = ["--bind-address=127.0.0.1", f"--bind-port={bind}", f"--health-port={health}",
                f"--endpoints={','.join(eps)}", f"--health-interval={interval:g}s",
                f"--health-timeout={timeout:g}s", f"--drain-timeout={drain}",
                f"--enable-discovery={str(discovery).lower()}", "--log-level=info"]
        if discovery:
            args.append(f"--kubeconfig={kc_self}")
        if readyz:
            args += ["--health-check=readyz", f"--health-check-ca-file={cp.ca}"]
        args += extra or []
        holder["args"] = args
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        argv = [PYTHON, "-m", "extractedprism", *args]
        if hosts is not None:
            # unshare and sh exec: the pid is the proxy's own (SIGTERM reaches it).
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
        with open(log_path, "ab") as logf:  # the child keeps its own descriptor
            return subprocess.Popen(argv, stdout=logf,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=root or ROOT)

    def ready(ports: list[int]) -> bool:
        return http_status(f"http://127.0.0.1:{ports[1]}/healthz") == 200

    proc, (bind, health) = start_on_free_ports(spawn, ready, timeout=30)
    if proc.poll() is not None:
        raise AssertionError(f"extractedprism exited {proc.returncode}:\n"
                             f"{log_path.read_text(errors='replace')[-3000:]}")
    return Proxy(proc, bind, health, holder["args"], log_path, kc_admin, cp)


# --- connections counted from each apiserver's own side ----------------------------------


_PID = re.compile(r"pid=(\d+)")


def _ss(argv: list[str]) -> list[list[str]]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def apiserver_connections(cp: Any, owners: dict[int, str]) -> dict[str, dict[str, int]]:
    """Established connections each apiserver holds, counted by ``ss`` in its own network
    namespace (its side of the TCP connection), grouped by who opened them: the peer
    port is matched with the root namespace's sockets (``ss -p``), whose owning pid
    ``owners`` maps to a group name (e.g. a fleet of proxies); others count as "other".

    Returns {api: {group: count}}."""
    bridge = cp.ip("bridge")
    by_port: dict[int, str] = {}
    for row in _ss(["ss", "-Htnp", "state", "established", "( dport = :6443 )"]):
        local, users = row[2], " ".join(row[4:])
        if not local.startswith(bridge + ":"):
            continue
        pid = next((int(p) for p in _PID.findall(users)), None)
        if pid in owners:
            by_port[int(local.rsplit(":", 1)[1])] = owners[pid]
    out: dict[str, dict[str, int]] = {}
    for api in ("api1", "api2", "api3"):
        counts: dict[str, int] = {}
        if cp.running(api):
            ns = cp.state["netns"][api]
            for row in _ss(["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established",
                            "( sport = :6443 )"]):
                peer = row[3]
                if not peer.startswith(bridge + ":"):
                    continue
                group = by_port.get(int(peer.rsplit(":", 1)[1]), "other")
                counts[group] = counts.get(group, 0) + 1
        out[api] = counts
    return out



def skew(counts: list[int]) -> float:
    """max / mean over the apiservers (1.0: even; 0 connections: 1.0)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0
