"""probe(): TCP and readyz checks against real loopback servers with a run-time trustme CA."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from extractedprism.checks import probes
from extractedprism.checks.probes import ReadyzSettings, probe
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.upstream import FakeUpstream, _Server
from tests.util import read_head

SERVER_NAME = "kubernetes.default.svc"
SLACK = 0.5  # scheduling noise allowed past a deadline


@pytest.fixture(scope="module")
def client_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
def up(ca: trustme.CA) -> Iterator[FakeUpstream]:
    with FakeUpstream(ca=ca, name="up1") as u:
        yield u


@pytest.fixture
def mtls_up(ca: trustme.CA, client_ca: trustme.CA) -> Iterator[FakeUpstream]:
    with FakeUpstream(ca=ca, name="mtls", client_ca=client_ca, require_client_cert=True) as u:
        yield u


def settings(ca_file: str, **kw: str) -> ReadyzSettings:
    kw.setdefault("server_name", SERVER_NAME)
    return ReadyzSettings(ca_file=ca_file, **kw)


def timed(endpoint: Endpoint, timeout: float, rz: ReadyzSettings | None = None
          ) -> tuple[ProbeResult, float]:
    start = time.monotonic()
    result = probe(endpoint, timeout, rz)
    return result, time.monotonic() - start


@pytest.fixture
def stalled_listener() -> Iterator[socket.socket]:
    """Listens but never accepts: the TCP handshake completes through the backlog, then
    nothing ever answers (a TLS handshake or request stalls)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s
    s.close()


@pytest.fixture
def full_backlog() -> Iterator[socket.socket]:
    """A loopback listener with backlog 0 whose queue is full: further SYNs are dropped,
    so a connect times out (no non-loopback tricks)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    fillers = []
    try:
        for _ in range(3):
            s = socket.socket()
            fillers.append(s)
            s.settimeout(0.2)
            try:
                s.connect(lst.getsockname())
            except TimeoutError:
                break  # the queue is full now
        else:
            pytest.skip("could not fill the accept backlog on this kernel")
        yield lst
    finally:
        for s in fillers:
            s.close()
        lst.close()


# --- TCP -----------------------------------------------------------------------

def test_tcp_ok(up: FakeUpstream) -> None:
    r = probe(up.endpoint, 2.0)
    assert r.ok and r.reason == "" and r.ready is None and r.ready_reason == ""
    assert r.rtt is not None and 0 < r.rtt < 2.0


def test_tcp_refused() -> None:
    with socket.socket() as bound:  # bound, never listening
        bound.bind(("127.0.0.1", 0))
        r = probe(Endpoint("127.0.0.1", bound.getsockname()[1]), 2.0)
    assert r == ProbeResult(False, None, "connection refused")


def test_tcp_timeout_respects_deadline(full_backlog: socket.socket) -> None:
    r, took = timed(Endpoint("127.0.0.1", full_backlog.getsockname()[1]), 0.4)
    assert r == ProbeResult(False, None, "timeout")
    assert 0.35 <= took < 0.4 + SLACK


def test_tcp_failure_with_readyz_leaves_ready_unset(ca_file: str) -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        r = probe(Endpoint("127.0.0.1", bound.getsockname()[1]), 2.0, settings(ca_file))
    assert not r.ok and r.ready is None


def test_hostname_endpoint_resolves(up: FakeUpstream) -> None:
    # "localhost" comes from /etc/hosts; ::1 may refuse first, 127.0.0.1 then answers.
    r = probe(Endpoint("localhost", up.port), 2.0)
    assert r.ok and r.rtt is not None


def test_name_resolution_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kw: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(probes.socket, "getaddrinfo", fail)  # no real DNS traffic
    r = probe(Endpoint("api.example.internal", 6443), 1.0)
    assert not r.ok and r.reason == "name resolution failed: Name or service not known"


def test_slow_resolver_counts_against_deadline(monkeypatch: pytest.MonkeyPatch,
                                               up: FakeUpstream) -> None:
    real = socket.getaddrinfo

    def slow(*args: object, **kw: object) -> object:
        time.sleep(0.3)  # the resolver itself is the slow part under test
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(probes.socket, "getaddrinfo", slow)
    assert probe(Endpoint("localhost", up.port), 0.2).reason == "timeout"
    r = probe(Endpoint("localhost", up.port), 2.0)
    assert r.ok and r.rtt is not None and r.rtt >= 0.3  # rtt includes resolution


# --- readyz ----------------------------------------------------------------------

def test_readyz_200_ready(up: FakeUpstream, ca_file: str) -> None:
    r = probe(up.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is True and r.ready_reason == ""
    [req] = up.requests_for("/readyz")
    assert req.method == "GET" and req.headers["host"] == SERVER_NAME
    assert req.headers["connection"] == "close" and "authorization" not in req.headers


@pytest.mark.parametrize("status", [500, 503, 401, 404])
def test_readyz_non_200_not_ready(up: FakeUpstream, ca_file: str, status: int) -> None:
    up.set_ready_status(status)
    r = probe(up.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False and r.ready_reason == f"HTTP {status}"


def test_readyz_redirect_not_followed(up: FakeUpstream, ca_file: str) -> None:
    up.set_ready_status(302)
    r = probe(up.endpoint, 2.0, settings(ca_file))
    assert r.ready is False and r.ready_reason == "HTTP 302"
    assert up.hit_count("/readyz") == 1 and up.hit_count("/readyz/elsewhere") == 0


def test_readyz_wrong_ca(up: FakeUpstream, tmp_path: Path) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    r = probe(up.endpoint, 2.0, settings(str(other)))
    assert r.ok and r.ready is False
    assert r.ready_reason.startswith("TLS verify failed:"), r.ready_reason
    assert up.hit_count("/readyz") == 0


def test_readyz_wrong_server_name(up: FakeUpstream, ca_file: str) -> None:
    r = probe(up.endpoint, 2.0, settings(ca_file, server_name="other.example"))
    assert r.ready is False
    assert r.ready_reason.startswith("TLS verify failed:"), r.ready_reason
    assert "other.example" in r.ready_reason or "mismatch" in r.ready_reason.lower()


def test_readyz_sni_is_server_name(ca: trustme.CA, ca_file: str) -> None:
    # The serving cert only names "api.internal": SNI/verification use server_name, not
    # the dialled IP.
    with FakeUpstream(ca=ca, server_names=("api.internal",)) as u:
        assert probe(u.endpoint, 2.0, settings(ca_file, server_name="api.internal")).ready
        assert probe(u.endpoint, 2.0, settings(ca_file)).ready is False


def test_readyz_plaintext_server_is_tls_error(ca_file: str) -> None:
    with FakeUpstream(tls=False) as u:
        r = probe(u.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False and r.ready_reason.startswith("TLS error:"), r


def test_readyz_missing_ca_file(up: FakeUpstream, tmp_path: Path) -> None:
    path = str(tmp_path / "nope.pem")
    r = probe(up.endpoint, 2.0, settings(path))
    assert r.ok and r.ready is False and r.ready_reason == f"CA file missing: {path}"


def test_readyz_handshake_stall_respects_deadline(stalled_listener: socket.socket,
                                                  ca_file: str) -> None:
    ep = Endpoint("127.0.0.1", stalled_listener.getsockname()[1])
    r, took = timed(ep, 0.4, settings(ca_file))
    assert r.ok and r.ready is False and r.ready_reason == "timeout"
    assert took < 0.4 + SLACK


def test_readyz_server_never_answers_respects_deadline(up: FakeUpstream, ca_file: str
                                                       ) -> None:
    up.set_ready_hang(True)
    r, took = timed(up.endpoint, 0.5, settings(ca_file))
    assert r.ok and r.ready is False and r.ready_reason == "timeout"
    assert took < 0.5 + SLACK
    assert up.hit_count("/readyz") == 1  # the request did arrive


# --- credentials ----------------------------------------------------------------------

def write_client_cert(client_ca: trustme.CA, cn: str, cert_path: Path,
                      key_path: Path | None = None) -> None:
    identity = cn.replace(":", "-") + ".client.test"  # SAN must be a DNS name; CN is free
    leaf = client_ca.issue_cert(identity, common_name=cn)
    if key_path is None:
        leaf.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    else:
        leaf.cert_chain_pems[0].write_to_path(str(cert_path))
        leaf.private_key_pem.write_to_path(str(key_path))


def test_client_cert_required_without_one(mtls_up: FakeUpstream, ca_file: str) -> None:
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False
    assert r.ready_reason.startswith(("TLS error:", "connection reset")), r.ready_reason


def test_client_cert_rotation_combined_file(mtls_up: FakeUpstream, client_ca: trustme.CA,
                                            ca_file: str, tmp_path: Path) -> None:
    pem = tmp_path / "kubelet-client-current.pem"  # cert and key in one file
    rz = settings(ca_file, cert_file=str(pem), key_file=str(pem))
    write_client_cert(client_ca, "system:node:a", pem)
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    write_client_cert(client_ca, "system:node:b", pem)  # rotated on disk, no restart
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    assert mtls_up.client_cns() == ["system:node:a", "system:node:b"]


def test_client_cert_rotation_separate_files(mtls_up: FakeUpstream, client_ca: trustme.CA,
                                             ca_file: str, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    rz = settings(ca_file, cert_file=str(cert), key_file=str(key))
    write_client_cert(client_ca, "one", cert, key)
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    write_client_cert(client_ca, "two", cert, key)
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    assert mtls_up.client_cns() == ["one", "two"]


def test_client_cert_missing_fails_probe_not_raise(mtls_up: FakeUpstream, ca_file: str,
                                                   client_ca: trustme.CA,
                                                   tmp_path: Path) -> None:
    pem = tmp_path / "later.pem"
    rz = settings(ca_file, cert_file=str(pem))
    r = probe(mtls_up.endpoint, 2.0, rz)
    assert r.ok and r.ready is False
    assert r.ready_reason == f"client certificate missing: {pem}"
    write_client_cert(client_ca, "late", pem)  # appears later: picked up
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True


def test_client_cert_garbage(mtls_up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    pem = tmp_path / "bad.pem"
    pem.write_text("not a certificate\n")
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(pem)))
    assert r.ready is False and r.ready_reason.startswith("client certificate unusable:")


def test_token_rotation(up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    rz = settings(ca_file, token_file=str(token))
    token.write_text("first-token\n")
    assert probe(up.endpoint, 2.0, rz).ready is True
    token.write_text("second-token")
    assert probe(up.endpoint, 2.0, rz).ready is True
    assert up.authorizations() == ["Bearer first-token", "Bearer second-token"]


def test_token_missing_empty_or_multiline(up: FakeUpstream, ca_file: str,
                                          tmp_path: Path) -> None:
    token = tmp_path / "token"
    r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))
    assert r.ok and r.ready is False and r.ready_reason == f"token file missing: {token}"
    token.write_text("  \n")
    r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))
    assert r.ready is False and r.ready_reason == f"token file empty: {token}"
    token.write_text("abc\nInjected: header\n")
    r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))
    assert r.ready is False and r.ready_reason.startswith("token file invalid:")
    assert up.hit_count("/readyz") == 0  # nothing was sent without the credential


def test_token_and_client_cert_together(mtls_up: FakeUpstream, client_ca: trustme.CA,
                                        ca_file: str, tmp_path: Path) -> None:
    pem, token = tmp_path / "c.pem", tmp_path / "t"
    write_client_cert(client_ca, "both", pem)
    token.write_text("tok")
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(pem),
                                                token_file=str(token)))
    assert r.ready is True
    [req] = mtls_up.requests_for("/readyz")
    assert req.client_cn == "both" and req.authorization == "Bearer tok"


def test_token_never_logged(up: FakeUpstream, ca_file: str, tmp_path: Path,
                            caplog: pytest.LogCaptureFixture,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-t0ken-value"
    token = tmp_path / "token"
    token.write_text(secret)
    caplog.set_level(logging.DEBUG)
    up.set_ready_status(500)
    results = [probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))]

    def boom(*args: object, **kw: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(probes, "_read_head", boom)  # the unexpected-error path logs
    results.append(probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token))))
    assert results[1].ready is False and results[1].ready_reason.startswith("unexpected error")
    # The logging path did run (with its traceback), so the check below looks at something.
    assert "readyz probe unexpected error" in caplog.text and "Traceback" in caplog.text
    assert secret not in caplog.text
    assert all(secret not in repr(r) for r in results)


def test_probe_never_raises(monkeypatch: pytest.MonkeyPatch, up: FakeUpstream) -> None:
    def boom(*args: object, **kw: object) -> None:
        raise RuntimeError("resolver bug")

    monkeypatch.setattr(probes, "_resolve", boom)
    r = probe(up.endpoint, 1.0)
    assert not r.ok and r.reason == "unexpected error: RuntimeError: resolver bug"


def test_ipv6_loopback(ca: trustme.CA, ca_file: str) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        u = FakeUpstream(host="::1", ca=ca).start()
    except OSError:
        pytest.skip("::1 not available")
    try:
        r = probe(u.endpoint, 2.0, settings(ca_file))
        assert r.ok and r.ready is True
    finally:
        u.stop()


# --- bad input: server side -----------------------------------------------------------

Behaviour = Callable[[ssl.SSLSocket, threading.Event], None]


class ScriptedTLSServer(_Server):
    """TLS on loopback that reads the request head, then lets ``behaviour`` answer with
    raw bytes (or not at all): responses no well-behaved server would send."""

    def __init__(self, behaviour: Behaviour, *, cert: trustme.LeafCert | None = None,
                 ca: trustme.CA | None = None) -> None:
        super().__init__("scripted")
        self.behaviour = behaviour
        self.heads: list[bytes] = []  # request heads received, in order
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if cert is None:
            assert ca is not None
            cert = ca.issue_cert(SERVER_NAME)
        cert.configure_cert(self.ctx)

    def handle(self, conn: socket.socket, peer: Any) -> None:
        conn.settimeout(5.0)
        tls = self.ctx.wrap_socket(conn, server_side=True)
        self._track_swap(conn, tls)
        try:
            head = read_head(tls)
            if head is None:
                return
            self.heads.append(head)
            self.behaviour(tls, self.closing)
        finally:
            tls.close()


@contextlib.contextmanager
def scripted(behaviour: Behaviour, **kw: Any) -> Iterator[ScriptedTLSServer]:
    srv = ScriptedTLSServer(behaviour, **kw).start()
    try:
        yield srv
    finally:
        srv.stop()


def readyz_gives_up_in_time(answer: Behaviour, ca: trustme.CA, ca_file: str,
                            timeout: float) -> None:
    """Against a server scripted by ``answer``, /readyz says "timeout" within ``timeout``."""
    with scripted(answer, ca=ca) as srv:
        (r, took) = timed(srv.endpoint, timeout, settings(ca_file))
    assert r.ready is False and r.ready_reason == "timeout"
    assert took < timeout + SLACK


def reset(tls: ssl.SSLSocket) -> None:
    """Close with a RST instead of a FIN."""
    tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    tls.close()


def test_readyz_status_line_then_close_fails(ca: trustme.CA, ca_file: str) -> None:
    # Before: the bare status line counted as ready although the response was cut off.
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\n")
        closing.wait(0.2)  # the probe has read the status line by then
        socket.socket.shutdown(tls, socket.SHUT_RDWR)  # FIN without close_notify

    with scripted(answer, ca=ca) as srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False
    assert r.ready_reason == "connection closed before end of response headers", r


def test_readyz_status_line_then_reset_fails(ca: trustme.CA, ca_file: str) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200\r\n")
        closing.wait(0.2)
        reset(tls)

    with scripted(answer, ca=ca) as srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False
    assert r.ready_reason in ("connection closed before end of response headers",
                              "connection reset", "connection closed before response"), r


def test_readyz_status_line_then_silence_respects_deadline(ca: trustme.CA, ca_file: str
                                                           ) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n")
        closing.wait(30)

    readyz_gives_up_in_time(answer, ca, ca_file, 0.5)


def test_readyz_status_200_then_reset_in_body_is_ready(ca: trustme.CA, ca_file: str) -> None:
    # The head is complete: like an HTTP client, the body does not matter.
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nok")
        closing.wait(0.2)
        reset(tls)

    with scripted(answer, ca=ca) as srv:
        assert probe(srv.endpoint, 2.0, settings(ca_file)).ready is True


def test_readyz_ipv6_server_name_is_bracketed_in_host(ca: trustme.CA, ca_file: str) -> None:
    # RFC 9110 7.2: an IPv6 literal in Host goes in brackets ("Host: ::1" is malformed).
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with scripted(answer, cert=ca.issue_cert("::1")) as srv:
        assert probe(srv.endpoint, 2.0, settings(ca_file, server_name="::1")).ready is True
        assert b"\r\nHost: [::1]\r\n" in srv.heads[0], srv.heads


def test_readyz_http10_without_content_length(ca: trustme.CA, ca_file: str) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.0 200 OK\r\n\r\nok")

    with scripted(answer, ca=ca) as srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ready is True and r.ready_reason == ""


def test_readyz_bare_lf_head_is_accepted(ca: trustme.CA, ca_file: str) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 503 Service Unavailable\nContent-Length: 0\n\n")

    with scripted(answer, ca=ca) as srv:
        assert probe(srv.endpoint, 2.0, settings(ca_file)).ready_reason == "HTTP 503"


@pytest.mark.parametrize("drip", [False, True], ids=["huge-body", "slow-drip-body"])
def test_readyz_body_is_never_read(ca: trustme.CA, ca_file: str, drip: bool) -> None:
    sent = [0]

    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        while not closing.is_set() and sent[0] < 1_000_000_000:
            tls.sendall(b"x" if drip else b"x" * 65536)
            sent[0] += 1 if drip else 65536
            if drip:
                closing.wait(0.05)

    with scripted(answer, ca=ca) as srv:
        (r, took) = timed(srv.endpoint, 2.0, settings(ca_file))
    assert r.ready is True and took < 1.0, (r, took)


def test_readyz_slow_drip_head_respects_deadline(ca: trustme.CA, ca_file: str) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 1000:
            tls.sendall(bytes([byte]))
            if closing.wait(0.02):
                return

    readyz_gives_up_in_time(answer, ca, ca_file, 0.5)


def test_readyz_endless_headers_bounded(ca: trustme.CA, ca_file: str) -> None:
    def answer(tls: ssl.SSLSocket, closing: threading.Event) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\n")
        with contextlib.suppress(OSError):
            while not closing.is_set():
                tls.sendall(b"X-Filler: " + b"z" * 1000 + b"\r\n")

    with scripted(answer, ca=ca) as srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ready is False and r.ready_reason == "malformed response: headers too long"


@pytest.mark.parametrize(("when", "message"), [
    ("expired", "certificate has expired"),
    ("not-yet-valid", "certificate is not yet valid"),
])
def test_readyz_server_cert_validity(ca: trustme.CA, ca_file: str, when: str,
                                     message: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    window = ({"not_before": now - 2 * day, "not_after": now - day} if when == "expired"
              else {"not_before": now + day, "not_after": now + 2 * day})
    cert = ca.issue_cert(SERVER_NAME, **window)
    with scripted(lambda tls, closing: None, cert=cert) as srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False and r.ready_reason == f"TLS verify failed: {message}"


def test_readyz_self_signed_server_cert(ca_file: str) -> None:
    other = trustme.CA()  # its certificate is self-signed; serve it as the leaf
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with other.cert_pem.tempfile() as cert, other.private_key_pem.tempfile() as key:
        ctx.load_cert_chain(cert, key)
    srv = ScriptedTLSServer(lambda tls, closing: None, ca=other)
    srv.ctx = ctx
    with srv:
        r = probe(srv.endpoint, 2.0, settings(ca_file))
    assert r.ok and r.ready is False
    assert r.ready_reason == "TLS verify failed: self-signed certificate", r


def test_readyz_invalid_server_name_fails_cleanly(up: FakeUpstream, ca_file: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # Before: "unexpected error: UnicodeError ..." plus a traceback on every probe.
    caplog.set_level(logging.DEBUG)
    r = probe(up.endpoint, 2.0, settings(ca_file, server_name="api..example"))
    assert r.ok and r.ready is False
    assert r.ready_reason == "invalid server name 'api..example': label empty or too long"
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


# --- bad input: CA file -----------------------------------------------------------------

@pytest.mark.parametrize(("content", "why"), [
    (b"", "no PEM certificate found"),
    (b"not a certificate\n", "no PEM certificate found"),
    (os.urandom(2048), "no PEM certificate found"),
    ("key-only", "no PEM certificate found"),
], ids=["empty", "text", "binary", "key-only"])
def test_readyz_ca_file_not_a_ca(up: FakeUpstream, ca: trustme.CA, tmp_path: Path,
                                 content: bytes | str, why: str) -> None:
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.private_key_pem.bytes() if content == "key-only" else content)
    r = probe(up.endpoint, 2.0, settings(str(path)))
    assert r.ok and r.ready is False and r.ready_reason == f"CA file unusable: {path}: {why}"
    assert probes.ca_file_problem(str(path)) == r.ready_reason


def test_readyz_ca_file_is_a_directory(up: FakeUpstream, tmp_path: Path) -> None:
    r = probe(up.endpoint, 2.0, settings(str(tmp_path)))
    assert r.ready is False and r.ready_reason == f"CA file unusable: {tmp_path}: is a directory"


def test_readyz_ca_file_below_a_file(up: FakeUpstream, ca_file: str) -> None:
    path = f"{ca_file}/ca.pem"  # ENOTDIR: like EACCES, an error other than "missing"
    r = probe(up.endpoint, 2.0, settings(path))
    assert r.ready is False and r.ready_reason == f"CA file unreadable: {path}: Not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_readyz_ca_file_unreadable(up: FakeUpstream, ca_file: str) -> None:
    os.chmod(ca_file, 0)
    r = probe(up.endpoint, 2.0, settings(ca_file))
    assert r.ready is False
    assert r.ready_reason == f"CA file unusable: {ca_file}: Permission denied", r


def test_readyz_ca_file_matches_nothing(up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    # A valid CA that signed nothing here: verification, not loading, fails.
    other = tmp_path / "other.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    assert probes.ca_file_problem(str(other)) == ""
    r = probe(up.endpoint, 2.0, settings(str(other)))
    assert r.ready_reason == "TLS verify failed: unable to get local issuer certificate"


def probe_in_thread(endpoint: Endpoint, rz: ReadyzSettings, fifo: Path
                    ) -> ProbeResult | None:
    """Probe with a FIFO among the files; None if the probe is still blocked after 3 s
    (then it is unblocked by opening the FIFO's other end, so no thread is left)."""
    out: list[ProbeResult] = []
    t = threading.Thread(name="test-probe-fifo", target=lambda: out.append(
        probe(endpoint, 1.0, rz)), daemon=True)
    t.start()
    t.join(3.0)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # EOF for the blocked reader
        os.close(fd)
        t.join(5.0)
        return None
    return out[0]


def test_readyz_ca_file_fifo_does_not_block(up: FakeUpstream, tmp_path: Path) -> None:
    # Before: OpenSSL's fopen() of a FIFO without a writer blocked the probe forever.
    fifo = tmp_path / "ca.pem"
    os.mkfifo(fifo)
    r = probe_in_thread(up.endpoint, settings(str(fifo)), fifo)
    assert r is not None, "probe blocked on a FIFO CA file"
    assert r.ready is False and r.ready_reason == f"CA file unusable: {fifo}: not a regular file"


# --- bad input: client certificate and key -------------------------------------------------

@pytest.fixture
def client_pair(client_ca: trustme.CA, tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_client_cert(client_ca, "pair", cert, key)
    return cert, key


def test_client_key_missing_names_the_key(mtls_up: FakeUpstream, ca_file: str,
                                          client_pair: tuple[Path, Path]) -> None:
    # Before: "client certificate missing: <the cert path>", which exists.
    cert, key = client_pair
    key.unlink()
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(key)))
    assert r.ok and r.ready is False and r.ready_reason == f"client key missing: {key}"


@pytest.mark.parametrize(("content", "why"), [
    (b"garbage\n", "no PEM private key found"),
    (b"", "no PEM private key found"),
    ("cert", "no PEM private key found"),
    ("other-key", "does not match the client certificate {cert}"),
], ids=["garbage", "empty", "cert-instead-of-key", "mismatch"])
def test_client_key_unusable_names_the_key(mtls_up: FakeUpstream, ca_file: str,
                                           client_ca: trustme.CA,
                                           client_pair: tuple[Path, Path],
                                           content: bytes | str, why: str) -> None:
    cert, key = client_pair
    if content == "cert":
        key.write_bytes(cert.read_bytes())
    elif content == "other-key":
        key.write_bytes(client_ca.issue_cert("other.client.test").private_key_pem.bytes())
    else:
        assert isinstance(content, bytes)
        key.write_bytes(content)
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(key)))
    assert r.ok and r.ready is False
    assert r.ready_reason == f"client key unusable: {key}: " + why.format(cert=cert), r


def test_client_key_encrypted(mtls_up: FakeUpstream, ca_file: str,
                              client_pair: tuple[Path, Path]) -> None:
    from cryptography.hazmat.primitives import serialization

    cert, key = client_pair
    plain = serialization.load_pem_private_key(key.read_bytes(), None)
    key.write_bytes(plain.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.BestAvailableEncryption(b"secret")))
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(key)))
    assert r.ok and r.ready is False
    assert r.ready_reason == (f"client key unusable: {key}: encrypted; a passphrase is not "
                              "supported")


@pytest.mark.parametrize("content", [b"not a certificate\n", b"", "key"],
                         ids=["garbage", "empty", "key-instead-of-cert"])
def test_client_cert_unusable_names_the_cert(mtls_up: FakeUpstream, ca_file: str,
                                             client_pair: tuple[Path, Path],
                                             content: bytes | str) -> None:
    cert, key = client_pair
    cert.write_bytes(key.read_bytes() if content == "key" else content)  # type: ignore[arg-type]
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(key)))
    assert r.ready is False
    assert r.ready_reason == f"client certificate unusable: {cert}: no PEM certificate found"


def test_client_cert_combined_file_without_key(mtls_up: FakeUpstream, ca_file: str,
                                               client_pair: tuple[Path, Path]) -> None:
    cert, _key = client_pair  # the certificate alone, given as both cert and key
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(cert)))
    assert r.ready_reason == f"client key unusable: {cert}: no PEM private key found"


def test_client_cert_or_key_is_a_directory(mtls_up: FakeUpstream, ca_file: str,
                                           client_pair: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    cert, key = client_pair
    d = tmp_path / "dir"
    d.mkdir()
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(d), key_file=str(key)))
    assert r.ready_reason == f"client certificate unusable: {d}: is a directory"
    r = probe(mtls_up.endpoint, 2.0, settings(ca_file, cert_file=str(cert), key_file=str(d)))
    assert r.ready_reason == f"client key unusable: {d}: is a directory"


def test_client_pair_appears_and_rotates(mtls_up: FakeUpstream, ca_file: str,
                                         client_ca: trustme.CA, tmp_path: Path) -> None:
    cert, key = tmp_path / "late.crt", tmp_path / "late.key"
    rz = settings(ca_file, cert_file=str(cert), key_file=str(key))
    assert probe(mtls_up.endpoint, 2.0, rz).ready_reason == f"client certificate missing: {cert}"
    write_client_cert(client_ca, "late-1", cert, key)
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    write_client_cert(client_ca, "late-2", cert, key)  # a whole new pair
    assert probe(mtls_up.endpoint, 2.0, rz).ready is True
    assert mtls_up.client_cns() == ["late-1", "late-2"]


# --- bad input: token file ------------------------------------------------------------------

def test_token_whitespace_trimmed(up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b" \t abc.def-ghi \r\n\n")
    assert probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token))).ready is True
    assert up.authorizations() == ["Bearer abc.def-ghi"]


@pytest.mark.parametrize(("content", "why"), [
    (b"a" * (64 * 1024 + 1), "larger than 64 KiB"),
    (b"\xff\xfe\x00garbage\x80", "not UTF-8 text"),
    (b"tok\x01en", "contains a control character"),
    (b"tok\x00en", "contains a control character"),
    ("t\u00f6ken".encode(), "contains a non-ASCII character"),
    (b"abc\r\nX-Injected: yes", "more than one line"),
    (b"abc\rX-Injected: yes", "more than one line"),
], ids=["huge", "binary", "control", "nul", "non-ascii", "crlf", "cr"])
def test_token_invalid_is_never_sent(up: FakeUpstream, ca_file: str, tmp_path: Path,
                                     content: bytes, why: str) -> None:
    # Before: a huge token was cut to 64 KiB and sent, control characters went out in
    # the header, non-ASCII was sent as latin-1 ("?" when not even that).
    token = tmp_path / "token"
    token.write_bytes(content)
    r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))
    assert r.ok and r.ready is False and r.ready_reason == f"token file invalid: {token}: {why}"
    assert up.hit_count("/readyz") == 0


def test_token_file_largest_allowed(up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"b" * 8192 + b"\n")
    assert probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token))).ready is True
    assert up.authorizations() == ["Bearer " + "b" * 8192]


def test_token_file_is_a_directory(up: FakeUpstream, ca_file: str, tmp_path: Path) -> None:
    r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(tmp_path)))
    assert r.ready_reason == f"token file unusable: {tmp_path}: is a directory"


def test_token_file_fifo_does_not_block(up: FakeUpstream, ca_file: str, tmp_path: Path
                                        ) -> None:
    # Before: open() of a FIFO without a writer blocked the probe thread forever.
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    r = probe_in_thread(up.endpoint, settings(ca_file, token_file=str(fifo)), fifo)
    assert r is not None, "probe blocked on a FIFO token file"
    assert r.ready_reason == f"token file unusable: {fifo}: not a regular file"


def test_token_reasons_never_contain_the_token(up: FakeUpstream, ca_file: str,
                                               tmp_path: Path) -> None:
    secret = "s3cr3t-" + "q" * 40
    token = tmp_path / "token"
    for content in (secret + "\x01", secret + "\nmore", secret + "\u00e9", secret * 2000):
        token.write_text(content)
        r = probe(up.endpoint, 2.0, settings(ca_file, token_file=str(token)))
        assert r.ready is False and secret not in r.ready_reason


# --- issue 37, finding 10: a file named with a NUL byte ------------------------------


@pytest.mark.parametrize(("field", "what"), [("ca_file", "CA file"),
                                             ("token_file", "token file")])
def test_a_credential_path_with_a_nul_byte_fails_the_probe_naming_it(
        up: FakeUpstream, ca_file: str, field: str, what: str) -> None:
    # Not "unexpected error: ValueError: embedded null byte" with a traceback logged: the
    # one reason every other unusable file gets, naming the file.
    bad = "/etc/kube\0rnetes/x"
    rz = settings(bad if field == "ca_file" else ca_file,
                  **({} if field == "ca_file" else {field: bad}))
    r = probe(up.endpoint, 2.0, rz)
    assert r.ok and r.ready is False
    assert r.ready_reason == f"{what} unusable: /etc/kube\\x00rnetes/x: the path contains a " \
                             "NUL byte"
