"""Resource limits seen from outside: fd exhaustion, many live connections at SIGTERM."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time

import pytest

from tests.fakes.upstream import IdentityServer
from tests.process.proxyproc import health_ok
from tests.util import PYTHON, ROOT, http, start_on_free_ports, wait_until


def _raise_own_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def spawn(endpoint: str, *args: str, nofile: int | None = None
          ) -> tuple[subprocess.Popen[bytes], int, int]:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}

    def start(ports: list[int]) -> subprocess.Popen[bytes]:
        bind, health = ports
        return subprocess.Popen(
            [PYTHON, "-m", "extractedprism", "--endpoints", endpoint, "--bind-port", str(bind),
             "--health-port", str(health), "--enable-discovery=false",
             "--health-interval", "2s", "--health-timeout", "1s", *args],
            cwd=ROOT, env=env, preexec_fn=limit, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    proc, (bind, health) = start_on_free_ports(start, lambda ps: health_ok(ps[1]))
    assert proc.poll() is None, f"the proxy exited with {proc.returncode}"
    return proc, bind, health


def stop_all(proc: subprocess.Popen[bytes], up: IdentityServer,
             held: list[socket.socket]) -> None:
    """Close the test's connections, SIGTERM the proxy (its exit status is the caller's to
    check) and stop the upstream."""
    for s in held:
        s.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    up.stop()


def served(bind: int, timeout: float = 0.5) -> socket.socket | None:
    s = socket.create_connection(("127.0.0.1", bind), timeout=5)
    s.settimeout(timeout)
    try:
        if s.recv(3) == b"up\n":
            return s
    except OSError:
        pass
    s.close()
    return None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(90)
def test_acceptor_survives_fd_exhaustion_and_recovers():
    _raise_own_fd_limit(4096)
    up = IdentityServer(name="up").start()
    proc, bind, health = spawn(up.address, nofile=96)
    held: list[socket.socket] = []
    try:
        # Hold connections until the proxy runs out of descriptors.
        for _ in range(200):
            s = served(bind)
            if s is None:
                break
            held.append(s)
        assert 5 < len(held) < 200, len(held)
        # Exhausted: no busy loop while clients wait, on the proxy port (the acceptor
        # backs off) nor on the health port (a probe waiting in its backlog).
        probe = socket.create_connection(("127.0.0.1", health), timeout=5)
        probe.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        held.append(probe)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.5)
        assert (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0) < 0.3
        for s in held:
            s.close()
        held.clear()
        # Descriptors free up: new connections are served again, by the same process.
        wait_until(lambda: (s := served(bind, 2.0)) is not None and held.append(s) is None,
                   20, message="a new connection served after fds were freed")
        assert proc.poll() is None
        assert http(("127.0.0.1", health), "/healthz")[0] == 200
    finally:
        stop_all(proc, up, held)
    assert proc.returncode == 0


@pytest.mark.timeout(90)
def test_sigterm_with_500_live_connections_exits_0_within_6s():
    _raise_own_fd_limit(8192)
    up = IdentityServer(name="up", backlog=1024).start()
    proc, bind, _ = spawn(up.address)
    conns: list[socket.socket] = []
    try:
        for _ in range(500):
            s = socket.create_connection(("127.0.0.1", bind), timeout=10)
            conns.append(s)
        for s in conns:
            s.settimeout(10)
            assert s.recv(3) == b"up\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
        assert rc == 0
        assert time.monotonic() - t0 < 6
    finally:
        for s in conns:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        up.stop()


_HEALTH_ONLY = """
import os, resource, sys, time
from extractedprism.health.server import HealthServer
from extractedprism.health.metrics import Metrics
from extractedprism.upstreams.registry import Registry
m = Metrics()
srv = HealthServer(Registry(), m, lambda: True, host="127.0.0.1", port=0)
srv.start()
print(srv.address[1], flush=True)
held = []
while True:  # take every descriptor left, so accept() gets EMFILE
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
print("full", flush=True)
time.sleep(30)
"""


@pytest.mark.timeout(60)
def test_health_server_does_not_spin_when_out_of_descriptors():
    proc = subprocess.Popen([PYTHON, "-c", _HEALTH_ONLY], cwd=ROOT, stdout=subprocess.PIPE,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                  (64, 64)))
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == b"full"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
            probe.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")  # waits in the backlog
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(1.5)
            assert (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0) < 0.3
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def _echoes(s: socket.socket, payload: bytes) -> bool:
    try:
        s.sendall(payload)
        got = bytearray()
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                return False
            got += chunk
        return bytes(got) == payload
    except OSError:
        return False


def _fds(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("relay", ["native", "python"])
def test_connections_keep_relaying_while_out_of_descriptors(relay):
    """EMFILE while relaying: with the descriptor limit lowered under a running proxy so
    that a new connection gets its two sockets but no kernel pipe, that connection takes
    the buffer copy, every live connection keeps copying intact, and once the limit is
    back new connections are served with kernel pipes again."""
    from tests.fakes.upstream import EchoServer

    up = EchoServer(name="echo").start()
    # A long health interval: no probe takes a descriptor while the limit is tight.
    proc, bind, _health = spawn(up.address, "--relay", relay, "--health-interval", "60s")
    held: list[socket.socket] = []
    try:
        for i in range(5):
            s = socket.create_connection(("127.0.0.1", bind), timeout=5)
            s.settimeout(5)
            held.append(s)
            assert _echoes(s, b"hello %d" % i)
        before = _fds(proc.pid)
        pipes_before = sum(v.startswith("pipe:") for v in before.values())
        # The lowest limit under which exactly three descriptor numbers are free: the
        # client's socket, the upstream's, and the one the acceptor's next accept4()
        # reserves while it waits (Linux takes the number before blocking).
        limit, free = 0, 0
        while free < 3 or limit in before:
            free += limit not in before
            limit += 1
        _soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, hard))
        s = socket.create_connection(("127.0.0.1", bind), timeout=5)
        s.settimeout(5)
        held.append(s)
        assert _echoes(s, b"no kernel pipe for me")
        after = _fds(proc.pid)
        assert sum(v.startswith("pipe:") for v in after.values()) == pipes_before
        assert len(after) == len(before) + 2  # its two sockets, and no kernel pipe
        payload = os.urandom(200_000)
        for s in held:  # every live connection carries bytes both ways, intact
            assert _echoes(s, payload)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (4096, hard))
        with socket.create_connection(("127.0.0.1", bind), timeout=5) as s:
            s.settimeout(5)
            assert _echoes(s, payload)
            # This one got a thread with kernel pipes again.
            wait_until(lambda: sum(v.startswith("pipe:") for v in _fds(proc.pid).values())
                       == pipes_before + 4, 5)
        assert proc.poll() is None
    finally:
        stop_all(proc, up, held)
    assert proc.returncode == 0
