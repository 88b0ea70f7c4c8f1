"""No descriptor limit anywhere (issue 29): the proxy, a real process, relaying enough
live connections to hold more than 1,100 descriptors, keeps every other part working:
discovery (against the fake API server), readyz probes, the health port, the admin
socket, the state file, and a handover of its listeners to a successor.

select() refuses any descriptor >= 1024 (FD_SETSIZE); every part that opens a socket or
file while the relayed connections hold the low ones gets a descriptor above that.
The relayed connections are real: each is a client socket through the proxy to a
loopback echo upstream, checked with a byte round trip before and after.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from extractedprism.ops import admin
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.process.lifecycle import Proc
from tests.util import http, start_on_free_ports, wait_until

pytestmark = pytest.mark.timeout(240)

CLIENTS = 560  # two sockets each in the proxy: > 1,100 descriptors, plus pipes
WANT_FDS = 1100
DEAD = "127.0.0.9"  # an address discovery adds while the proxy is busy (nothing listens)
DISCOVERY_ERRORS = 'extractedprism_discovery_errors_total{provider="kubernetes"}'


class HybridUpstream:
    """One upstream on loopback for both kinds of traffic: a connection that starts with
    a TLS record (the proxy's readyz probe) gets ``GET /readyz`` answered 200 on a thread
    of its own; any other is a byte echo, all of them served by one selector thread
    (hundreds of relayed connections without hundreds of threads in the test)."""

    def __init__(self, ca: trustme.CA) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(self.ctx)
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.readyz = 0
        self.echoes: set[socket.socket] = set()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, "accept")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._loop, name="test-hybrid-upstream")
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.1):
                if key.data == "accept":
                    try:
                        conn, _ = self.sock.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(True)
                    self._sel.register(conn, selectors.EVENT_READ, "new")
                    continue
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                if key.data == "new":
                    try:
                        first = conn.recv(1, socket.MSG_PEEK)
                    except OSError:
                        first = b""
                    if first == b"\x16":  # a TLS handshake record: a readyz probe
                        self._sel.unregister(conn)
                        t = threading.Thread(target=self._readyz, args=(conn,),
                                             name="test-hybrid-readyz", daemon=True)
                        self._threads = [x for x in self._threads if x.is_alive()]
                        self._threads.append(t)
                        t.start()
                        continue
                    self._sel.modify(conn, selectors.EVENT_READ, "echo")
                    self.echoes.add(conn)
                try:
                    data = conn.recv(4096)
                    if data:
                        conn.sendall(data)  # a few bytes: never blocks
                        continue
                except OSError:
                    pass
                self._sel.unregister(conn)
                self.echoes.discard(conn)
                conn.close()

    def _readyz(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = tls.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                if head.startswith(b"GET /readyz "):
                    self.readyz += 1
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                            b"Connection: close\r\n\r\nok")
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in list(self.echoes):
            conn.close()
        self.sock.close()
        self._sel.close()
        for t in self._threads:
            t.join(5)


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def fds(pid: int) -> list[int]:
    return [int(n) for n in os.listdir(f"/proc/{pid}/fd")]


def upstreams(health: int) -> dict[str, dict]:
    try:
        doc = json.loads(http(("127.0.0.1", health), "/upstreams", timeout=5)[2])
    except (OSError, ValueError):
        return {}
    return {u["address"]: u for u in doc["upstreams"]}


def metric(health: int, line_start: str) -> float | None:
    body = http(("127.0.0.1", health), "/metrics", timeout=5)[2].decode()
    for line in body.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def connect(bind: int) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", bind), timeout=10)
    c.settimeout(10)
    return c


def holes(pid: int) -> set[int]:
    present = set(fds(pid))
    return {n for n in range(1024) if n not in present}


def fill_holes(pid: int, bind: int, conns: list[socket.socket]) -> bool:
    """Open relayed connections until every descriptor number below 1024 is taken, so
    the next socket any part of the proxy opens is above (at most 50 more). A number
    a relayed connection does not take is held by a thread blocked in accept() (the
    kernel reserves the new descriptor's number before it waits), which no other
    socket can take either."""
    for _ in range(50):
        before = holes(pid)
        if not before:
            return True
        c = connect(bind)
        conns.append(c)
        assert round_trip([c], b"fill\n") == 1  # accepted and relayed
        if holes(pid) == before:
            return True
    return False


def socket_fds(pid: int, remote_port: int) -> list[int]:
    """The proxy's descriptors of TCP sockets connected to ``remote_port`` on loopback."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == remote_port and fields[3] == "01":
                    inodes.add(fields[9])
    found = []
    for n in fds(pid):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            found.append(n)
    return found


def round_trip(conns: list[socket.socket], tag: bytes) -> int:
    """Send ``tag`` on every connection, read it back: how many came back whole."""
    for c in conns:
        c.sendall(tag)
    ok = 0
    for c in conns:
        got = b""
        while len(got) < len(tag):
            chunk = c.recv(len(tag) - len(got))
            if not chunk:
                break
            got += chunk
        ok += got == tag
    return ok


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def hybrid(ca: trustme.CA) -> Iterator[HybridUpstream]:
    up = HybridUpstream(ca)
    yield up
    up.stop()


@pytest.mark.fd_leak_ok("the fake API server's watch connections close with its threads")
def test_every_part_works_with_more_than_1100_descriptors_in_relayed_connections(
        ca: trustme.CA, hybrid: HybridUpstream, tmp_path: Path) -> None:
    raise_fd_limit(4 * CLIENTS + 1024)  # this process holds both ends of each client
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    admin_sock = str(tmp_path / "admin.sock")
    handover_sock = str(tmp_path / "handover.sock")
    state = tmp_path / "state.json"
    conns: list[socket.socket] = []
    procs: list[Proc] = []
    with FakeApiServer() as api:
        # Discovery straight to the fake API server (not through the proxy, whose one
        # upstream is the echo): the slice names the echo upstream itself.
        api.set_slice(make_slice("kubernetes", ["127.0.0.1"], port=hybrid.port))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        common = ["--endpoints", hybrid.address, "--health-check", "readyz",
                  "--health-check-ca-file", str(ca_file),
                  "--health-check-server-name", "localhost",
                  "--health-interval", "2s", "--health-timeout", "1s",
                  "--enable-discovery=true", "--kubeconfig", str(kubeconfig),
                  "--admin-socket", admin_sock, "--handover-socket", handover_sock,
                  "--state-file", str(state), "--drain-timeout", "1s",
                  "--shutdown-drain-timeout", "0s"]

        def start(ports: list[int]) -> Any:
            procs.append(Proc(["--bind-port", str(ports[0]), "--health-port",
                               str(ports[1]), *common]))
            return procs[-1].popen

        def healthy(ports: list[int]) -> bool:
            return hybrid.address in upstreams(ports[1])

        try:
            popen, (bind, health) = start_on_free_ports(start, healthy)
            first = procs[-1]
            assert popen.poll() is None, first.log
            wait_until(lambda: upstreams(health).get(hybrid.address, {}).get("ready"), 20,
                       message="the upstream ready (readyz probes pass)")
            # The busy node: CLIENTS live relayed connections.
            deadline = time.monotonic() + 90
            while len(conns) < CLIENTS and time.monotonic() < deadline:
                conns.append(connect(bind))
            assert len(conns) == CLIENTS
            pid = first.popen.pid
            fill_holes(pid, bind, conns)
            assert round_trip(conns, b"before\n") == len(conns)
            open_fds = fds(pid)
            assert len(open_fds) > WANT_FDS and max(open_fds) >= 1024, len(open_fds)

            # Discovery: its connection was opened at start, low. Dropped, its number
            # goes to a relayed connection, so the watch after it, the re-list after a
            # 410 and the watch on that list's kept-alive connection are all >= 1024.
            errors_before = metric(health, DISCOVERY_ERRORS)
            watches = len(api.watch_requests())
            api.drop_streams()
            wait_until(lambda: fill_holes(pid, bind, conns) and len(api.watch_requests())
                       > watches and api.open_streams(), 20,
                       message="a watch re-opened while busy")
            assert min(socket_fds(pid, api.port)) >= 1024, socket_fds(pid, api.port)
            lists, watches = len(api.list_requests()), len(api.watch_requests())
            api.expire()
            wait_until(lambda: len(api.list_requests()) > lists
                       and len(api.watch_requests()) > watches and api.open_streams(), 20,
                       message="re-listed and watching again while busy")
            assert min(socket_fds(pid, api.port)) >= 1024, socket_fds(pid, api.port)
            api.set_slice(make_slice("kubernetes", ["127.0.0.1", DEAD], port=hybrid.port))
            dead = f"{DEAD}:{hybrid.port}"
            wait_until(lambda: dead in upstreams(health), 20, message="discovered while busy")
            assert metric(health, DISCOVERY_ERRORS) == errors_before
            # The state file: rewritten with the discovered endpoint.
            wait_until(lambda: state.exists() and dead in state.read_text(), 20,
                       message="the state file rewritten while busy")
            # readyz probes: new ones pass while busy.
            probes = hybrid.readyz
            wait_until(lambda: hybrid.readyz >= probes + 2, 20, message="readyz probes while busy")
            assert upstreams(health)[hybrid.address]["ready"] is True
            # The health port.
            for path in ("/healthz", "/readyz", "/metrics"):
                assert http(("127.0.0.1", health), path, timeout=5)[0] == 200, path
            # The admin socket: a read and a write.
            reply = admin.request(admin_sock, {"command": "list"})
            assert reply["code"] == 0, reply
            reply = admin.request(admin_sock, {"command": "drain", "address": dead,
                                               "force": False})
            assert reply["code"] == 0, reply
            assert upstreams(health)[dead]["state"] == "admin-drain"
            # Handover: a successor takes the listeners over from the busy one.
            second = Proc(["--bind-port", str(bind), "--health-port", str(health), *common,
                           "--admin-socket", str(tmp_path / "admin2.sock")])
            procs.append(second)
            wait_until(lambda: second.saw("handover: took over listeners"), 30,
                       message="the successor took the listeners")
            wait_until(lambda: first.saw("a successor accepts now"), 10,
                       message="the busy one stopped accepting")
            with socket.create_connection(("127.0.0.1", bind), timeout=10) as c:
                c.settimeout(10)
                c.sendall(b"new\n")
                assert c.recv(4) == b"new\n"
            # The busy one's relayed connections live on after the handover.
            assert round_trip(conns, b"after\n") == len(conns)
            assert first.popen.poll() is None and second.popen.poll() is None
            problems = [line for line in first.log.splitlines()
                        if "filedescriptor out of range" in line or "Traceback" in line]
            assert problems == [], problems
        finally:
            for c in conns:
                c.close()
            for p in procs:
                p.reap()
