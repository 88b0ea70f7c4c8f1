"""Health server: routes, method rules, metrics and the liveness heartbeat."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.util import http, send_and_read_to_eof, wait_until


@pytest.fixture
def app(make_app, servers):  # type: ignore[no-untyped-def]
    ups = servers(2)
    return make_app([u.endpoint for u in ups])


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/upstreams"])
def test_get_and_head(app, path):
    status, headers, body = http(app.health_address, path)
    assert status == 200 and body
    status, headers, body = http(app.health_address, path, method="HEAD")
    assert status == 200 and body == b""
    assert int(headers["content-length"]) > 0


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "TRACE", "FOO"])
@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_other_methods_get_405(app, method, path):
    status, headers, _ = http(app.health_address, path, method=method)
    assert status == 405
    assert headers["allow"] == "GET, HEAD, OPTIONS"


def test_options_204_with_allow(app):
    status, headers, body = http(app.health_address, "/healthz", method="OPTIONS")
    assert status == 204 and body == b""
    assert headers["allow"] == "GET, HEAD, OPTIONS"


def test_unknown_path_404(app):
    assert http(app.health_address, "/nope")[0] == 404


def test_upstreams_json(app):
    _, headers, body = http(app.health_address, "/upstreams")
    assert headers["content-type"] == "application/json"
    doc = json.loads(body)
    assert len(doc["upstreams"]) == 2
    for u in doc["upstreams"]:
        for key in ("address", "healthy", "draining", "active_connections",
                    "total_connections", "last_check_error", "ready", "tier", "rtt_seconds"):
            assert key in u


def test_metrics_names_and_types(app):
    with socket.create_connection(app.proxy_address, timeout=5) as s:
        s.recv(10)
    _, headers, body = http(app.health_address, "/metrics")
    assert headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    expected = {
        "extractedprism_upstreams_active": "gauge",
        "extractedprism_upstreams_total": "gauge",
        "extractedprism_connections_active": "gauge",
        "extractedprism_connections": "counter",  # parser strips _total
        "extractedprism_connection_errors": "counter",
        "extractedprism_discovery_updates": "counter",
        "extractedprism_discovery_errors": "counter",
        "extractedprism_health_check_status": "gauge",
        "extractedprism_upstream_connections_active": "gauge",
        "extractedprism_connections_max": "gauge",
        "extractedprism_panic": "gauge",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, name
    text = body.decode()
    # Per-upstream latency and readiness series exist only in their modes.
    assert "extractedprism_upstream_rtt_seconds{" not in text
    assert "extractedprism_upstream_ready{" not in text
    assert 'extractedprism_discovery_updates_total{provider="static"} 1.0' in text
    assert "extractedprism_upstreams_total 2.0" in text
    assert "extractedprism_connections_total 1.0" in text


def test_silent_client_does_not_block_others(app):
    # A client that connects and sends nothing must not hold up real requests.
    idle = [socket.create_connection(app.health_address, timeout=5) for _ in range(5)]
    try:
        t0 = time.monotonic()
        assert http(app.health_address, "/healthz")[0] == 200
        assert time.monotonic() - t0 < 2
    finally:
        for s in idle:
            s.close()


def test_malformed_request_gets_400(app):
    with socket.create_connection(app.health_address, timeout=5) as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert http(app.health_address, "/healthz")[0] == 200


def test_healthz_fails_when_a_core_thread_dies(app):
    assert http(app.health_address, "/healthz")[0] == 200
    # Stop the ticker as a crash would: its loop exits and the heartbeat notices.
    app.ticker._stop = type("S", (), {"is_set": staticmethod(lambda: True)})()
    app.ticker.wake()
    wait_until(lambda: not app.ticker.alive(), 5)
    wait_until(lambda: http(app.health_address, "/healthz")[0] == 503, 5)


def test_healthz_fails_when_the_acceptor_is_stuck_not_only_dead(app):
    # Alive but stuck (here: blocked in its loop): clients wait in the backlog. The
    # heartbeat checks progress, not is_alive(); the old one kept /healthz at 200.
    assert http(app.health_address, "/healthz")[0] == 200
    release = threading.Event()
    turned = app.proxy._on_accept_loop

    def stuck() -> None:
        turned()
        release.wait(30)

    app.proxy._on_accept_loop = stuck
    try:
        with socket.create_connection(app.proxy_address, timeout=5):  # taken: now stuck
            pass
        with socket.create_connection(app.proxy_address, timeout=5):  # waits in the backlog
            bound = 10 * app.config.liveness_threshold
            wait_until(lambda: http(app.health_address, "/healthz")[0] == 503, bound)
            assert app.proxy.acceptor_alive()
            assert "acceptor not accepting" in app.liveness_reason()
    finally:
        app.proxy._on_accept_loop = turned
        release.set()
    wait_until(lambda: http(app.health_address, "/healthz")[0] == 200,
               10 * app.config.liveness_threshold)


def test_an_idle_acceptor_is_alive(app):
    # Blocked in accept() with nobody waiting is idle, not stuck.
    beat = app.heartbeat.last_beat
    wait_until(lambda: app.heartbeat.last_beat > beat + 3 * app.config.liveness_interval,
               10 * app.config.liveness_threshold)
    assert http(app.health_address, "/healthz")[0] == 200


# -- hostile clients ---------------------------------------------------------------------
# Raw sockets, because http.client cannot send most of these.

def _exchange(address: tuple[str, int], data: bytes, *, half_close: bool = False,
              timeout: float = 8.0) -> tuple[bytes, float]:
    """Send ``data``, read until the server closes; (everything read, seconds taken)."""
    t0 = time.monotonic()
    with socket.create_connection(address, timeout=timeout) as s:
        out = send_and_read_to_eof(s, data, half_close=half_close)
    return out, time.monotonic() - t0


def _responses(data: bytes, heads: tuple[int, ...] = ()
               ) -> list[tuple[int, dict[str, str], bytes]]:
    """Split a byte stream into (status, headers, body) by Content-Length; ``heads``: the
    positions of answers to HEAD, which have none."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {head!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = 0 if len(out) in heads else int(headers.get("content-length", "0"))
        out.append((status, headers, data[:n]))
        data = data[n:]
    return out


def _request_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "health-http-request"]


def _get(path: bytes, *extra: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(e + b"\r\n" for e in extra) \
        + b"\r\n"


@pytest.mark.parametrize("target", [b"http://x/readyz", b"HTTP://127.0.0.1:7446/readyz?v=1",
                                    b"/%72eadyz", b"/readyz?verbose", b"//readyz"])
def test_equivalent_request_targets_reach_the_route(app, target):
    # RFC 9112 3.2.2: a server MUST accept the absolute form; %72 is 'r' (RFC 3986 6.2.2.2).
    out, _ = _exchange(app.health_address, _get(target, b"Connection: close"))
    [(status, _, body)] = _responses(out)
    assert (status, body) == (200, b"ok\n"), target


@pytest.mark.parametrize("target", [b"/readyz/", b"/readyz%2F", b"/READYZ"])
def test_other_targets_are_404(app, target):
    out, _ = _exchange(app.health_address, _get(target, b"Connection: close"))
    assert _responses(out)[0][0] == 404


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/upstreams", "/nope"])
def test_options_on_every_path(app, path):
    status, headers, body = http(app.health_address, path, method="OPTIONS")
    assert (status, body, headers["allow"]) == (204, b"", "GET, HEAD, OPTIONS")


def test_lowercase_method_is_405_not_get(app):
    out, _ = _exchange(app.health_address, b"get /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    [(status, headers, _)] = _responses(out)
    assert status == 405 and headers["allow"] == "GET, HEAD, OPTIONS"


def test_server_header_has_no_trailing_space(app):
    out, _ = _exchange(app.health_address, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert b"\r\nServer: extractedprism\r\n" in out


@pytest.mark.parametrize("request_bytes, status, words", [
    # HTTP/0.9 simple request: answered at once, not after the 5 s read timeout.
    (b"GET /healthz\r\n", 400, b"no HTTP version"),
    (b"GET /healthz\r\n\r\n", 400, b"no HTTP version"),
    # A TLS ClientHello sent to the plain-HTTP port (it has no newline to wait for).
    (bytes.fromhex("16030100f4010000f00303") + bytes(40), 400, b"TLS"),
    (b"\x00\x01garbage\xff\r\n\r\n", 400, b"method"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, b"(2.0)"),
    (b"GET /healthz HTTP/1.1 extra\r\n\r\n", 400, b"version"),
])
def test_malformed_request_lines_get_a_prompt_specific_error(app, request_bytes, status, words):
    out, took = _exchange(app.health_address, request_bytes)
    assert took < 2, f"answered after {took:.1f}s"
    [(got, headers, body)] = _responses(out)
    assert got == status
    assert headers["connection"] == "close"
    assert words in body, body
    # The status line carries the standard phrase, never the client's bytes.
    assert out.split(b"\r\n", 1)[0] in (b"HTTP/1.1 400 Bad Request",
                                        b"HTTP/1.1 505 HTTP Version Not Supported")


def test_oversized_request_head_is_refused(app):
    # Many medium headers: each is under http.server's 64 KiB line limit, and there are
    # fewer than 100, yet together they would make every request thread hold ~6 MB.
    big = _get(b"/healthz", *[b"X-%d: " % i + b"a" * 8000 for i in range(60)])
    out, _ = _exchange(app.health_address, big)
    assert _responses(out)[0][0] == 431
    out, _ = _exchange(app.health_address, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")
    assert _responses(out)[0][0] == 414
    out, _ = _exchange(app.health_address,
                       _get(b"/healthz", *[b"X-%d: y" % i for i in range(101)]))
    assert _responses(out)[0][0] == 431


def test_keep_alive_and_pipelining(app):
    reqs = _get(b"/healthz") + b"HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n" \
        + b"OPTIONS /metrics HTTP/1.1\r\nHost: x\r\n\r\n" + _get(b"/nope", b"Connection: close")
    out, _ = _exchange(app.health_address, reqs)
    got = _responses(out, heads=(1,))
    assert [g[0] for g in got] == [200, 200, 204, 404]
    assert got[1][2] == b"" and got[1][1]["content-length"] == "3"
    # The same, one request at a time on one connection.
    with socket.create_connection(app.health_address, timeout=5) as s:
        for _ in range(3):
            s.sendall(_get(b"/healthz"))
            got = b""
            while not got.endswith(b"\r\n\r\nok\n"):
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk


def test_half_closed_client_gets_its_answer(app):
    out, _ = _exchange(app.health_address, _get(b"/healthz"), half_close=True)
    assert _responses(out)[0][:1] == (200,)
    # Even one that ends its request with the half-close instead of a blank line.
    out, _ = _exchange(app.health_address, b"GET /readyz HTTP/1.0\r\n", half_close=True)
    assert _responses(out)[0][2] == b"ok\n"


@pytest.mark.parametrize("body_headers, body", [
    (b"Content-Length: 20\r\n", b"GARBAGEGARBAGEGARBAG"),
    (b"Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
])
@pytest.mark.parametrize("method", [b"POST", b"GET"])
def test_request_body_is_never_read_as_the_next_request(app, method, body_headers, body):
    # The body is not ours to read; the connection closes after the answer so that the
    # body cannot be taken for a second request (and the one behind it is not served).
    req = method + b" /healthz HTTP/1.1\r\nHost: x\r\n" + body_headers + b"\r\n" + body
    out, _ = _exchange(app.health_address, req + _get(b"/readyz"))
    [(status, headers, _)] = _responses(out)
    assert status == (405 if method == b"POST" else 200)
    assert headers["connection"] == "close"


def test_expect_100_continue_gets_the_final_answer_without_100(app):
    with socket.create_connection(app.health_address, timeout=5) as s:
        s.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 405 "), first
    assert b"Allow: GET, HEAD, OPTIONS\r\n" in first


def test_bad_content_length_is_400(app):
    out, _ = _exchange(app.health_address, _get(b"/healthz", b"Content-Length: -1"))
    [(status, _, body)] = _responses(out)
    assert status == 400 and b"Content-Length" in body


def test_client_gone_mid_request_or_response_writes_nothing_to_stderr(app, capfd):
    addr = app.health_address
    for _ in range(20):
        # Half a request, then gone.
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(b"GET /heal")
        # A full request, then a reset before reading the answer.
        with socket.create_connection(addr, timeout=5) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(_get(b"/metrics") * 50)
    assert http(addr, "/healthz")[0] == 200
    wait_until(lambda: not _request_threads(), 5, message="request threads done")
    assert capfd.readouterr().err == ""


def _open_sockets() -> int:
    # Sockets only: the proxy keeps a kernel pipe pair per pipe thread for reuse.
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed since listdir
    return n


@pytest.mark.timeout(30)
def test_slowloris_and_idle_flood_do_not_starve_the_health_port(app):
    sockets_before = _open_sockets()
    # 150 clients trickling a request one byte a second (each read gets a byte well
    # within any per-read timeout) and 150 that send nothing. Non-blocking connects: the
    # kernel completes them in the background, as an attacker's would.
    clients = []
    for _ in range(300):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(app.health_address)
        clients.append(s)
    trickle = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"z" * 100
    try:
        t0 = time.monotonic()
        step = 0
        while (elapsed := time.monotonic() - t0) < 6.5:
            if elapsed >= step:
                for s in clients[:150]:
                    try:
                        s.send(trickle[step:step + 1])
                    except OSError:
                        pass
                step += 1
            t1 = time.monotonic()
            assert http(app.health_address, "/healthz", timeout=2)[0] == 200
            assert time.monotonic() - t1 < 2
            with socket.create_connection(app.proxy_address, timeout=2) as p:
                assert p.recv(10).startswith(b"up")
            # Waiting clients cost a descriptor each, not a thread.
            wait_until(lambda: not _request_threads(), 2, message="no request thread")
            time.sleep(0.2)
        # The 5 s limit is for the whole request head, however the bytes trickle in.
        for i, s in enumerate(clients):
            s.setblocking(True)
            s.settimeout(2)
            got = s.recv(4096)
            if i < 150:
                assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), (i, got)
            else:
                assert got == b"", (i, got)  # nothing asked, nothing answered
    finally:
        for s in clients:
            s.close()
    wait_until(lambda: _open_sockets() <= sockets_before, 5, message="sockets released")


def test_http10_keep_alive_is_confirmed(app):
    # Without "Connection: keep-alive" in the answer, an HTTP/1.0 client waits for EOF,
    # which came only with the 5 s idle timeout.
    req = b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    with socket.create_connection(app.health_address, timeout=5) as s:
        for _ in range(2):
            s.sendall(req)
            got = b""
            while not got.endswith(b"\r\n\r\nok\n"):
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert b"\r\nConnection: keep-alive\r\n" in got


@pytest.mark.timeout(30)
def test_connection_flood_beyond_the_limit_displaces_the_oldest_waiting(app, caplog):
    from extractedprism.health.conn import MAX_CONNECTIONS

    n = MAX_CONNECTIONS + 100
    clients = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(app.health_address)
            clients.append(s)

        def displaced() -> int:
            count = 0
            for s in clients:
                try:
                    count += s.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    pass
            return count

        wait_until(lambda: displaced() >= n - MAX_CONNECTIONS, 10, message="oldest dropped")
        for _ in range(3):
            t0 = time.monotonic()
            assert http(app.health_address, "/healthz", timeout=2)[0] == 200
            assert time.monotonic() - t0 < 2
        with socket.create_connection(app.proxy_address, timeout=2) as p:
            assert p.recv(10).startswith(b"up")
        # The newest are the ones kept.
        assert all(_peek_open(s) for s in clients[-100:])
    finally:
        for s in clients:
            s.close()
    limit_lines = [r for r in caplog.records if "connection limit reached" in r.getMessage()]
    assert len(limit_lines) == 1


def _peek_open(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True


# -- the connection loop itself ----------------------------------------------------------

def _big_answer_loop(monkeypatch: pytest.MonkeyPatch, threads: int):  # type: ignore[no-untyped-def]
    from extractedprism.health import conn as conn_module
    from extractedprism.health.head import Conn

    monkeypatch.setattr(conn_module, "MAX_REQUEST_THREADS", threads)
    big = b"x" * (16 << 20)  # more than the kernel buffers for a client that does not read
    big_answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big

    def respond(conn: Conn) -> tuple[bytes, bool]:
        if b"/big" in conn.head:
            return big_answer, True
        return b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n", True

    loop = conn_module.ConnectionLoop("127.0.0.1", 0, respond, timeout_answer=b"")
    loop.start()
    return loop, len(big_answer)


def _read_exactly(s: socket.socket, n: int) -> int:
    got = 0
    while got < n and (chunk := s.recv(1 << 20)):
        got += len(chunk)
    return got


def test_clients_that_stop_reading_do_not_starve_the_request_threads(monkeypatch):
    # Clients that ask and then stop reading (a zero TCP window) must not hold the
    # request threads while their answers wait: with every thread stuck in a 5 s write,
    # /healthz probes from everyone else would time out.
    loop, size = _big_answer_loop(monkeypatch, threads=2)
    stalled = []
    try:
        for _ in range(4):
            s = socket.create_connection(loop.address, timeout=5)
            s.sendall(b"GET /big HTTP/1.1\r\n\r\n")
            stalled.append(s)
        with socket.create_connection(loop.address, timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
            assert time.monotonic() - t0 < 2
        # The stalled answers still arrive in full once their clients read, and the
        # connection then carries the next request.
        for s in stalled:
            assert _read_exactly(s, size) == size
        stalled[0].sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert stalled[0].recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for s in stalled:
            s.close()
        assert loop.shutdown(5)


def _refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=1).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # Queued on the listener just before it closed (a loaded machine): the close
        # resets it; the next attempt tells.
        return False
    return False


def test_shutdown_lets_an_answer_being_written_finish(monkeypatch):
    loop, size = _big_answer_loop(monkeypatch, threads=2)
    address = loop.address
    results: list[bool] = []

    def stop() -> None:
        results.append(loop.shutdown(5))

    with socket.create_connection(address, timeout=5) as s:
        s.sendall(b"GET /big HTTP/1.1\r\n\r\n")
        s.recv(1)  # the answer has started
        stopper = threading.Thread(name="test-shutdown", target=stop)
        stopper.start()
        try:
            # Accepting stops at once; the answer in flight is still delivered whole,
            # and then the connection closes.
            wait_until(lambda: _refused(address), 3)
            assert _read_exactly(s, size - 1) == size - 1
            assert s.recv(1) == b""
        finally:
            stopper.join(6)
    assert results == [True]
