"""Graceful draining, connection tracking, backpressure (spec "Graceful draining")."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from tests.fakes.upstream import IdentityServer
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


def open_to(app, name: str, want: int = 1, limit: int = 200) -> list[socket.socket]:  # type: ignore[no-untyped-def]
    """Open connections until ``want`` of them landed on upstream ``name``."""
    mine, others = [], []
    for _ in range(limit):
        s = connect(app)
        (mine if read_line(s) == name else others).append(s)
        if len(mine) == want:
            break
    for s in others:
        s.close()
    assert len(mine) == want
    return mine


def held_on_up0(make_app: Callable[..., App], servers: Callable[..., list[IdentityServer]],
                drain_timeout: float) -> tuple[App, list[IdentityServer], socket.socket]:
    """An App over two upstreams (up0, up1) and one connection held to up0."""
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], drain_timeout=drain_timeout)
    (conn,) = open_to(app, "up0")
    return app, ups, conn


def still_open(s: socket.socket) -> bool:
    s.sendall(b"ping\n")
    return read_line(s) == "ping"


def closed(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def test_removed_endpoint_drains_until_timeout(make_app, servers):
    app, ups, conn = held_on_up0(make_app, servers, drain_timeout=1.0)
    gone = ups[0].address
    t0 = time.monotonic()
    app.registry.membership.set_endpoints([ups[1].endpoint])
    snap = app.registry.snapshot()
    assert snap.get(gone).draining and not snap.get(gone).pickable
    # No new connections go to the draining upstream ...
    assert {whoami(app) for _ in range(20)} == {"up1"}
    # ... while its live connection keeps working within the grace period.
    assert still_open(conn)
    assert closed(conn)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed <= 2.5, elapsed
    wait_until(lambda: app.registry.snapshot().get(gone) is None, 5)
    conn.close()


def test_readding_aborts_the_drain(make_app, servers):
    app, ups, conn = held_on_up0(make_app, servers, drain_timeout=0.6)
    app.registry.membership.set_endpoints([ups[1].endpoint])
    assert app.registry.snapshot().get(ups[0].address).draining
    app.registry.membership.set_endpoints([u.endpoint for u in ups])
    assert not app.registry.snapshot().get(ups[0].address).draining
    deadline = time.monotonic() + 1.5  # well past the drain timeout
    while time.monotonic() < deadline:
        assert still_open(conn)
        time.sleep(0.1)
    conn.close()


def test_zero_drain_timeout_closes_at_once(make_app, servers):
    app, ups, conn = held_on_up0(make_app, servers, drain_timeout=0.0)
    t0 = time.monotonic()
    app.registry.membership.set_endpoints([ups[1].endpoint])
    assert closed(conn)
    assert time.monotonic() - t0 < 0.5
    assert app.registry.snapshot().get(ups[0].address) is None
    conn.close()


def test_drain_completes_early_when_connections_finish(make_app, servers):
    app, ups, conn = held_on_up0(make_app, servers, drain_timeout=30.0)
    app.registry.membership.set_endpoints([ups[1].endpoint])
    conn.close()
    wait_until(lambda: app.registry.snapshot().get(ups[0].address) is None, 5)


def test_metric_series_deleted_after_drain(make_app, servers):
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], drain_timeout=0.3, health_interval=30,
                   health_timeout=1)
    gone = ups[0].address
    ups[0].close_listener()
    for _ in range(10):  # dial failures feed connection_errors_total{upstream=gone}
        connect(app).close()
    wait_until(lambda: sample(app.metrics, "extractedprism_connection_errors_total",
                                          {"upstream": gone}), 5)
    app.registry.membership.set_endpoints([ups[1].endpoint])
    wait_until(lambda: app.registry.snapshot().get(gone) is None, 5)
    text = http(app.health_address, "/metrics")[2].decode()
    assert gone not in text
    # Failures reported after removal are not counted until the address is added again.
    app.registry.verdicts.record_dial(gone, False, "late")
    assert gone not in http(app.health_address, "/metrics")[2].decode()


def test_connection_tracking_and_per_upstream_gauge(make_app, servers):
    ups = servers(1)
    app = make_app([u.endpoint for u in ups])
    conns = [connect(app) for _ in range(3)]
    for c in conns:
        assert read_line(c) == "up0"
        c.sendall(b"x" * 1000 + b"\n")
        assert len(read_line(c)) == 1000
    # A pipe counts bytes after it sent them, so the client may read the echo first.
    views = wait_until(lambda: (len(vs := live_connections(app.registry)) == 3 and all(
        (v.bytes_up, v.bytes_down) == (1001, 4 + 1001) for v in vs)) and vs, 5)
    for v in views:
        assert v.upstream == ups[0].address
        assert v.client.startswith("127.0.0.1:")
    text = http(app.health_address, "/metrics")[2].decode()
    assert f'extractedprism_upstream_connections_active{{upstream="{ups[0].address}"}} 3.0' in text
    assert "extractedprism_connections_active 3.0" in text
    for c in conns:
        c.close()
    wait_until(lambda: connection_count(app.registry) == 0, 5)


def test_drain_race_retries_on_another_upstream(make_app, servers):
    """A connection whose upstream starts draining while it is dialed gets one retry."""
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], drain_timeout=5.0)
    from extractedprism.datapath import dialer as dialer_mod  # where the blocking dial is called

    real_dial = dialer_mod.dial
    fired = threading.Event()

    def racing_dial(ep: Endpoint, timeout: float, *rest: bool) -> socket.socket:
        sock = real_dial(ep, timeout, *rest)
        if str(ep) == ups[0].address and not fired.is_set():
            fired.set()
            app.registry.membership.set_endpoints([ups[1].endpoint])  # drain starts mid-dial
        return sock

    def attached_to_up0() -> int:
        view = app.registry.snapshot().get(ups[0].address)
        return 0 if view is None else view.active_connections

    real_native = dialer_mod.native_connect

    def racing_native(target, *rest):  # type: ignore[no-untyped-def]
        # The native relay's first dial of a numeric endpoint (Dialer._fast).
        got = real_native(target, *rest)
        if f"{target[1]}:{target[2]}" == ups[0].address and not fired.is_set():
            fired.set()
            app.registry.membership.set_endpoints([ups[1].endpoint])  # drain starts mid-dial
        return got

    dialer_mod.dial = racing_dial
    dialer_mod.native_connect = racing_native
    try:
        for _ in range(50):
            with connect(app) as s:
                served_by = read_line(s)
                assert served_by in ("up0", "up1")
                if fired.is_set():
                    # The racing connection was retried on up1 and, while it is still
                    # open, nothing is attached to the draining up0 (earlier, closed
                    # connections may take a moment to detach).
                    assert served_by == "up1"
                    wait_until(lambda: attached_to_up0() == 0, 2,
                               message="nothing attached to the draining up0")
                    break
    finally:
        dialer_mod.dial = real_dial
        dialer_mod.native_connect = real_native
    assert fired.is_set()
    wait_until(lambda: app.registry.snapshot().get(ups[0].address) is None, 5,
               message="the drained up0 removed")


def test_max_connections_backpressure(make_app, servers):
    ups = servers(1)
    app = make_app([u.endpoint for u in ups], max_connections=2)
    a, b = connect(app), connect(app)
    assert read_line(a) == "up0" and read_line(b) == "up0"
    c = connect(app)  # accepted by the kernel backlog, not by the proxy
    c.settimeout(0.5)
    try:
        c.recv(3)
        raise AssertionError("third connection was served beyond --max-connections")
    except TimeoutError:
        pass
    assert connection_count(app.registry) == 2
    a.close()
    c.settimeout(5)
    assert read_line(c) == "up0"  # served as soon as a slot freed
    text = http(app.health_address, "/metrics")[2].decode()
    assert "extractedprism_connections_max 2.0" in text
    for s in (b, c):
        s.close()


def test_pool_shrinks_back_after_a_burst(make_app, servers):
    import os as _os

    from extractedprism.datapath.pool import WARM_THREADS

    ups = servers(1)
    app = make_app([u.endpoint for u in ups])
    app.proxy.pipe_pool.idle_exit_s = 0.3

    def pipe_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("pipe-"))

    def fds() -> int:
        return len(_os.listdir("/proc/self/fd"))

    fds0 = fds()
    n = WARM_THREADS + 24
    burst = [connect(app) for _ in range(n)]
    for s in burst:
        assert read_line(s) == "up0"
    assert pipe_threads() >= n
    for s in burst:
        s.close()
    # The extra threads retire and give their kernel pipes back; the pool stays usable.
    wait_until(lambda: pipe_threads() == WARM_THREADS, 10)
    # The warm threads give their kernel pipes back too (PIPE_IDLE_RELEASE_S).
    wait_until(lambda: fds() <= fds0, 10)
    assert whoami(app) == "up0"
