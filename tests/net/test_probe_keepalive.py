"""The readyz probe's kept-alive TLS connection (ProbeConnections), against real loopback
TLS upstreams with CAs made at run time; the fake counts its TLS handshakes."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from extractedprism.checks import probes
from extractedprism.checks.probes import ProbeConnections, ReadyzSettings, probe
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.state import ProbeResult
from tests.fakes.upstream import FakeUpstream
from tests.util import wait_until

SERVER_NAME = "kubernetes.default.svc"
TIMEOUT = 1.0  # --health-timeout of these probes
SLACK = 0.5  # scheduling noise allowed past a deadline
N = 8
LONG = 3600.0  # a kept connection's max age no test reaches

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
    pc = ProbeConnections(max_age=LONG)
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


# --- a kept connection judges what a new one would get (issue 37, finding 4) ---------


def test_a_kept_connection_is_replaced_at_its_max_age(up: FakeUpstream, ca_file: str) -> None:
    now = [100.0]
    pc = ProbeConnections(max_age=60.0, clock=lambda: now[0])
    rz = settings(ca_file)
    try:
        for _ in range(12):  # ages 0, 5, ..., 55 s: every one on the first connection
            assert ready(pc.probe(up.endpoint, TIMEOUT, rz))
            now[0] += 5.0
        assert up.handshakes == 1
        assert ready(pc.probe(up.endpoint, TIMEOUT, rz))  # 60 s old: a new one
        assert up.handshakes == 2
        now[0] += 55.0
        assert ready(pc.probe(up.endpoint, TIMEOUT, rz))  # the new one counts from its own
        assert up.handshakes == 2
        assert pc.opened() == {up.address: 2}
    finally:
        pc.close()


def test_a_server_whose_certificate_a_new_connection_rejects_goes_unready_within_the_max_age(
        ca: trustme.CA, ca_file: str) -> None:
    # The serving certificate is swapped for one another CA signs (a botched rotation):
    # every new client connection fails its handshake, so the probe must too, within the
    # max age of the connection it kept while the old certificate was served.
    max_age, every = 1.5, 0.1
    pc = ProbeConnections(max_age=max_age)
    rz = settings(ca_file)
    try:
        with FakeUpstream(ca=ca, name="rotating") as up:
            assert ready(pc.probe(up.endpoint, TIMEOUT, rz))
            up.set_serving_ca(trustme.CA())
            swapped = time.monotonic()
            results: list[ProbeResult] = []

            def unready() -> bool:
                results.append(pc.probe(up.endpoint, TIMEOUT, rz))
                time.sleep(every)  # the probe interval of this test
                return results[-1].ready is False

            wait_until(unready, max_age + every + TIMEOUT + 5)
            took = time.monotonic() - swapped
            assert took <= max_age + every + TIMEOUT + SLACK, took
            assert results[-1].ok  # the TCP check passes: only readiness fails
            assert results[-1].ready_reason.startswith("TLS verify failed"), results[-1]
            assert len(results) > 1  # the kept connection was used before the max age
            assert up.handshakes == 1  # the rejected handshake never completed
    finally:
        pc.close()


@pytest.fixture
def moving_name(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A host name this test resolves (through the resolver call the probe makes, the
    rest of the process's names untouched): ``where["to"]`` is its address."""
    real = socket.getaddrinfo
    where = {"name": "apiserver.moving.test", "to": "127.0.0.1"}

    def getaddrinfo(host: object, *args: object, **kw: object) -> object:
        if host == where["name"]:
            host = where["to"]
            kw["flags"] = socket.AI_NUMERICHOST
        return real(host, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(probes.socket, "getaddrinfo", getaddrinfo)
    return where


def _two_on_one_port(ca: trustme.CA) -> tuple[FakeUpstream, FakeUpstream]:
    """Two TLS upstreams, on 127.0.0.1 and 127.0.0.2, on one port."""
    for _ in range(20):
        a = FakeUpstream(ca=ca, name="old-home").start()
        try:
            b = FakeUpstream(host="127.0.0.2", port=a.port, ca=ca, name="new-home").start()
        except OSError:
            a.stop()
            continue
        return a, b
    raise AssertionError("no port free on both 127.0.0.1 and 127.0.0.2")


def test_a_host_name_endpoint_that_resolves_elsewhere_is_followed(
        ca: trustme.CA, ca_file: str, moving_name: dict[str, str]) -> None:
    pc = ProbeConnections(max_age=LONG)
    rz = settings(ca_file)
    old, new = _two_on_one_port(ca)
    try:
        ep = Endpoint(moving_name["name"], old.port)
        assert ready(pc.probe(ep, TIMEOUT, rz)) and ready(pc.probe(ep, TIMEOUT, rz))
        assert old.handshakes == 1 and old.hit_count("/readyz") == 2
        new.set_ready_status(500)  # the server the name moved to is not ready
        moving_name["to"] = "127.0.0.2"
        r = pc.probe(ep, TIMEOUT, rz)
        assert r.ok and r.ready is False and r.ready_reason == "HTTP 500"
        assert new.hit_count("/readyz") == 1 and old.hit_count("/readyz") == 2
        wait_until(lambda: old.active_connections() == 0, 5)  # the old one is closed
        new.set_ready_status(200)
        assert ready(pc.probe(ep, TIMEOUT, rz))
        assert new.handshakes == 1  # kept again, at its new home
    finally:
        pc.close()
        old.stop()
        new.stop()


def test_the_proxy_finds_a_rejected_certificate_within_the_max_age(
        make_app, ca: trustme.CA, ca_file: str) -> None:  # type: ignore[no-untyped-def]
    # End to end: the ticker's kept connections, with the max age the proxy derives from
    # --health-interval, on a real TLS upstream whose certificate a new connection rejects.
    interval, timeout = 0.2, 0.5
    max_age = probes.kept_max_age(interval)
    with FakeUpstream(ca=ca, name="rot-a") as a, FakeUpstream(ca=ca, name="rot-b") as b:
        app = make_app([a.endpoint, b.endpoint], health_check="readyz",
                       health_check_ca_file=ca_file, health_check_server_name=SERVER_NAME,
                       health_interval=interval, health_timeout=timeout)
        wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 10)
        a.set_serving_ca(trustme.CA())
        swapped = time.monotonic()
        wait_until(lambda: app.registry.snapshot().get(a.address).ready is False,
                   max_age + interval + timeout + 10)
        took = time.monotonic() - swapped
        assert took <= max_age + interval + timeout + 2 * SLACK, took
        assert app.registry.snapshot().get(b.address).ready is True
        assert b.hit_count("/readyz") > 2 * b.handshakes  # b's connection is still kept
