"""The data path end to end on loopback: bytes, half-close, selection, health, draining."""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import pipe as pipe_mod
from extractedprism.datapath.pool import WARM_THREADS
from extractedprism.datapath.proxy import Proxy
from extractedprism.datapath.relay import resolve
from extractedprism.datapath.sockopts import USER_TIMEOUT_MS
from extractedprism.upstreams.registry import Registry
from tests.fakes.upstream import EchoServer
from tests.util import (
    connect,
    connection_count,
    http,
    live_connections,
    read_line,
    sample,
    wait_until,
    whoami,
)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


# Every data-path test runs on both relays: the C extension and the Python loop (with
# splice, and with its buffer copy, the fallback where splice or a kernel pipe is missing).
RELAY_PATHS = ["native", "python", "python-buffer"]


def relay_app(make_app, monkeypatch, path: str, endpoints, **kw):  # type: ignore[no-untyped-def]
    relay, _, mode = path.partition("-")
    if mode:
        monkeypatch.setattr(pipe_mod, "HAVE_SPLICE", False)
    app = make_app(endpoints, relay=relay, **kw)
    assert app.relay == relay
    return app


@pytest.mark.parametrize("path", RELAY_PATHS)
def test_large_payload_both_ways_intact(make_app, servers, monkeypatch, path):
    calls = collections.Counter()
    real_splice = pipe_mod._splice
    real_native = getattr(pipe_mod, "_native", None)
    real_judged = getattr(pipe_mod, "_judged", None)

    def counting_splice(*args):  # type: ignore[no-untyped-def]
        calls["splice"] += 1
        return real_splice(*args)

    def counting_native(*args):  # type: ignore[no-untyped-def]
        calls["native"] += 1
        assert real_native is not None
        return real_native(*args)

    def counting_judged(*args):  # type: ignore[no-untyped-def]
        # The silent-upstream check and the relay in one native call (Pipe.run_judged).
        calls["native"] += 1
        assert real_judged is not None
        return real_judged(*args)

    monkeypatch.setattr(pipe_mod, "_splice", counting_splice)
    monkeypatch.setattr(pipe_mod, "_native", counting_native)
    if real_judged is not None:
        monkeypatch.setattr(pipe_mod, "_judged", counting_judged)
    (echo,) = servers(1, EchoServer)
    app = relay_app(make_app, monkeypatch, path, [echo.endpoint])
    payload = os.urandom(50 * 1024 * 1024)
    got = bytearray()
    with connect(app, timeout=30) as s:
        def reader() -> None:
            while len(got) < len(payload):
                chunk = s.recv(1 << 20)
                if not chunk:
                    return
                got.extend(chunk)

        t = threading.Thread(target=reader, name="test-reader")
        t.start()
        s.sendall(payload)
        t.join(30)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    # The path under test really carried the bytes.
    if path == "native":
        assert calls == {"native": 1}
    elif path == "python":
        assert calls["splice"] > 100 and not calls["native"]
    else:
        assert not calls
    wait_until(lambda: connection_count(app.registry) == 0, 5)


@pytest.mark.parametrize("path", RELAY_PATHS)
def test_half_close_propagates_and_rest_of_response_arrives(make_app, servers, monkeypatch,
                                                             path):
    (echo,) = servers(1, EchoServer)
    app = relay_app(make_app, monkeypatch, path, [echo.endpoint])
    payload = os.urandom(300_000)
    with connect(app, timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)  # the echo server sees EOF only through the proxy
        got = recv_exact(s, len(payload) + 1)
    assert got == payload  # everything, then EOF passed back


@contextlib.contextmanager
def scripted_upstream(handle: Callable[[socket.socket], None]) -> Iterator[Endpoint]:
    """A loopback upstream that runs ``handle`` for every connection (probes included)."""
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), name="test-upstream-conn").start()

    t = threading.Thread(target=serve, name="test-upstream")
    t.start()
    try:
        yield Endpoint("127.0.0.1", lst.getsockname()[1])
    finally:
        lst.shutdown(socket.SHUT_RDWR)
        lst.close()
        t.join(5)


@pytest.mark.parametrize("path", RELAY_PATHS)
def test_upstream_half_close_reaches_client(make_app, monkeypatch, path):
    # Upstream writes a greeting, closes its write side, and keeps reading.
    received = bytearray()

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(b"bye")
                conn.shutdown(socket.SHUT_WR)
                while chunk := conn.recv(65536):
                    received.extend(chunk)
            except OSError:
                pass  # the health probe hangs up at once

    with scripted_upstream(handle) as ep:
        app = relay_app(make_app, monkeypatch, path, [ep])
        with connect(app) as s:
            assert recv_exact(s, 4) == b"bye"  # then EOF
            s.sendall(b"still talking")
            s.shutdown(socket.SHUT_WR)
            wait_until(lambda: bytes(received) == b"still talking", 5)


@pytest.mark.parametrize("path", RELAY_PATHS)
def test_reset_from_upstream_closes_client(make_app, monkeypatch, path):
    resets = []

    def handle(conn: socket.socket) -> None:
        if conn.recv(10):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            resets.append(1)
        conn.close()  # RST when data was received (linger 0), else a plain close (probe)

    with scripted_upstream(handle) as ep:
        app = relay_app(make_app, monkeypatch, path, [ep])
        with connect(app) as s:
            s.sendall(b"hello")
            s.settimeout(5)
            with pytest.raises(ConnectionResetError):
                s.recv(10)  # the upstream's reset is passed on to the client
        assert resets
        wait_until(lambda: connection_count(app.registry) == 0, 5)


def test_200_concurrent_connections_intact(make_app, servers):
    echos = servers(3, EchoServer)
    app = make_app([e.endpoint for e in echos])
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            data = os.urandom(20_000) + str(i).encode()
            with connect(app, timeout=20) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                got = recv_exact(s, len(data) + 1)
            if got != data:
                errors.append(f"conn {i}: {len(got)} bytes back")
        except OSError as exc:
            errors.append(f"conn {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), name=f"test-client-{i}")
               for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not [t.name for t in threads if t.is_alive()], "clients still waiting"
    assert not errors


def test_selection_spreads_over_three_upstreams(make_app, servers):
    ups = servers(3)
    app = make_app([u.endpoint for u in ups])
    counts = collections.Counter(whoami(app) for _ in range(300))
    assert set(counts) == {"up0", "up1", "up2"}
    assert all(60 <= c <= 140 for c in counts.values()), counts


def test_socket_options_on_both_sides(make_app, servers):
    (up,) = servers(1)
    app = make_app([up.endpoint])
    with connect(app) as s:
        read_line(s)
        snap = wait_until(lambda: live_connections(app.registry), 5)
        assert snap
        # Read back the options the pipe thread applied to the proxy's sockets.
        pipes = [c for u in app.registry.ups.values() for c in u.conns.values()]
        for sock in (pipes[0].client_sock, pipes[0].upstream_sock):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 15  # Go's
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 9  # defaults
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_MS


def test_stopped_upstream_leaves_within_two_intervals_and_returns_after_one_success(
        make_app, servers):
    ups = servers(2)
    interval = 0.3
    app = make_app([u.endpoint for u in ups], health_interval=interval)
    addr = ups[0].address
    wait_until(lambda: app.registry.snapshot().get(addr).healthy, 5)
    ups[0].close_listener()
    t0 = time.monotonic()
    wait_until(lambda: not app.registry.snapshot().get(addr).healthy, 5)
    assert time.monotonic() - t0 <= 2 * interval + 0.2 + 0.5  # two checks (+ timeout, slack)
    # While excluded, every connection goes to the other upstream.
    assert {whoami(app) for _ in range(30)} == {"up1"}
    ups[0].start()
    t1 = time.monotonic()
    wait_until(lambda: app.registry.snapshot().get(addr).healthy, 5)
    assert time.monotonic() - t1 <= interval + 0.5  # one success re-includes it


def test_dial_failures_count_toward_the_streak_and_retry_elsewhere(make_app, servers):
    ups = servers(3)
    # Long interval: only client dials can notice the dead upstream.
    app = make_app([u.endpoint for u in ups], health_interval=30, health_timeout=1)
    dead = ups[0].address
    # The start-up checks must be over (and recorded) before up0 dies: a check that hit
    # the closed port would count toward the streak too, leaving only one dial to fail.
    # Every upstream took its check's connection, and no probe thread is left to record.
    wait_until(lambda: all(u.accepted >= 1 for u in ups)
               and not any(t.name.startswith("probe-") for t in threading.enumerate()),
               5, message="the start-up checks")
    ups[0].close_listener()
    answers = [whoami(app) for _ in range(100)]
    assert all(a in ("up1", "up2") for a in answers), collections.Counter(answers)
    assert not app.registry.snapshot().get(dead).healthy  # two failed dials excluded it
    errors = sample(app.metrics, "extractedprism_connection_errors_total", {"upstream": dead})
    assert errors == 2


def test_readyz_503_when_all_upstreams_down_and_panic_mode(make_app, servers):
    ups = servers(2)
    app = make_app([u.endpoint for u in ups])
    assert http(app.health_address, "/readyz")[0] == 200
    for u in ups:
        u.close_listener()
    wait_until(lambda: sample(app.metrics, "extractedprism_panic") == 1, 5)
    assert http(app.health_address, "/readyz")[0] == 503
    errors = sum(sample(app.metrics, "extractedprism_connection_errors_total",
                                    {"upstream": u.address}) or 0 for u in ups)
    # Panic mode: all down -> client closed.
    with connect(app) as s:
        assert s.recv(10) == b""
    # Attempts made while no upstream was available are not connection errors.
    assert sum(sample(app.metrics, "extractedprism_connection_errors_total",
                                  {"upstream": u.address}) or 0 for u in ups) == errors
    # One comes back but is still marked unhealthy: panic mode still reaches it.
    ups[1].start()
    with connect(app) as s:
        assert read_line(s) == "up1"
    wait_until(lambda: sample(app.metrics, "extractedprism_panic") == 0, 5)


def test_no_thread_or_fd_growth_after_1000_short_connections(make_app, servers):
    ups = servers(2)

    def fds() -> tuple[int, int]:
        """(socket and other fds, kernel-pipe fds) of this process."""
        kinds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                kinds.append(os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"))
            except FileNotFoundError:  # the directory listing's own fd, or a closing one
                pass
        return kinds.count(False), kinds.count(True)

    def pipe_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("pipe-"))

    _, pipes_base = fds()  # other tests' leftovers are not this app's
    app = make_app([u.endpoint for u in ups])
    app.proxy.pipe_pool.idle_exit_s = 1.0  # threads beyond the warm ones retire soon
    for _ in range(50):  # warm the pool
        whoami(app)
    wait_until(lambda: connection_count(app.registry) == 0, 5)
    threads0, (other0, pipes0) = pipe_threads(), fds()
    # LIFO hand-off: a sequential client keeps landing on the same few hot threads, so
    # only they have made kernel pipes (a FIFO queue would have cycled through ~50).
    assert pipes0 - pipes_base <= 4 * 4
    for _ in range(1000):
        whoami(app)
    wait_until(lambda: connection_count(app.registry) == 0, 5)
    # A sequential client needs a thread or two at a time (one may still be closing the
    # last connection): no growth, and the pool back to its warm threads once idle.
    wait_until(lambda: pipe_threads() <= max(threads0, WARM_THREADS), 10,
               message=f"pipe threads back to {max(threads0, WARM_THREADS)}")
    wait_until(lambda: fds()[0] <= other0, 5, message=f"socket fds back to {other0}")
    # Each pipe thread holds at most its two kernel pipes (4 fds), made on first use.
    assert fds()[1] - pipes_base <= 4 * pipe_threads()


def test_ipv6_listener_and_upstream(make_app):
    from tests.fakes.upstream import IdentityServer

    up = IdentityServer(name="v6", host="::1").start()
    try:
        app = make_app([up.endpoint], bind_address="::1", health_bind_address="::1")
        assert app.proxy_address[0] == "::1"
        with socket.create_connection(("::1", app.proxy_address[1]), timeout=5) as s:
            assert read_line(s) == "v6"
        assert http(("::1", app.health_address[1]), "/readyz")[0] == 200
        assert str(up.endpoint).startswith("[::1]:")
    finally:
        up.stop()


def test_hostname_endpoint(make_app, servers):
    (up,) = servers(1)
    app = make_app([Endpoint("localhost", up.endpoint.port)])
    wait_until(lambda: app.registry.snapshot().get(f"localhost:{up.endpoint.port}").healthy, 5)
    assert whoami(app) == "up0"


def test_stopped_app_releases_every_fd(servers):
    from extractedprism.app import App
    from tests.conftest import fast_config

    ups = servers(2)
    before = len(os.listdir("/proc/self/fd"))
    app = App(fast_config([u.endpoint for u in ups]))
    app.start()
    for _ in range(50):
        whoami(app)
    app.stop()
    # Listener, health server, sockets and every pipe thread's kernel pipes are closed.
    wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, 5)


class _ListenerOutOfFds:
    """The real listener, except that its first ``failures`` accepts fail with EMFILE."""

    def __init__(self, real: socket.socket, failures: int) -> None:
        self._real = real
        self.failures = failures

    def _accept(self) -> tuple[int, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._real._accept()  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_accept_out_of_descriptors_warns_once_per_episode(servers, caplog):
    (up,) = servers(1)
    reg = Registry(selection="random", readyz=False, drain_timeout=1.0,
                   max_connections=16)
    reg.membership.set_endpoints([up.endpoint])
    px = Proxy(reg, bind_address="127.0.0.1", bind_port=0, dial_timeout=1.0,
               max_connections=16, relay=resolve("auto"))
    px.bind()
    assert px._listener is not None
    px._listener = _ListenerOutOfFds(px._listener, failures=4)  # type: ignore[assignment]
    px.start()
    try:
        with socket.create_connection(px.address, timeout=5) as s:
            assert s.recv(64)  # served once descriptors are back
        wait_until(lambda: any("accept recovered" in r.getMessage() for r in caplog.records),
                   5, message="recovery logged")
        failed = [r.levelno for r in caplog.records if "accept failed" in r.getMessage()]
        # One warning for the episode; its retries at debug.
        assert failed == [logging.WARNING] + [logging.DEBUG] * 3
    finally:
        assert px.shutdown(5)
