"""Local chaos harness: kill, freeze, unready, remove and partition API servers on one machine.

Three API-server-like TLS upstreams (scripts/chaos_upstream.py, each its own process),
a fake kube-apiserver serving the ``kubernetes`` EndpointSlice (in this process), and
extractedprism in front with ``--health-check=readyz`` and discovery through that fake
API server. A bounded client load runs through the proxy the whole time, on loopback:

* watch clients: long-lived ``GET /watch`` streams (one chunk per tick, sequence-checked);
* stream clients: long-lived keep-alive connections doing ``POST /echo`` (bytes checked);
* short clients: one ``POST /echo`` per new TCP+TLS connection (bytes checked).

Upstreams (one port P for all, as one EndpointSlice port requires):
  a = 127.0.0.2:P (static + slice)   b = 127.0.0.3:P (static + slice)
  c = slice only: 10.x.y.2:P inside a network namespace this script creates (a veth
      pair with a /30 of its own), or 127.0.0.4:P when namespaces are not available.

Events, in order: kill -9 of a and its restart; SIGSTOP/SIGCONT of b; /readyz of a
switched to 500 and back; c removed from and re-added to the EndpointSlice; c's link
taken down inside its namespace (SYNs go unanswered) and back up. Each event prints a
report and PASS/FAIL lines for the criteria of issue 7 (see docs/chaos.md); the run
exits 0 only when every line passed.

--short runs the schedule once with the shortest holds that still cover every bound
(about a minute); --duration (default 10 minutes) repeats it with longer holds.
Only loopback and addresses inside this script's own namespace are ever contacted;
every loop is bounded in count and time; processes, the namespace, the veth pair and
the route this script adds are removed on exit, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import random
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import logfmtkv  # noqa: E402
import trustme  # noqa: E402

from tests.fakes.fake_apiserver import FakeApiServer, make_slice  # noqa: E402

SERVER_NAME = "kubernetes.default.svc"
# The proxy's timing flags; every bound below is computed from these.
INTERVAL = 2.0  # --health-interval
TIMEOUT = 1.0  # --health-timeout, also the proxy's dial timeout
DRAIN = 2.0  # --drain-timeout
# Allowance for scheduling on a loaded machine and for the 1 ms resolution of the
# proxy's log timestamps; added once to every time bound and printed with it.
SLACK = 0.5
CLIENT_TIMEOUT = 10.0  # per client operation, like client-go's TLS handshake timeout
WATCH_STALL = 60.0  # a watch that got nothing for this long is given up by its client
POLL = 0.2  # /upstreams sampling period
MAX_ATTEMPTS_PER_CLIENT = 100_000  # hard cap on any client loop, on top of the deadline


def mono() -> float:
    return time.monotonic()


class Stopped(Exception):
    """The harness is shutting the load down."""


# --------------------------------------------------------------------------------------
# Recording


@dataclass
class Attempt:
    """One new client connection through the proxy."""

    kind: str  # short | watch | stream
    client: str
    start: float
    connected: float | None = None  # TCP connect to the proxy done
    first_byte: float | None = None  # TLS handshake done: an upstream answered
    established: bool = False  # an upstream identified itself
    upstream: str | None = None
    ok: bool = False  # short: request verified; long-lived: established
    end: float | None = None
    error: str = ""  # why it failed before being established / verified
    end_reason: str = ""  # long-lived: how an established connection ended
    nbytes: int = 0


@dataclass
class Recorder:
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: list[Attempt] = field(default_factory=list)
    corrupt: list[tuple[float, str]] = field(default_factory=list)
    bytes_checked: int = 0

    def add(self, a: Attempt) -> None:
        with self.lock:
            self.attempts.append(a)

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_checked += n

    def corruption(self, what: str) -> None:
        with self.lock:
            self.corrupt.append((mono(), what))

    def snapshot(self) -> list[Attempt]:
        """Attempts recorded so far (open ones have ``end`` None), without those the
        harness itself cut short by stopping the load."""
        with self.lock:
            return [a for a in self.attempts if a.error != "stopped"]


# --------------------------------------------------------------------------------------
# Client load


class Reader:
    """Byte reader over a socket with a short poll timeout, so a stop is noticed."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self.stop = stop
        self.buf = bytearray()

    def _fill(self, deadline: float) -> None:
        while True:
            if self.stop.is_set():
                raise Stopped
            if mono() > deadline:
                raise TimeoutError("client deadline")
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise EOFError("connection closed")
            self.buf += data
            return

    def line(self, deadline: float) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return out
            if len(self.buf) > 65536:
                raise ValueError("line too long")
            self._fill(deadline)

    def exact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def head(self, deadline: float) -> tuple[int, dict[str, str]]:
        status = self.line(deadline).decode("latin-1").split()
        if len(status) < 2 or not status[0].startswith("HTTP/"):
            raise ValueError(f"bad status line {status!r}")
        headers: dict[str, str] = {}
        while True:
            h = self.line(deadline)
            if not h:
                return int(status[1]), headers
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, EOFError):
        return "closed"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ssl.SSLError):
        return f"tls: {exc.reason or exc}"
    return f"{type(exc).__name__}: {exc}"


class Load:
    """The client threads. Every loop ends at ``stop`` or ``deadline`` or the attempt cap."""

    def __init__(self, proxy_port: int, ca_file: Path, rec: Recorder, *, watches: int,
                 streams: int, shorts: int, deadline: float) -> None:
        self.addr = ("127.0.0.1", proxy_port)
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        self.rec = rec
        self.stop = threading.Event()
        self.deadline = deadline
        # Bumped by the harness to make every long-lived client reconnect (a fresh spread
        # over the upstreams before an event); such ends are "recycled", not failures.
        self.generation = 0
        self.threads: list[threading.Thread] = []
        for i in range(watches):
            self.threads.append(threading.Thread(target=self._watch_loop, args=(f"watch-{i}",),
                                                 name=f"load-watch-{i}", daemon=True))
        for i in range(streams):
            self.threads.append(threading.Thread(target=self._stream_loop,
                                                 args=(f"stream-{i}",),
                                                 name=f"load-stream-{i}", daemon=True))
        for i in range(shorts):
            self.threads.append(threading.Thread(target=self._short_loop, args=(f"short-{i}",),
                                                 name=f"load-short-{i}", daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT + 5)

    def running(self) -> bool:
        return not self.stop.is_set() and mono() < self.deadline

    def _open(self, a: Attempt) -> tuple[ssl.SSLSocket, Reader]:
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw.settimeout(CLIENT_TIMEOUT)
        try:
            raw.connect(self.addr)
            a.connected = mono()
            tls = self.ctx.wrap_socket(raw, server_hostname=SERVER_NAME)
        except BaseException:
            raw.close()
            raise
        a.first_byte = mono()
        tls.settimeout(0.25)
        return tls, Reader(tls, self.stop)

    def _pause(self, seconds: float) -> None:
        self.stop.wait(seconds)

    # -- short requests on new connections ------------------------------------------

    def _short_loop(self, cid: str) -> None:
        rng = random.Random(cid)
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("short", cid, mono())
            self.rec.add(a)
            payload = rng.randbytes(rng.randint(1, 16384))
            tls = None
            try:
                tls, rd = self._open(a)
                tls.sendall(b"POST /echo HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                            + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                            % len(payload) + payload)
                dl = mono() + CLIENT_TIMEOUT
                status, headers = rd.head(dl)
                a.upstream = headers.get("x-upstream")
                a.established = a.upstream is not None
                body = rd.exact(int(headers.get("content-length", "0")), dl)
                if status != 200:
                    a.error = f"HTTP {status}"
                elif body != payload:
                    a.error = "corrupted echo"
                    self.rec.corruption(f"{cid}: echo of {len(payload)} bytes differs "
                                        f"(upstream {a.upstream})")
                else:
                    a.ok = True
                    a.nbytes = len(payload)
                    self.rec.add_bytes(len(payload))
            except Stopped:
                a.error = "stopped"
            except (OSError, EOFError, ValueError) as exc:
                a.error = describe(exc)
            finally:
                a.end = mono()
                if tls is not None:
                    tls.close()
            self._pause(0.02)

    @contextlib.contextmanager
    def _long_lived(self, a: Attempt) -> Iterator[list[ssl.SSLSocket]]:
        """End-of-attempt bookkeeping shared by the watch and echo-stream clients: an
        error before the stream was established is a failed connection, after it a
        reason the stream ended; the sockets appended to the list are closed."""
        opened: list[ssl.SSLSocket] = []
        try:
            yield opened
        except Stopped:
            a.end_reason = a.end_reason or "stopped"
            if not a.established:
                a.error = "stopped"
        except (OSError, EOFError, ValueError) as exc:
            if a.established:
                a.end_reason = describe(exc)
            else:
                a.error = describe(exc)
        finally:
            a.end = mono()
            for tls in opened:
                tls.close()

    # -- long-lived: watch streams ----------------------------------------------------

    def _watch_loop(self, cid: str) -> None:
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("watch", cid, mono())
            self.rec.add(a)
            with self._long_lived(a) as opened:
                tls, rd = self._open(a)
                opened.append(tls)
                tls.sendall(b"GET /watch HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                            + b"\r\n\r\n")
                status, headers = rd.head(mono() + CLIENT_TIMEOUT)
                a.upstream = headers.get("x-upstream")
                if status != 200 or a.upstream is None:
                    raise ValueError(f"watch answered HTTP {status}")
                a.established = a.ok = True
                gen = self.generation
                expected = 0
                while self.running():
                    if gen != self.generation:
                        a.end_reason = "recycled"
                        break
                    dl = mono() + WATCH_STALL
                    size = int(rd.line(dl), 16)
                    chunk = rd.exact(size + 2, dl)
                    good = chunk.endswith(b"\r\n")
                    try:
                        ev = json.loads(chunk[:-2])
                        good = good and ev.get("n") == expected and ev.get("from") == a.upstream
                    except ValueError:
                        good = False
                    if not good:
                        self.rec.corruption(f"{cid}: watch chunk {expected} from {a.upstream} "
                                            f"is wrong: {chunk[:80]!r}")
                        a.end_reason = "corrupted"
                        break
                    expected += 1
                    a.nbytes += size
                    self.rec.add_bytes(size)
                else:
                    a.end_reason = a.end_reason or "stopped"
            self._pause(0.05)  # a client's reconnect delay

    # -- long-lived: keep-alive echo connections --------------------------------------

    def _stream_loop(self, cid: str) -> None:
        rng = random.Random(cid)
        for _ in range(MAX_ATTEMPTS_PER_CLIENT):
            if not self.running():
                return
            a = Attempt("stream", cid, mono())
            self.rec.add(a)
            with self._long_lived(a) as opened:
                tls, rd = self._open(a)
                opened.append(tls)
                gen = self.generation
                for _ in range(MAX_ATTEMPTS_PER_CLIENT):
                    if not self.running():
                        a.end_reason = "stopped"
                        break
                    if gen != self.generation:
                        a.end_reason = "recycled"
                        break
                    payload = rng.randbytes(rng.randint(1, 65536))
                    tls.sendall(b"POST /echo HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                                + b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
                    dl = mono() + CLIENT_TIMEOUT
                    status, headers = rd.head(dl)
                    up = headers.get("x-upstream")
                    body = rd.exact(int(headers.get("content-length", "0")), dl)
                    if status != 200 or up is None:
                        raise ValueError(f"echo answered HTTP {status}")
                    if not a.established:
                        a.upstream, a.established, a.ok = up, True, True
                    if up != a.upstream or body != payload:
                        self.rec.corruption(f"{cid}: echo of {len(payload)} bytes on "
                                            f"{a.upstream} came back wrong (from {up})")
                        a.end_reason = "corrupted"
                        break
                    a.nbytes += len(payload)
                    self.rec.add_bytes(len(payload))
                    self._pause(0.1)
            self._pause(0.05)


# --------------------------------------------------------------------------------------
# Processes


def _reader_thread(name: str, stream: Any, on_line: Callable[[str], None]) -> threading.Thread:
    t = threading.Thread(target=_read_lines, args=(stream, on_line), name=name, daemon=True)
    t.start()
    return t


def _read_lines(stream: Any, on_line: Callable[[str], None]) -> None:
    for raw in stream:  # ends at EOF, when the process exits
        on_line(raw.rstrip("\n"))


class UpstreamProc:
    """One scripts/chaos_upstream.py process."""

    def __init__(self, name: str, host: str, port: int, ca_cert: Path, ca_key: Path,
                 netns: str | None = None) -> None:
        self.name, self.host, self.port = name, host, port
        self.ca_cert, self.ca_key, self.netns = ca_cert, ca_key, netns
        self.proc: subprocess.Popen[str] | None = None
        self.readyz: list[tuple[float, int]] = []
        self._listening = threading.Event()
        self._lock = threading.Lock()
        self.stopped = False  # SIGSTOPped by us

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._listening.clear()
        cmd = [sys.executable, str(ROOT / "scripts" / "chaos_upstream.py"), "--host", self.host,
               "--port", str(self.port), "--name", self.name, "--ca-cert", str(self.ca_cert),
               "--ca-key", str(self.ca_key)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]  # ip execs python: same pid
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     stdin=subprocess.DEVNULL)
        _reader_thread(f"out-{self.name}", self.proc.stdout, self._on_line)

    def _on_line(self, line: str) -> None:
        parts = line.split()
        if parts[:1] == ["LISTENING"]:
            self._listening.set()
        elif parts[:1] == ["READYZ"] and len(parts) == 3:
            with self._lock:
                self.readyz.append((float(parts[1]), int(parts[2])))

    def wait_listening(self, timeout: float) -> bool:
        return self._listening.wait(timeout)

    def readyz_after(self, t: float, status: int) -> list[float]:
        with self._lock:
            return [at for at, st in self.readyz if at >= t and st == status]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill9(self) -> tuple[float, float]:
        """SIGKILL and reap: returns (time of the signal, time after which no socket of
        it is left)."""
        assert self.proc is not None
        t_sig = mono()
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return t_sig, mono()

    def terminate(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        if self.stopped:
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGCONT)
            self.stopped = False
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


_SKIP_KEYS = ("ts", "level", "logger", "msg", "thread", "stacktrace")


def _parse_log_line(line: str) -> tuple[float, str] | None:
    """A logfmt log line -> (wall time, "msg key=value ..."), the event as it reads in
    the source's template, which the patterns below search."""
    try:
        rec = logfmtkv.parse(line)
        wall = datetime.datetime.fromisoformat(str(rec["ts"])).timestamp()
    except (KeyError, ValueError, logfmtkv.LogfmtError):
        return None
    fields = " ".join(f"{k}={v}" for k, v in rec.items() if k not in _SKIP_KEYS)
    return wall, f"{rec.get('msg', '')} {fields}".strip()


class ProxyProc:
    """extractedprism as a subprocess; its log lines are kept with their own timestamps."""

    def __init__(self, cmd: list[str], log_path: Path, health_port: int) -> None:
        self.cmd = cmd
        self.health_port = health_port
        self.log_path = log_path
        self.events: list[tuple[float, str]] = []  # (monotonic time of the log line, msg)
        self._lock = threading.Lock()
        self._offset = time.time() - mono()  # wall - monotonic
        self._log = log_path.open("w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        self._reader = _reader_thread("proxy-log", self.proc.stderr, self._on_line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _on_line(self, line: str) -> None:
        self._log.write(line + "\n")
        parsed = _parse_log_line(line)
        if parsed is None:
            return
        wall, event = parsed
        with self._lock:
            self.events.append((wall - self._offset, event))

    def first_event(self, after: float, pattern: str) -> float | None:
        rx = re.compile(pattern)
        with self._lock:
            for at, msg in self.events:
                # log timestamps are truncated to the millisecond
                if at >= after - 0.001 and rx.search(msg):
                    return at
        return None

    def get(self, path: str, timeout: float = 2.0) -> bytes:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()

    def upstreams(self) -> dict[str, dict[str, Any]]:
        doc = json.loads(self.get("/upstreams"))
        return {u["address"]: u for u in doc["upstreams"]}

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.get("/metrics").decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def stats(self) -> dict[str, int]:
        """threads, fds (sockets, kernel pipes, other) and RSS from /proc/<pid>."""
        st: dict[str, int] = {"threads": 0, "rss_kib": 0, "fds": 0, "sockets": 0, "pipes": 0}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    st["threads"] = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    st["rss_kib"] = int(line.split()[1])
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                    st["fds"] += 1
                    st["sockets"] += target.startswith("socket:")
                    st["pipes"] += target.startswith("pipe:")
        except OSError:
            pass
        return st

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        self._log.close()


class Monitor(threading.Thread):
    """Samples /upstreams every POLL seconds (bounded by its stop event)."""

    def __init__(self, proxy: ProxyProc) -> None:
        super().__init__(name="monitor", daemon=True)
        self.proxy = proxy
        self.samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(POLL):
            with contextlib.suppress(OSError, ValueError):
                s = self.proxy.upstreams()
                with self.lock:
                    self.samples.append((mono(), s))

    def last_new_connection(self, addr: str, t0: float, t1: float) -> float | None:
        """Upper bound of the time of the last connection attached to ``addr`` in
        [t0, t1], from the total_connections counter; None if there was none."""
        with self.lock:
            samples = [(t, s.get(addr, {}).get("total_connections")) for t, s in self.samples]
        last = None
        prev = None
        for t, total in samples:
            if t < t0:
                prev = total
                continue
            if t > t1 + POLL:
                break
            if total is not None and prev is not None and total > prev:
                last = t
            if total is not None:
                prev = total
        return last


# --------------------------------------------------------------------------------------
# Network namespace for the partition


class Netns:
    """One namespace with a veth pair and a /30 of its own; removed by cleanup()."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.name = f"epchaos{tag}"
        self.host_if = f"epc{tag}h"
        self.ns_if = f"epc{tag}n"
        self.net: ipaddress.IPv4Network | None = None
        self.created = False
        self.veth = False
        self.route = False

    @staticmethod
    def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                              check=check)

    def _pick_net(self) -> ipaddress.IPv4Network:
        used = []
        out = self._ip("-4", "route", "show", "table", "all", check=False).stdout
        for line in out.splitlines():
            for tok in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in tok or tok[0].isdigit():
                        used.append(ipaddress.ip_network(tok, strict=False))
        addrs = self._ip("-4", "-o", "addr", check=False).stdout
        for m in re.finditer(r"inet (\S+)", addrs):
            used.append(ipaddress.ip_interface(m.group(1)).network)
        rng = random.Random()
        for _ in range(200):
            net = ipaddress.ip_network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}."
                                       f"{rng.randrange(0, 256, 4)}/30")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise RuntimeError("no free private /30 found")

    def setup(self) -> str:
        """Create everything; returns the upstream address inside. Raises on failure."""
        if shutil.which("ip") is None:
            raise RuntimeError("the ip command (iproute2) is not installed")
        self.net = net = self._pick_net()
        host_ip, ns_ip = (str(h) for h in net.hosts())
        self._ip("netns", "add", self.name)
        self.created = True
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self.veth = True
        self._ip("link", "set", self.ns_if, "netns", self.name)
        # If the connected route ever disappears, this keeps the /30 from leaking to the
        # default route: its traffic is refused locally instead.
        self._ip("route", "add", "unreachable", str(net), "metric", "65000")
        self.route = True
        self._ip("addr", "add", f"{host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("-n", self.name, "addr", "add", f"{ns_ip}/30", "dev", self.ns_if)
        self._ip("-n", self.name, "link", "set", self.ns_if, "up")
        self._ip("-n", self.name, "link", "set", "lo", "up")
        mac = self._ip("-n", self.name, "-br", "link", "show", self.ns_if).stdout.split()[2]
        # A permanent neighbour entry: with the peer link down, SYNs are dropped silently
        # instead of failing ARP (which would answer "no route to host" after ~1 s).
        self._ip("neigh", "replace", ns_ip, "lladdr", mac, "dev", self.host_if,
                 "nud", "permanent")
        return ns_ip

    def partition(self) -> None:
        self._ip("-n", self.name, "link", "set", self.ns_if, "down")

    def heal(self) -> None:
        self._ip("-n", self.name, "link", "set", self.ns_if, "up")

    def cleanup(self) -> None:
        if self.veth:
            self._ip("link", "del", self.host_if, check=False)
            self.veth = False
        if self.route and self.net is not None:
            self._ip("route", "del", "unreachable", str(self.net), "metric", "65000",
                     check=False)
            self.route = False
        if self.created:
            self._ip("netns", "del", self.name, check=False)
            self.created = False


# --------------------------------------------------------------------------------------
# Events and criteria


@dataclass
class Check:
    ok: bool
    text: str


@dataclass
class Outcome:
    name: str
    victim: str
    t0: float = 0.0
    t_recover: float = 0.0
    t_end: float = 0.0
    lines: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def check(self, ok: bool, text: str) -> None:
        self.checks.append(Check(ok, text))


def fmt(t: float | None) -> str:
    return "never" if t is None else f"+{t:.2f} s"


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.short = args.short
        self.tmp = Path(tempfile.mkdtemp(prefix="extractedprism-chaos-"))
        self.rec = Recorder()
        self.ups: dict[str, UpstreamProc] = {}
        self.api: FakeApiServer | None = None
        self.proxy: ProxyProc | None = None
        self.monitor: Monitor | None = None
        self.load: Load | None = None
        self.netns: Netns | None = None
        self.netns_skip = ""
        self.outcomes: list[Outcome] = []
        self.global_checks: list[Check] = []
        self.port = 0
        self.slice_addrs: list[str] = []

    # -- set-up ---------------------------------------------------------------------

    def setup(self) -> None:
        ca = trustme.CA()
        self.ca_cert = self.tmp / "ca.pem"
        self.ca_key = self.tmp / "ca.key"
        ca.cert_pem.write_to_path(str(self.ca_cert))
        ca.private_key_pem.write_to_path(str(self.ca_key))
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            self.port = s.getsockname()[1]
        c_host = "127.0.0.4"
        if self.args.no_netns:
            self.netns_skip = "--no-netns given"
        else:
            ns = Netns()
            self.netns = ns
            try:
                c_host = ns.setup()
            except (RuntimeError, OSError, subprocess.SubprocessError, IndexError) as exc:
                err = getattr(exc, "stderr", "") or str(exc)
                self.netns_skip = f"network namespaces not available here ({err.strip()})"
                ns.cleanup()
                self.netns = None
                c_host = "127.0.0.4"
        for name, host in (("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", c_host)):
            up = UpstreamProc(f"apiserver-{name}", host, self.port, self.ca_cert, self.ca_key,
                              netns=self.netns.name if (name == "c" and self.netns) else None)
            self.ups[name] = up
            up.start()
        for up in self.ups.values():
            if not up.wait_listening(30):
                raise RuntimeError(f"upstream {up.name} did not start")
        self.api = FakeApiServer().start()
        self.slice_addrs = [self.ups[n].host for n in ("a", "b", "c")]
        self.api.set_slice(make_slice("kubernetes", self.slice_addrs, port=self.port))
        kubeconfig = self.api.write_kubeconfig(self.tmp / "kubeconfig")
        with socket.socket() as s1, socket.socket() as s2:
            s1.bind(("127.0.0.1", 0))
            s2.bind(("127.0.0.1", 0))
            self.bind_port, self.health_port = s1.getsockname()[1], s2.getsockname()[1]
        static = ",".join(self.ups[n].address for n in ("a", "b"))
        cmd = [sys.executable, "-m", "extractedprism", "--endpoints", static,
               "--bind-port", str(self.bind_port), "--health-port", str(self.health_port),
               "--health-interval", f"{INTERVAL:g}s", "--health-timeout", f"{TIMEOUT:g}s",
               "--drain-timeout", f"{DRAIN:g}s", "--health-check", "readyz",
               "--health-check-ca-file", str(self.ca_cert), "--kubeconfig", str(kubeconfig),
               "--log-level", "info"]
        self.proxy = ProxyProc(cmd, self.tmp / "proxy.log", self.health_port)
        if not self.wait_all_ready(30):
            raise RuntimeError("the proxy never reported all three upstreams ready; "
                               f"log: {self.proxy.log_path}")
        self.monitor = Monitor(self.proxy)
        self.monitor.start()

    def all_ready(self) -> bool:
        assert self.proxy is not None
        try:
            ups = self.proxy.upstreams()
        except (OSError, ValueError):
            return False
        want = {u.address for u in self.ups.values()}
        return set(ups) == want and all(
            u["healthy"] and u["ready"] and not u["draining"] for u in ups.values())

    def wait_all_ready(self, timeout: float) -> float | None:
        """Seconds until every upstream is healthy, ready and not draining; None: never."""
        t0 = mono()
        while mono() - t0 < timeout:
            assert self.proxy is not None
            if self.proxy.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proxy.proc.returncode}; "
                                   f"log: {self.proxy.log_path}")
            if self.all_ready():
                return mono() - t0
            time.sleep(0.05)
        return None

    def stats_min(self, samples: int = 5) -> dict[str, int]:
        """Minimum of a few samples: probe and health-server threads come and go."""
        assert self.proxy is not None
        got = []
        for _ in range(samples):
            got.append(self.proxy.stats())
            time.sleep(0.1)
        return {k: min(s[k] for s in got) for k in got[0]}

    def wait_no_connections(self, timeout: float) -> bool:
        t0 = mono()
        while mono() - t0 < timeout:
            try:
                assert self.proxy is not None
                if all(u["active_connections"] == 0 for u in self.proxy.upstreams().values()):
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        return False

    def spread_long_lived(self, victim: str, tries: int = 5) -> int:
        """Make sure some long-lived connections sit on ``victim`` before its event: while
        none do, every long-lived client reconnects (random selection spreads them).
        Returns how many are on it."""
        assert self.load is not None
        on = 0
        for _ in range(tries):
            now = mono()
            live = [a for a in self.attempts() if a.kind != "short" and a.end is None
                    and a.established]
            on = sum(a.upstream == victim for a in live)
            if on:
                return on
            self.load.generation += 1
            clients = {t.name[len("load-"):] for t in self.load.threads
                       if not t.name.startswith("load-short-")}
            deadline = mono() + CLIENT_TIMEOUT
            while mono() < deadline:
                fresh = {a.client for a in self.attempts() if a.kind != "short"
                         and a.established and a.end is None and a.first_byte is not None
                         and a.first_byte > now}
                if fresh >= clients:
                    break
                time.sleep(0.05)
        return on

    def run_load(self, seconds: float) -> Load:
        load = Load(self.bind_port, self.ca_cert, self.rec, watches=5, streams=3, shorts=3,
                    deadline=mono() + seconds)
        load.start()
        return load

    # -- helpers for the event analysis -------------------------------------------

    def name_of(self, key: str) -> str:
        return self.ups[key].name

    def attempts(self) -> list[Attempt]:
        return self.rec.snapshot()

    def moved_after(self, victim: str, at: float, until: float) -> tuple[float | None, int, int]:
        """Long-lived connections established on ``victim`` and open at ``at``: the time
        (since ``at``) until each client had a new connection established elsewhere.
        Returns (time until all moved or None, how many there were, how many not moved)."""
        atts = self.attempts()
        clients = {a.client for a in atts if a.kind != "short" and a.established
                   and a.upstream == victim and a.first_byte is not None
                   and a.first_byte <= at and (a.end is None or a.end > at)}
        worst = 0.0
        not_moved = 0
        for cid in clients:
            later = sorted((a for a in atts if a.client == cid and a.established
                            and a.upstream != victim and a.first_byte is not None
                            and a.first_byte > at), key=lambda a: a.first_byte or 0)
            if later and (later[0].first_byte or 0) <= until:
                worst = max(worst, (later[0].first_byte or 0) - at)
            else:
                not_moved += 1
        if not clients:
            return 0.0, 0, 0
        return (None if not_moved else worst), len(clients), not_moved


def picked_after(window: list[Attempt], victim: str, at: float, until: float
                 ) -> list[Attempt]:
    """New connections that ``victim`` served although they began after ``at``.

    Judged by when the client began to connect: such a connection was certainly picked
    after ``at``, whereas a client thread may note its completed connect late, after a
    pick made before ``at``."""
    return [a for a in window if a.upstream == victim and a.connected is not None
            and at < a.start < until]


def last_close_after(h: Harness, victim: str, at: float) -> float:
    """Seconds after ``at`` until the last long-lived connection open on ``victim`` at
    ``at`` ended (0 when there were none)."""
    ends = [a.end - at for a in h.attempts() if a.kind != "short" and a.established
            and a.upstream == victim and a.first_byte is not None and a.first_byte <= at
            and a.end is not None and a.end > at]
    return max(ends, default=0.0)


def run_event(h: Harness, name: str, victim_key: str, inject: Callable[[], float],
              recover: Callable[[], None], hold_until: Callable[[Outcome], bool],
              max_hold: float, min_hold: float,
              analyse: Callable[[Harness, Outcome, list[Attempt], float], None]) -> Outcome:
    assert h.proxy is not None and h.monitor is not None
    victim = h.ups[victim_key]
    out = Outcome(name, victim.name)
    ready_in = h.wait_all_ready(30)
    if ready_in is None:
        out.check(False, f"{name}: precondition: all upstreams ready before the event")
        return out
    on_victim = h.spread_long_lived(victim.name)
    before = h.proxy.stats()
    m_before = h.proxy.metrics()
    b_before = h.rec.bytes_checked
    c_before = len(h.rec.corrupt)
    base_start = mono()
    time.sleep(1.0)  # baseline: how long a handshake takes here, right now
    base = [a.first_byte - a.connected for a in h.attempts()
            if a.kind == "short" and a.ok and a.start >= base_start - 2.0
            and a.first_byte is not None and a.connected is not None]
    base_wait = max(base) if base else 0.0
    out.t0 = t0 = inject()
    t_min = t0 + min_hold
    while mono() < t0 + max_hold:
        if mono() >= t_min and hold_until(out):
            break
        time.sleep(0.05)
    recover()
    out.t_recover = mono()
    back = h.wait_all_ready(30)
    out.t_end = mono()
    time.sleep(0.3)  # let the clients record what just ended
    atts = [a for a in h.attempts() if a.end is not None]
    window = [a for a in atts if t0 <= a.start < out.t_end]
    new_failed = [a for a in window if not a.ok]
    cut = [a for a in atts if a.kind != "short" and a.established and a.end is not None
           and t0 <= a.end < out.t_end and a.end_reason not in ("stopped", "recycled", "")]
    inflight_cut = [a for a in atts if a.kind == "short" and not a.ok and a.start < t0
                    and a.end is not None and a.end >= t0]
    # From the start of the first failing connection (or the first cut) to the last
    # failure: the time during which some client was hanging or erroring.
    begins = [a.start for a in new_failed] + [a.end for a in cut + inflight_cut
                                             if a.end is not None]
    ends = [a.end for a in new_failed + cut + inflight_cut if a.end is not None]
    err_span = (max(ends) - min(begins)) if ends and begins else 0.0
    last_new = h.monitor.last_new_connection(victim.address, t0, out.t_recover)
    client_last = max((a.connected for a in window if a.upstream == victim.name
                       and a.connected is not None and a.connected < out.t_recover),
                      default=None)
    moved, n_long, not_moved = h.moved_after(victim.name, t0, out.t_recover)
    after = h.proxy.stats()
    m_after = h.proxy.metrics()
    err_key = f'extractedprism_connection_errors_total{{upstream="{victim.address}"}}'
    kinds: dict[str, int] = {}
    for a in new_failed:
        kinds[a.error] = kinds.get(a.error, 0) + 1
    out.lines += [
        f"long-lived connections on it when the fault began: {on_victim}",
        f"client-visible failures: {len(new_failed)} of {len(window)} new connections failed"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})" if kinds else "")
        + f"; {len(inflight_cut)} in-flight short requests cut; {len(cut)} long-lived "
        f"connections cut (their clients reconnect)",
        f"clients saw errors for: {err_span:.2f} s (first failing connection to last "
        "failure)",
        "no new connection to it after: "
        + ("none after the event" if last_new is None else f"<= {fmt(last_new - t0)} "
           f"(proxy /upstreams); last one a client saw: "
           f"{'none' if client_last is None else fmt(client_last - t0)}"),
        "its existing connections moved after: "
        + (f"{fmt(moved)} ({n_long} long-lived)" if moved is not None else
           f"NOT moved by recovery ({not_moved} of {n_long} still on it at "
           f"{fmt(out.t_recover - t0)})"),
        f"bytes checked: {h.rec.bytes_checked - b_before} "
        f"({len(h.rec.corrupt) - c_before} corrupted)",
        f"proxy threads {before['threads']} -> {after['threads']}, fds {before['fds']} -> "
        f"{after['fds']}, RSS {before['rss_kib'] / 1024:.1f} -> "
        f"{after['rss_kib'] / 1024:.1f} MiB",
        f"metrics: connection_errors_total{{{victim.address}}} "
        f"+{m_after.get(err_key, 0) - m_before.get(err_key, 0):g}, connections_total "
        f"+{m_after.get(TOTAL, 0) - m_before.get(TOTAL, 0):g}",
        f"recovery: fault held {out.t_recover - t0:.2f} s; all upstreams ready again "
        + (f"{back:.2f} s after recovery" if back is not None else "NEVER (30 s)"),
    ]
    analyse(h, out, window, base_wait)
    if back is None:
        out.check(False, f"{name}: all upstreams healthy and ready again within 30 s "
                  "of recovery")
    return out


# -- the five events ---------------------------------------------------------------

TOTAL = "extractedprism_connections_total"
EXCLUDE_BOUND = 2 * INTERVAL + TIMEOUT  # two failed checks, the second one timing out
UNREADY_CLOSE = DRAIN + INTERVAL  # connections of an unready upstream closed by then


def ev_kill(h: Harness, hold: float) -> Outcome:
    up = h.ups["a"]

    reaped = [0.0]

    def inject() -> float:
        t_sig, reaped[0] = up.kill9()
        return t_sig

    def recover() -> None:
        up.start()
        up.wait_listening(30)

    def held(out: Outcome) -> bool:
        assert h.proxy is not None
        return h.proxy.first_event(out.t0, rf"healthy->unhealthy upstream={re.escape(up.address)}"
                                   ) is not None

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        # New connections: begun once the process was reaped (its sockets gone); the
        # few begun while the kernel was still tearing it down count as in-flight.
        dead = [a for a in window if reaped[0] <= a.start < out.t_recover]
        failed = [a for a in dead if not a.ok]
        out.check(not failed, f"kill-9: zero failed new connections while it was dead "
                  f"({len(failed)} of {len(dead)} failed)")
        out.lines.append(f"process reaped {reaped[0] - out.t0:.3f} s after SIGKILL")
        assert h.proxy is not None
        t = h.proxy.first_event(out.t0, rf"healthy->unhealthy upstream={re.escape(up.address)}")
        out.lines.append(f"excluded (proxy log healthy->unhealthy): "
                         f"{fmt(None if t is None else t - out.t0)}")

    return run_event(h, f"kill -9 {up.name} ({up.address}), then restart", "a", inject,
                     recover, held, max_hold=EXCLUDE_BOUND + SLACK + hold,
                     min_hold=EXCLUDE_BOUND + hold, analyse=analyse)


def _excluded_at(h: Harness, addr: str, t0: float) -> float | None:
    assert h.proxy is not None
    a = re.escape(addr)
    times = [t for t in (h.proxy.first_event(t0, rf"->unready upstream={a}"),
                         h.proxy.first_event(t0, rf"healthy->unhealthy upstream={a}"))
             if t is not None]
    return min(times) if times else None


def _wait_checks(out: Outcome, window: list[Attempt], base: float, tag: str) -> None:
    served = [a for a in window if a.ok and a.first_byte is not None
              and a.connected is not None and a.start < out.t_recover]
    worst = max((a.first_byte - a.connected for a in served  # type: ignore[operator]
                 ), default=0.0)
    limit = TIMEOUT + base + SLACK
    out.check(worst <= limit, f"{tag}: new connections waited at most one dial timeout "
              f"(longest wait {worst:.2f} s <= {TIMEOUT:g} s dial timeout + {base:.2f} s "
              f"baseline handshake + {SLACK:g} s slack)")


def ev_freeze(h: Harness, hold: float) -> Outcome:
    up = h.ups["b"]

    def inject() -> float:
        up.signal(signal.SIGSTOP)
        return mono()

    def recover() -> None:
        up.signal(signal.SIGCONT)

    def held(out: Outcome) -> bool:
        t = _excluded_at(h, up.address, out.t0)
        return t is not None and h.moved_after(up.name, out.t0, mono())[2] == 0 and \
            all(a.end is not None for a in h.attempts() if a.start >= out.t0 and not a.ok)

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        t = _excluded_at(h, up.address, out.t0)
        out.lines.append(f"excluded (proxy log): {fmt(None if t is None else t - out.t0)}")
        out.check(t is not None and t - out.t0 <= EXCLUDE_BOUND + SLACK,
                  f"freeze: excluded within two intervals plus one timeout "
                  f"({fmt(None if t is None else t - out.t0)} <= {EXCLUDE_BOUND:g} s "
                  f"+ {SLACK:g} s slack)")
        _wait_checks(out, window, base, "freeze")
        stuck = [a for a in window if not a.ok and a.start < out.t_recover]
        released = max((a.end - out.t0 for a in stuck if a.end is not None), default=0.0)
        out.lines.append(f"new connections that reached it before the exclusion (the kernel "
                         f"still accepts for a frozen process): {len(stuck)}, released by "
                         f"{fmt(released)}")
        bound = EXCLUDE_BOUND + UNREADY_CLOSE + SLACK
        out.check(released <= bound, f"freeze: connections stuck on it were closed within "
                  f"exclusion + drain-timeout + one interval ({fmt(released)} <= "
                  f"{bound:g} s)")

    return run_event(h, f"SIGSTOP {up.name} ({up.address}), then SIGCONT", "b", inject,
                     recover, held,
                     max_hold=EXCLUDE_BOUND + UNREADY_CLOSE + SLACK + hold, min_hold=hold,
                     analyse=analyse)


def ev_readyz(h: Harness, hold: float) -> Outcome:
    up = h.ups["a"]

    def inject() -> float:
        up.signal(signal.SIGUSR1)
        return mono()

    def recover() -> None:
        up.signal(signal.SIGUSR2)

    def held(out: Outcome) -> bool:
        assert h.proxy is not None
        t = h.proxy.first_event(out.t0, rf"->unready upstream={re.escape(up.address)}")
        return t is not None and h.moved_after(up.name, t, mono())[2] == 0

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        assert h.proxy is not None
        probes = up.readyz_after(out.t0, 500)
        t2 = probes[1] if len(probes) >= 2 else None
        tu = h.proxy.first_event(out.t0, rf"->unready upstream={re.escape(up.address)}")
        out.lines.append(f"second failed /readyz answered "
                         f"{fmt(None if t2 is None else t2 - out.t0)}; proxy marked it "
                         f"unready {fmt(None if tu is None else tu - out.t0)}")
        if tu is None:
            out.check(False, "readyz-500: the proxy marked it unready (after its second "
                      "failed probe)")
            return
        late = picked_after(window, up.name, tu, out.t_recover)
        out.check(not late, f"readyz-500: no new connection went to it after its second "
                  f"failed probe ({len(late)} did)")
        _moved, n, not_moved = h.moved_after(up.name, tu, out.t_recover)
        closed = last_close_after(h, up.name, tu)
        bound = UNREADY_CLOSE + SLACK
        ok = not_moved == 0 and closed <= bound
        out.check(ok, f"readyz-500: its {n} long-lived connections were closed within "
                  f"drain-timeout plus one interval (last closed {fmt(closed)} after unready"
                  f"{'' if not not_moved else f', {not_moved} never'}; bound "
                  f"{DRAIN:g}+{INTERVAL:g}+{SLACK:g} s)")

    return run_event(h, f"/readyz of {up.name} ({up.address}) -> 500, then 200", "a", inject,
                     recover, held, max_hold=EXCLUDE_BOUND + UNREADY_CLOSE + SLACK + hold,
                     min_hold=hold, analyse=analyse)


def ev_slice(h: Harness, hold: float) -> Outcome:
    up = h.ups["c"]
    assert h.api is not None
    others = [a for a in h.slice_addrs if a != up.host]

    def inject() -> float:
        assert h.api is not None
        h.api.set_slice(make_slice("kubernetes", others, port=h.port))
        return mono()

    def recover() -> None:
        assert h.api is not None
        h.api.set_slice(make_slice("kubernetes", h.slice_addrs, port=h.port))

    def removed_at(t0: float) -> float | None:
        assert h.proxy is not None
        a = re.escape(up.address)
        ts = [t for t in (h.proxy.first_event(t0, rf"upstream draining upstream={a}"),
                          h.proxy.first_event(t0, rf"upstream removed upstream={a}"))
              if t is not None]
        return min(ts) if ts else None

    def held(out: Outcome) -> bool:
        t = removed_at(out.t0)
        return t is not None and h.moved_after(up.name, t, mono())[2] == 0

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        t = removed_at(out.t0)
        out.lines.append(f"proxy started draining it: {fmt(None if t is None else t - out.t0)}"
                         " after the EndpointSlice update")
        if t is None:
            out.check(False, "slice-removal: the proxy drained the removed endpoint")
            return
        late = picked_after(window, up.name, t, out.t_recover)
        out.check(not late, f"slice-removal: no new connection went to it once it drained "
                  f"({len(late)} did)")
        _moved, n, not_moved = h.moved_after(up.name, t, out.t_recover)
        closed = last_close_after(h, up.name, t)
        bound = DRAIN + INTERVAL + SLACK
        out.check(not_moved == 0 and closed <= bound,
                  f"slice-removal: its {n} long-lived connections were closed within "
                  f"drain-timeout (+ one interval) (last {fmt(closed)}; bound {bound:g} s)")

    return run_event(h, f"{up.name} ({up.address}) removed from the EndpointSlice, then "
                     "re-added", "c", inject, recover, held,
                     max_hold=DRAIN + INTERVAL + SLACK + hold, min_hold=hold, analyse=analyse)


def ev_partition(h: Harness, hold: float) -> Outcome:
    up = h.ups["c"]
    ns = h.netns
    assert ns is not None

    def inject() -> float:
        ns.partition()
        return mono()

    def recover() -> None:
        ns.heal()

    def held(out: Outcome) -> bool:
        return _excluded_at(h, up.address, out.t0) is not None

    def analyse(h: Harness, out: Outcome, window: list[Attempt], base: float) -> None:
        t = _excluded_at(h, up.address, out.t0)
        out.lines.append(f"excluded (proxy log): {fmt(None if t is None else t - out.t0)}")
        out.check(t is not None and t - out.t0 <= EXCLUDE_BOUND + SLACK,
                  f"partition: excluded within two intervals plus one timeout "
                  f"({fmt(None if t is None else t - out.t0)} <= {EXCLUDE_BOUND:g} s "
                  f"+ {SLACK:g} s slack)")
        failed = [a for a in window if not a.ok and a.start < out.t_recover]
        out.check(not failed, f"partition: zero failed new connections (dial timeout, then "
                  f"retry; {len(failed)} failed)")
        _m, _n, not_moved = h.moved_after(up.name, out.t0, out.t_recover)
        if not_moved:
            out.lines.append(f"note: the proxy kept its {not_moved} long-lived connections "
                             "to the partitioned upstream (TCP-unhealthy but still marked "
                             "ready, so no readiness close); they resumed after the heal")
        _wait_checks(out, window, base, "partition")

    return run_event(h, f"network partition of {up.name} ({up.address}, link down in "
                     f"namespace {ns.name})", "c", inject, recover, held,
                     max_hold=EXCLUDE_BOUND + SLACK + hold, min_hold=EXCLUDE_BOUND + hold,
                     analyse=analyse)


# --------------------------------------------------------------------------------------
# Main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true",
                    help="one pass of the schedule, about a minute (CI)")
    ap.add_argument("--duration", type=float, default=600.0,
                    help="seconds to keep repeating the schedule (default 600)")
    ap.add_argument("--no-netns", action="store_true",
                    help="skip the network-partition event (no namespace is created)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir with the proxy log")
    ap.add_argument("--control-plane", choices=("standin", "real"), default="standin",
                    help="standin: the upstreams above (default); real: etcd and three "
                    "kube-apiservers of scripts/controlplane, with its own schedule "
                    "(scripts/chaos_real.py; needs root, ip netns and the built binaries)")
    args = ap.parse_args()
    if args.duration <= 0 or args.duration > 24 * 3600:
        ap.error("--duration must be in (0, 86400] seconds")
    if args.control_plane == "real":
        sys.path.insert(0, str(ROOT / "scripts"))
        import chaos_real

        return chaos_real.main(args)

    def on_term(_s: int, _f: object) -> None:
        raise KeyboardInterrupt

    # Explicit for SIGINT too: a shell that starts us in the background ignores SIGINT,
    # and Python then installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    h = Harness(args)
    rc = 1
    try:
        rc = run(h)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", flush=True)
        rc = 130
    finally:
        cleanup(h, keep=args.keep or rc != 0)
    return rc


def run(h: Harness) -> int:
    args = h.args
    hold = 0.0 if args.short else 10.0
    budget = 60.0 if args.short else args.duration
    print(f"extractedprism local chaos ({'short' if args.short else f'{budget:g} s'}): "
          f"--health-interval {INTERVAL:g}s --health-timeout {TIMEOUT:g}s "
          f"--drain-timeout {DRAIN:g}s --health-check readyz", flush=True)
    h.setup()
    assert h.proxy is not None
    print(f"upstreams: {', '.join(f'{u.name}={u.address}' for u in h.ups.values())}; "
          f"proxy 127.0.0.1:{h.bind_port} (pid {h.proxy.pid}), health :{h.health_port}",
          flush=True)
    if h.netns_skip:
        print(f"SKIP partition: {h.netns_skip}; apiserver-c runs on loopback instead",
              flush=True)
    else:
        assert h.netns is not None
        print(f"partition: apiserver-c in namespace {h.netns.name} ({h.netns.net}), "
              f"veth {h.netns.host_if}", flush=True)
    # Warm-up: the same load for a moment, so the pipe pool and its kernel pipes exist
    # before the starting level is taken.
    warm = h.run_load(3.0)
    for t in warm.threads:
        t.join(3.0 + CLIENT_TIMEOUT + 5)
    warm.finish()
    h.wait_no_connections(10)
    start = h.stats_min()
    print(f"proxy at rest: threads {start['threads']}, fds {start['fds']} (sockets "
          f"{start['sockets']}, pipes {start['pipes']}), RSS {start['rss_kib'] / 1024:.1f} MiB",
          flush=True)
    t_begin = mono()
    # The load outlives the schedule by at most one event's length; finish() stops it.
    h.load = h.run_load(budget + 120.0)
    schedule: list[tuple[str, Callable[[Harness, float], Outcome]]] = [
        ("kill", ev_kill), ("freeze", ev_freeze), ("readyz", ev_readyz),
        ("slice", ev_slice)]
    if h.netns is not None:
        schedule.append(("partition", ev_partition))
    n = 0
    for _cycle in range(1000):
        for _key, fn in schedule:
            n += 1
            out = fn(h, hold)
            h.outcomes.append(out)
            print_outcome(n, out)
            if args.short:
                continue
            if mono() - t_begin >= budget:
                break
        if args.short or mono() - t_begin >= budget:
            break
    h.load.finish()
    drained = h.wait_no_connections(15)
    end = h.stats_min()
    ok_threads = end["threads"] <= start["threads"]
    sock_start, sock_end = start["sockets"], end["sockets"]
    other_start = start["fds"] - start["sockets"] - start["pipes"]
    other_end = end["fds"] - end["sockets"] - end["pipes"]
    print(f"\nproxy at rest after the load: threads {end['threads']}, fds {end['fds']} "
          f"(sockets {end['sockets']}, pipes {end['pipes']}), RSS "
          f"{end['rss_kib'] / 1024:.1f} MiB; connections drained: {drained}", flush=True)
    h.global_checks.append(Check(ok_threads, f"resources: proxy threads back to the starting "
                                 f"level ({start['threads']} -> {end['threads']})"))
    h.global_checks.append(Check(sock_end <= sock_start and other_end <= other_start,
                                 f"resources: proxy fds back to the starting level (sockets "
                                 f"{sock_start} -> {sock_end}, other {other_start} -> "
                                 f"{other_end}; kernel pipes {start['pipes']} -> "
                                 f"{end['pipes']} are the pool threads' splice pipes)"))
    total_bytes = h.rec.bytes_checked
    h.global_checks.append(Check(not h.rec.corrupt and total_bytes > 0,
                                 f"integrity: every byte sent was received intact "
                                 f"({total_bytes} bytes checked, {len(h.rec.corrupt)} "
                                 f"corruptions)"))
    for when, what in h.rec.corrupt[:10]:
        print(f"  corruption at +{when - t_begin:.2f} s: {what}")
    atts = h.attempts()
    print(f"load: {len(atts)} connections ({sum(a.kind == 'short' for a in atts)} short), "
          f"{sum(not a.ok for a in atts)} failed, {total_bytes} bytes checked, "
          f"{mono() - t_begin:.1f} s", flush=True)
    return summary(h)


def print_outcome(n: int, out: Outcome) -> None:
    print(f"\n== event {n}: {out.name}", flush=True)
    for line in out.lines:
        print(f"  {line}")
    for c in out.checks:
        print(f"  {'PASS' if c.ok else 'FAIL'} {c.text}")
    sys.stdout.flush()


def summary(h: Harness) -> int:
    checks = [c for o in h.outcomes for c in o.checks] + h.global_checks
    print("\n== summary")
    if h.netns_skip:
        print(f"SKIP partition: {h.netns_skip}")
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'} {c.text}")
    failed = sum(not c.ok for c in checks)
    print(f"RESULT: {'PASS' if not failed else 'FAIL'} ({len(checks) - failed} passed, "
          f"{failed} failed)", flush=True)
    return 0 if checks and not failed else 1


def cleanup(h: Harness, keep: bool) -> None:
    # A second Ctrl-C must not cut the clean-up short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Each step on its own: a failure in one must not leave the others behind.
    if h.load is not None:
        with contextlib.suppress(Exception):
            h.load.stop.set()
    if h.monitor is not None:
        h.monitor.halt.set()
    if h.netns is not None:
        with contextlib.suppress(Exception):
            h.netns.heal()
    for up in h.ups.values():
        with contextlib.suppress(Exception):
            up.terminate()
    if h.proxy is not None:
        with contextlib.suppress(Exception):
            h.proxy.stop()
    if h.api is not None:
        with contextlib.suppress(Exception):
            h.api.stop()
    if h.netns is not None:
        with contextlib.suppress(Exception):
            h.netns.cleanup()
    if h.load is not None:
        with contextlib.suppress(Exception):
            h.load.finish()
    if keep:
        print(f"logs kept in {h.tmp}", flush=True)
    else:
        shutil.rmtree(h.tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
