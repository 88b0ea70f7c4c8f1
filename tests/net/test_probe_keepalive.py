"""The readyz probe's kept-alive TLS connection (ProbeConnections), against real loopback
TLS upstreams with CAs made at run time; the fake counts its TLS handshakes."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from extractedprism.checks.probes import ProbeConnections, ReadyzSettings, probe
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.upstream import FakeUpstream
from tests.util import wait_until

SERVER_NAME = "kubernetes.default.svc"
TIMEOUT = 1.0  # --health-timeout of these probes
SLACK = 0.5  # scheduling noise allowed past a deadline
N = 8

pytestmark = pytest.mark.timeout(60)


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
def conns() -> Iterator[ProbeConnections]:
    pc = ProbeConnections()
    yield pc
    pc.close()


def settings(ca_file: str, **kw: str) -> ReadyzSettings:
    kw.setdefault("server_name", SERVER_NAME)
    return ReadyzSettings(ca_file=ca_file, **kw)


def ready(result: ProbeResult) -> bool:
    return result.ok and result.ready is True


def test_probes_share_one_tls_connection(up: FakeUpstream, ca_file: str,
                                         conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    results = [conns.probe(up.endpoint, TIMEOUT, rz) for _ in range(N)]
    assert all(ready(r) for r in results), results
    assert up.hit_count("/readyz") == N
    assert up.handshakes == 1
    # Every probe still made its own TCP check: N connects, one of which carries TLS.
    # (the fake accepts a bare connect after the prober closed it: poll)
    wait_until(lambda: up.accepted == N, 5)
    assert up.accepted == N and up.handshakes == 1
    assert conns.opened() == {up.address: 1}
    assert all(h.get("connection") == "keep-alive"
               for h in (r.headers for r in up.requests_for("/readyz")))


def test_the_one_shot_probe_opens_one_per_probe(up: FakeUpstream, ca_file: str) -> None:
    # The contrast: what the kept connection saves.
    rz = settings(ca_file)
    assert all(ready(probe(up.endpoint, TIMEOUT, rz)) for _ in range(3))
    assert up.handshakes == 3


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_exactly_framed_answers_keep_the_connection(up: FakeUpstream, ca_file: str,
                                                    conns: ProbeConnections,
                                                    framing: str) -> None:
    up.set_readyz_framing(framing)
    rz = settings(ca_file)
    assert all(ready(conns.probe(up.endpoint, TIMEOUT, rz)) for _ in range(3))
    up.set_ready_status(500)  # a failing answer, framed, keeps it as well
    r = conns.probe(up.endpoint, TIMEOUT, rz)
    assert r.ok and r.ready is False and r.ready_reason == "HTTP 500"
    assert up.handshakes == 1


@pytest.mark.parametrize("framing", ["close", "close-header"])
def test_answers_that_end_the_connection_are_not_kept(up: FakeUpstream, ca_file: str,
                                                      conns: ProbeConnections,
                                                      framing: str) -> None:
    up.set_readyz_framing(framing)
    rz = settings(ca_file)
    assert all(ready(conns.probe(up.endpoint, TIMEOUT, rz)) for _ in range(3))
    assert up.handshakes == 3
    assert conns.opened() == {up.address: 3}


def test_kept_connection_that_stops_answering_fails_within_the_deadline(
        up: FakeUpstream, ca_file: str, conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    up.set_ready_hang(True)
    start = time.monotonic()
    r = conns.probe(up.endpoint, TIMEOUT, rz)
    took = time.monotonic() - start
    assert r.ok and r.ready is False and r.ready_reason == "timeout"
    assert took <= TIMEOUT + SLACK
    assert up.handshakes == 1  # the hung request went over the kept connection
    up.set_ready_hang(False)
    # The hung connection was closed by the prober, and the next probe uses a new one.
    wait_until(lambda: up.active_connections() == 0, 5)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2


def test_server_closing_the_idle_connection_is_no_failure(up: FakeUpstream, ca_file: str,
                                                          conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    up.close_connections()  # an idle timeout on the server
    wait_until(lambda: up.active_connections() == 0, 5)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2


def test_a_close_racing_the_request_gets_one_transparent_reconnect(
        up: FakeUpstream, ca_file: str, conns: ProbeConnections) -> None:
    # The server closes the kept connection, unanswered, as the request arrives (its idle
    # timeout and our request crossing): the probe reconnects once and passes.
    up.set_drop_after(1)
    rz = settings(ca_file)
    for expected_handshakes in (1, 2, 3):
        start = time.monotonic()
        assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
        assert time.monotonic() - start <= TIMEOUT + SLACK
        assert up.handshakes == expected_handshakes
    assert up.hit_count("/readyz") == 3


def test_a_new_connection_closed_before_the_answer_fails(up: FakeUpstream, ca_file: str,
                                                         conns: ProbeConnections) -> None:
    # Only a reused connection gets the reconnect: a server that closes new ones fails.
    up.set_drop_after(0)
    r = conns.probe(up.endpoint, TIMEOUT, settings(ca_file))
    assert r.ok and r.ready is False
    assert r.ready_reason == "connection closed before response"
    assert up.handshakes == 1


def test_rotated_ca_file_replaces_the_connection(up: FakeUpstream, ca: trustme.CA,
                                                 ca_file: str, conns: ProbeConnections
                                                 ) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    # A bundle with a second CA added (as during a CA rotation): still verifies.
    other = trustme.CA()
    Path(ca_file).write_bytes(ca.cert_pem.bytes() + other.cert_pem.bytes())
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2
    # The old CA gone: the connection made under it is not reused, the probe fails.
    Path(ca_file).write_bytes(other.cert_pem.bytes())
    r = conns.probe(up.endpoint, TIMEOUT, rz)
    assert r.ready is False and r.ready_reason.startswith("TLS verify failed")
    assert up.handshakes == 2


def test_rotated_client_certificate_replaces_the_connection(ca: trustme.CA, ca_file: str,
                                                            tmp_path: Path,
                                                            conns: ProbeConnections) -> None:
    client_ca = trustme.CA()
    cert = tmp_path / "client.pem"
    client_ca.issue_cert("node-a", common_name="system:node:a").private_key_and_cert_chain_pem \
        .write_to_path(str(cert))
    with FakeUpstream(ca=ca, name="mtls", client_ca=client_ca,
                      require_client_cert=True) as up:
        rz = settings(ca_file, cert_file=str(cert))
        assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
        assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
        assert up.handshakes == 1
        client_ca.issue_cert("node-a", common_name="system:node:a2") \
            .private_key_and_cert_chain_pem.write_to_path(str(cert))
        assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
        assert up.handshakes == 2
        assert up.client_cns() == ["system:node:a", "system:node:a", "system:node:a2"]


def test_changed_token_replaces_the_connection(up: FakeUpstream, ca_file: str,
                                               tmp_path: Path,
                                               conns: ProbeConnections) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    rz = settings(ca_file, token_file=str(token))
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    token.write_text("second")
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2
    assert up.authorizations() == ["Bearer first", "Bearer first", "Bearer second"]


def test_a_missing_credential_fails_and_drops_the_connection(up: FakeUpstream, ca: trustme.CA,
                                                             ca_file: str,
                                                             conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    Path(ca_file).unlink()
    r = conns.probe(up.endpoint, TIMEOUT, rz)
    assert r.ready is False and r.ready_reason == f"CA file missing: {ca_file}"
    wait_until(lambda: up.active_connections() == 0, 5)  # closed at once
    ca.cert_pem.write_to_path(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2


def test_retain_closes_the_connection_of_a_removed_upstream(ca: trustme.CA, ca_file: str,
                                                            conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    with FakeUpstream(ca=ca, name="a") as a, FakeUpstream(ca=ca, name="b") as b:
        assert ready(conns.probe(a.endpoint, TIMEOUT, rz))
        assert ready(conns.probe(b.endpoint, TIMEOUT, rz))
        wait_until(lambda: a.active_connections() == 1 and b.active_connections() == 1, 5)
        conns.retain({b.address})
        wait_until(lambda: a.active_connections() == 0, 5)
        assert b.active_connections() == 1
        assert conns.opened() == {b.address: 1}
        conns.close()
        wait_until(lambda: b.active_connections() == 0, 5)
        # After close, probes still work and keep nothing.
        assert ready(conns.probe(b.endpoint, TIMEOUT, rz))
        wait_until(lambda: b.active_connections() == 0, 5)


def test_retire_while_a_probe_holds_the_connection(up: FakeUpstream, ca_file: str,
                                                   conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    up.set_ready_hang(True)
    out: list[ProbeResult] = []
    t = threading.Thread(target=lambda: out.append(conns.probe(up.endpoint, 5.0, rz)),
                         name="test-probe")
    t.start()
    wait_until(lambda: up.hit_count("/readyz") == 2, 5)
    conns.retain(set())  # removed while its probe is out
    up.set_ready_hang(False)
    t.join(10)
    assert ready(out[0])
    # The probe handed the connection back to a retired holder, which closed it.
    wait_until(lambda: up.active_connections() == 0, 5)


def test_two_probes_of_one_upstream_never_share_the_connection(up: FakeUpstream, ca_file: str,
                                                               conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    up.set_ready_hang(True)
    out: list[ProbeResult] = []
    first = threading.Thread(target=lambda: out.append(conns.probe(up.endpoint, 5.0, rz)),
                             name="test-probe-1")
    first.start()
    wait_until(lambda: up.hit_count("/readyz") == 2, 5)
    second = threading.Thread(target=lambda: out.append(conns.probe(up.endpoint, 5.0, rz)),
                              name="test-probe-2")
    second.start()
    wait_until(lambda: up.hit_count("/readyz") == 3, 5)
    assert up.handshakes == 2  # the second one opened its own
    up.set_ready_hang(False)
    first.join(10)
    second.join(10)
    assert len(out) == 2 and all(ready(r) for r in out)
    # The second one's connection was not kept; the first one's still is.
    wait_until(lambda: up.active_connections() == 1, 5)
    assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
    assert up.handshakes == 2
    assert conns.opened() == {up.address: 2}


def test_reuse_with_descriptors_past_1024(up: FakeUpstream, ca_file: str,
                                          conns: ProbeConnections) -> None:
    # A busy proxy's sockets have descriptors past select()'s 1024: the idle check of a
    # kept connection must still work there (else every probe opens a new one).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    fillers: list[int] = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        rz = settings(ca_file)
        assert all(ready(conns.probe(up.endpoint, TIMEOUT, rz)) for _ in range(3))
        assert up.handshakes == 1
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_failed_tcp_check_drops_the_kept_connection(ca: trustme.CA, ca_file: str,
                                                      conns: ProbeConnections) -> None:
    rz = settings(ca_file)
    with FakeUpstream(ca=ca, name="gone") as up:
        assert ready(conns.probe(up.endpoint, TIMEOUT, rz))
        up.close_listener()  # refuses new connections; the kept one is still open
        r = conns.probe(up.endpoint, TIMEOUT, rz)
        assert not r.ok and r.reason == "connection refused"
        wait_until(lambda: up.active_connections() == 0, 5)
