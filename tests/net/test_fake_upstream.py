"""Self-test of the fake upstreams: routes, recording, stop/restart, pause, echo."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator

import pytest
import trustme

from tests.fakes.upstream import EchoServer, FakeUpstream, IdentityServer
from tests.util import wait_until


@pytest.fixture
def up(ca: trustme.CA) -> Iterator[FakeUpstream]:
    with FakeUpstream(ca=ca, name="up1") as u:
        yield u


def client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(ctx)
    return ctx


def https(up: FakeUpstream, ca: trustme.CA, timeout: float = 5.0) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection("127.0.0.1", up.port, timeout=timeout,
                                       context=client_ctx(ca))


def get(conn: http.client.HTTPConnection, path: str, **headers: str) -> tuple[int, bytes]:
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_routes_and_keep_alive(up: FakeUpstream, ca: trustme.CA) -> None:
    conn = https(up, ca)
    try:
        assert get(conn, "/readyz") == (200, b"ok")
        assert get(conn, "/whoami") == (200, b"up1")
        status, body = get(conn, "/version")
        assert status == 200 and json.loads(body)["name"] == "up1"
        conn.request("POST", "/echo", body=b"\x00\x01payload")
        assert conn.getresponse().read() == b"\x00\x01payload"
        assert get(conn, "/nope")[0] == 404
        up.set_ready_status(500)
        assert get(conn, "/readyz")[0] == 500
        up.set_ready_status(302)
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 302 and resp.getheader("Location")
    finally:
        conn.close()
    assert up.accepted == 1  # all of it on one kept-alive connection
    assert up.hit_count("/readyz") == 3


def test_server_name_in_certificate(up: FakeUpstream, ca: trustme.CA) -> None:
    with socket.create_connection(("127.0.0.1", up.port), timeout=5) as raw, \
            client_ctx(ca).wrap_socket(raw, server_hostname="kubernetes.default.svc") as tls:
        assert tls.getpeercert()


def test_records_authorization_and_client_cert(ca: trustme.CA, tmp_path) -> None:
    client_ca = trustme.CA()
    with FakeUpstream(ca=ca, name="up2", client_ca=client_ca) as up:
        leaf = client_ca.issue_cert("node-1", common_name="system:node:node-1")
        pem = tmp_path / "client.pem"
        leaf.private_key_and_cert_chain_pem.write_to_path(str(pem))
        ctx = client_ctx(ca)
        ctx.load_cert_chain(str(pem))
        conn = http.client.HTTPSConnection("127.0.0.1", up.port, timeout=5, context=ctx)
        try:
            get(conn, "/readyz", Authorization="Bearer abc")
        finally:
            conn.close()
        # without a client cert is fine too (optional unless required)
        conn = https(up, ca)
        try:
            get(conn, "/readyz")
        finally:
            conn.close()
        assert up.authorizations() == ["Bearer abc", None]
        assert up.client_cns() == ["system:node:node-1", None]


def test_require_client_cert_rejects_anonymous(ca: trustme.CA) -> None:
    with FakeUpstream(ca=ca, client_ca=trustme.CA(), require_client_cert=True) as up:
        conn = https(up, ca)
        try:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                get(conn, "/readyz")
        finally:
            conn.close()
        wait_until(lambda: up.active_connections() == 0, 5)


def test_watch_streams_until_stop(ca: trustme.CA) -> None:
    up = FakeUpstream(ca=ca, name="w", watch_interval=0.01).start()
    try:
        conn = https(up, ca)
        conn.request("GET", "/watch")
        resp = conn.getresponse()
        lines = [json.loads(resp.readline()) for _ in range(3)]
        assert [x["n"] for x in lines] == [0, 1, 2] and lines[0]["from"] == "w"
        up.stop()  # closes the live stream
        with pytest.raises((http.client.IncompleteRead, ConnectionError, ValueError)):
            while True:
                if not resp.readline():
                    raise ConnectionError("eof")
        conn.close()
    finally:
        up.stop()
    assert up.active_connections() == 0


def test_ready_hang_released_by_stop(ca: trustme.CA) -> None:
    up = FakeUpstream(ca=ca).start()
    up.set_ready_hang(True)
    conn = https(up, ca, timeout=10)
    try:
        conn.request("GET", "/readyz")
        wait_until(lambda: up.hit_count("/readyz") == 1, 5)
        up.stop()
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            conn.getresponse()
    finally:
        conn.close()
        up.stop()


def test_close_listener_keeps_live_connections_and_restart_same_port(ca: trustme.CA) -> None:
    up = FakeUpstream(ca=ca, name="r").start()
    try:
        port = up.port
        conn = https(up, ca)
        assert get(conn, "/whoami") == (200, b"r")
        up.close_listener()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert get(conn, "/whoami") == (200, b"r")  # the live one still works
        conn.close()
        up.stop()
        up.start()
        assert up.port == port
        conn = https(up, ca)
        assert get(conn, "/whoami") == (200, b"r")
        conn.close()
    finally:
        up.stop()


def test_plain_http_and_tls_echo_mode(ca: trustme.CA) -> None:
    with FakeUpstream(tls=False, name="plain") as up:
        conn = http.client.HTTPConnection("127.0.0.1", up.port, timeout=5)
        try:
            assert get(conn, "/whoami") == (200, b"plain")
        finally:
            conn.close()
    with FakeUpstream(ca=ca, mode="echo") as up, \
            socket.create_connection(("127.0.0.1", up.port), timeout=5) as raw, \
            client_ctx(ca).wrap_socket(raw, server_hostname="localhost") as tls:
        data = bytes(range(256)) * 64
        tls.sendall(data)
        got = b""
        while len(got) < len(data):
            got += tls.recv(65536)
        assert got == data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "eof"
        buf += chunk
    return buf


def test_echo_and_identity_servers_half_close() -> None:
    with EchoServer() as echo, IdentityServer(name="id-7") as ident:
        with socket.create_connection(("127.0.0.1", echo.port), timeout=5) as s:
            s.sendall(b"hello")
            s.shutdown(socket.SHUT_WR)
            assert recv_exact(s, 5) == b"hello"
            assert s.recv(10) == b""  # the half-close came back
        with socket.create_connection(("127.0.0.1", ident.port), timeout=5) as s:
            assert recv_exact(s, 5) == b"id-7\n"
            s.sendall(b"x" * 100000)
            assert recv_exact(s, 100000) == b"x" * 100000


def test_stop_closes_many_live_connections_quickly() -> None:
    ident = IdentityServer(name="many").start()
    socks = [socket.create_connection(("127.0.0.1", ident.port), timeout=5) for _ in range(50)]
    try:
        for s in socks:
            recv_exact(s, 5)
        wait_until(lambda: ident.active_connections() == 50, 5)
        ident.stop()
        assert ident.active_connections() == 0
        for s in socks:
            assert s.recv(10) == b""
    finally:
        for s in socks:
            s.close()
        ident.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("fake-many-")]


def test_pause_accept_leaves_connects_in_backlog() -> None:
    with IdentityServer(name="p") as ident:
        ident.pause_accept()
        s = socket.create_connection(("127.0.0.1", ident.port), timeout=5)  # backlog
        try:
            s.settimeout(0.2)
            with pytest.raises(TimeoutError):
                s.recv(10)  # nobody accepted it, so no greeting
            assert ident.accepted == 0
            ident.resume_accept()
            s.settimeout(5)
            assert recv_exact(s, 2) == b"p\n"
        finally:
            s.close()


def test_fill_backlog_makes_connects_time_out() -> None:
    from extractedprism.checks.probes import probe
    from extractedprism.config.endpoints import Endpoint

    with IdentityServer(name="slow", backlog=0) as ident:
        assert ident.fill_backlog() >= 1
        assert probe(Endpoint("127.0.0.1", ident.port), 0.3).reason == "timeout"
        ident.release_backlog()
        # the SYNs of the filler-era connect are gone; a fresh one gets through
        r = probe(Endpoint("127.0.0.1", ident.port), 3.0)
        assert r.ok, r
