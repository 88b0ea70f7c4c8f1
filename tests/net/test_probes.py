"""probe(): TCP and readyz checks against real loopback servers with a run-time trustme CA."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from extractedprism import probes
from extractedprism.endpoints import Endpoint
from extractedprism.probes import ProbeResult, ReadyzSettings, probe
from tests.fakes.upstream import FakeUpstream

SERVER_NAME = "kubernetes.default.svc"
SLACK = 0.5  # scheduling noise allowed past a deadline


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


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

    monkeypatch.setattr(probes, "_read_status", boom)  # the unexpected-error path logs
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
