"""Readiness-aware selection end to end: three real TLS upstreams whose /readyz flips."""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import time

import pytest
import trustme

from tests.fakes.upstream import FakeUpstream
from tests.util import first_checks_recorded, http, wait_until

SERVER_NAME = "kubernetes.default.svc"
INTERVAL, TIMEOUT, DRAIN = 0.3, 0.25, 1.0


@pytest.fixture
def app(make_app, ups, ca, tmp_path):  # type: ignore[no-untyped-def]
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    app = make_app([u.endpoint for u in ups], health_check="readyz",
                   health_check_ca_file=str(ca_file), health_interval=INTERVAL,
                   health_timeout=TIMEOUT, drain_timeout=DRAIN)
    wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)
    return app


def tls_conn(app, ca) -> ssl.SSLSocket:  # type: ignore[no-untyped-def]
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    raw = socket.create_connection(app.proxy_address, timeout=5)
    return ctx.wrap_socket(raw, server_hostname=SERVER_NAME)


def whoami_tls(app, ca) -> str:  # type: ignore[no-untyped-def]
    with tls_conn(app, ca) as s:
        s.sendall(b"GET /whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.split(b"\r\n\r\n", 1)[1].decode().strip()


def watch_on(app, ca, name: str) -> ssl.SSLSocket:  # type: ignore[no-untyped-def]
    """A long-lived watch-like stream that landed on upstream ``name``."""
    for _ in range(100):
        s = tls_conn(app, ca)
        s.sendall(b"GET /whoami HTTP/1.1\r\nHost: x\r\n\r\n")
        head = s.recv(4096)
        if name.encode() in head:
            s.sendall(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(4096)
            return s
        s.close()
    raise AssertionError(f"no connection landed on {name}")


def is_closed(s: ssl.SSLSocket, timeout: float) -> bool:
    """True once the proxy closed the stream (watch lines keep coming until then)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False  # a silent stream is not a closed one
    except (OSError, ssl.SSLError):
        return True
    return False


def readiness(app, name_addr: str) -> str:  # type: ignore[no-untyped-def]
    return app.registry.snapshot().get(name_addr).readiness


def test_unready_after_two_failures_and_no_new_connections(app, ups, ca):
    bad = ups[0]
    before = bad.hit_count("/readyz")
    bad.set_ready_status(500)
    wait_until(lambda: readiness(app, bad.address) == "unready", 5)
    # Not after one failed probe: the second one decides.
    assert bad.hit_count("/readyz") - before >= 2
    assert collections.Counter(whoami_tls(app, ca) for _ in range(30)).keys() <= {"up1", "up2"}
    text = http(app.health_address, "/metrics")[2].decode()
    assert f'extractedprism_upstream_ready{{upstream="{bad.address}"}} 0.0' in text
    assert f'extractedprism_upstream_ready{{upstream="{ups[1].address}"}} 1.0' in text
    # The proxy's own /readyz is unaffected.
    assert http(app.health_address, "/readyz")[0] == 200


def test_unready_connections_closed_after_drain_timeout_while_another_is_ready(app, ups, ca):
    bad = ups[0]
    with watch_on(app, ca, "up0") as stream:
        bad.set_ready_status(500)
        wait_until(lambda: readiness(app, bad.address) == "unready", 5)
        t0 = time.monotonic()
        assert not is_closed(stream, DRAIN * 0.6)  # the grace period is honoured ...
        assert is_closed(stream, DRAIN + INTERVAL + 1.0)  # ... then the connection is closed
        assert time.monotonic() - t0 <= DRAIN + INTERVAL + 1.0


def test_close_called_off_when_it_turns_ready_again(app, ups, ca):
    bad = ups[0]
    with watch_on(app, ca, "up0") as stream:
        bad.set_ready_status(500)
        wait_until(lambda: readiness(app, bad.address) == "unready", 5)
        bad.set_ready_status(200)
        wait_until(lambda: readiness(app, bad.address) == "ready", 5)  # one success restores
        assert not is_closed(stream, DRAIN + 0.5)


def test_no_upstream_ready_falls_back_and_keeps_connections(app, ups, ca):
    with watch_on(app, ca, "up0") as stream:
        for u in ups:
            u.set_ready_status(500)
        wait_until(lambda: all(u.readiness == "unready" for u in app.registry.snapshot().upstreams),
                   5)
        # Fallback: every TCP-healthy upstream still takes new connections ...
        seen = {whoami_tls(app, ca) for _ in range(40)}
        assert seen == {"up0", "up1", "up2"}
        # ... and existing connections stay where they are.
        assert not is_closed(stream, DRAIN + 0.5)


def test_restarted_upstream_still_unready_gets_no_connections(app, ups, ca):
    bad = ups[0]
    bad.stop()
    wait_until(lambda: not app.registry.snapshot().get(bad.address).healthy, 5)
    bad.set_ready_status(500)  # back, but cut off from etcd
    bad.start()
    wait_until(lambda: app.registry.snapshot().get(bad.address).healthy, 5)
    # The first probe after the reset settles it as not ready at once.
    assert readiness(app, bad.address) == "unready"
    assert "up0" not in {whoami_tls(app, ca) for _ in range(30)}


def test_new_upstream_is_not_ready_until_its_probe_passes(app, ups, ca):
    newcomer = FakeUpstream(ca=ca, name="up3").start()
    try:
        newcomer.set_ready_status(503)
        app.registry.membership.set_endpoints([u.endpoint for u in ups] + [newcomer.endpoint])
        # Pending until its first probe, which the ticker runs at once (and may already
        # have run): never ready in between.
        assert readiness(app, newcomer.address) in ("pending", "unready")
        answers = {whoami_tls(app, ca) for _ in range(40)}
        assert "up3" not in answers
        wait_until(lambda: readiness(app, newcomer.address) == "unready", 5)
    finally:
        app.registry.membership.set_endpoints([u.endpoint for u in ups])
        newcomer.stop()


def test_wrong_server_name_fails_verification(make_app, ups, ca, tmp_path):
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    app = make_app([ups[0].endpoint], health_check="readyz", health_check_ca_file=str(ca_file),
                   health_check_server_name="wrong.example", health_interval=INTERVAL,
                   health_timeout=TIMEOUT)
    wait_until(lambda: readiness(app, ups[0].address) == "unready", 5)
    err = app.registry.snapshot().get(ups[0].address).last_check_error
    assert "verif" in err.lower() or "hostname" in err.lower(), err


def test_wrong_ca_fails_verification(make_app, ups, tmp_path):
    other = trustme.CA()
    ca_file = tmp_path / "other.pem"
    other.cert_pem.write_to_path(str(ca_file))
    app = make_app([ups[0].endpoint], health_check="readyz", health_check_ca_file=str(ca_file),
                   health_interval=INTERVAL, health_timeout=TIMEOUT)
    wait_until(lambda: readiness(app, ups[0].address) == "unready", 5)
    assert "verif" in app.registry.snapshot().get(ups[0].address).last_check_error.lower()


def test_token_rotation_and_missing_token(make_app, ca, tmp_path):
    up = FakeUpstream(ca=ca, name="tok").start()
    try:
        ca_file, token = tmp_path / "ca.pem", tmp_path / "token"
        ca.cert_pem.write_to_path(str(ca_file))
        app = make_app([up.endpoint], health_check="readyz", health_check_ca_file=str(ca_file),
                       health_check_token_file=str(token), health_interval=INTERVAL,
                       health_timeout=TIMEOUT)
        # Missing token: the probe fails, start-up does not.
        wait_until(lambda: readiness(app, up.address) == "unready", 5)
        assert "token" in app.registry.snapshot().get(up.address).last_check_error
        token.write_text("first-token\n")
        wait_until(lambda: "Bearer first-token" in up.authorizations(), 5)
        wait_until(lambda: readiness(app, up.address) == "ready", 5)
        token.write_text("second-token\n")  # rotation without restart
        wait_until(lambda: "Bearer second-token" in up.authorizations(), 5)
    finally:
        up.stop()


def test_client_certificate_rotation(make_app, ca, tmp_path):
    client_ca = trustme.CA()
    up = FakeUpstream(ca=ca, name="mtls", client_ca=client_ca, require_client_cert=True).start()
    try:
        ca_file, cert = tmp_path / "ca.pem", tmp_path / "client.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        client_ca.issue_cert("node-a", common_name="system:node:a").private_key_and_cert_chain_pem \
            .write_to_path(str(cert))
        app = make_app([up.endpoint], health_check="readyz", health_check_ca_file=str(ca_file),
                       health_check_cert_file=str(cert), health_check_key_file=str(cert),
                       health_interval=INTERVAL, health_timeout=TIMEOUT)
        wait_until(lambda: "system:node:a" in up.client_cns(), 5)
        client_ca.issue_cert("node-a", common_name="system:node:a-rotated") \
            .private_key_and_cert_chain_pem.write_to_path(str(cert))
        wait_until(lambda: "system:node:a-rotated" in up.client_cns(), 5)
        assert readiness(app, up.address) == "ready"
    finally:
        up.stop()


def test_no_ready_series_in_tcp_mode(make_app, ups):
    app = make_app([u.endpoint for u in ups])
    # Look after the first checks are recorded, not before.
    wait_until(lambda: first_checks_recorded(ups), 5, message="the first health checks")
    assert "extractedprism_upstream_ready{" not in http(app.health_address, "/metrics")[2].decode()


def test_a_hung_upstream_does_not_delay_the_others_checks(app, ups):
    ups[0].set_ready_hang(True)  # answers TCP, never answers /readyz
    wait_until(lambda: readiness(app, ups[0].address) == "unready", 5)
    before = ups[1].hit_count("/readyz")
    t0 = time.monotonic()
    time.sleep(10 * INTERVAL)  # observe a window of checks (not a wait for a state)
    rounds = (ups[1].hit_count("/readyz") - before) / ((time.monotonic() - t0) / INTERVAL)
    # The healthy upstream keeps its own schedule although up0 eats a full timeout.
    assert rounds >= 0.7, rounds
    ups[0].set_ready_hang(False)


def test_probe_errors_are_logged_once_per_change(app, ups, caplog):
    bad = ups[0]
    bad.set_ready_status(500)
    wait_until(lambda: readiness(app, bad.address) == "unready", 5)
    h0 = bad.hit_count("/readyz")
    wait_until(lambda: bad.hit_count("/readyz") >= h0 + 5, 10)  # five more failing checks
    lines = [r.getMessage() for r in caplog.records
             if bad.address in r.getMessage() and "HTTP 500" in r.getMessage()]
    assert 1 <= len(lines) <= 2, lines  # the change, not every interval


def test_unusable_ca_file_warns_at_startup_and_falls_back(make_app, ups, ca, tmp_path, caplog):
    missing = tmp_path / "typo-ca.pem"
    caplog.set_level(logging.INFO)
    app = make_app([u.endpoint for u in ups], health_check="readyz",
                   health_check_ca_file=str(missing), health_interval=INTERVAL,
                   health_timeout=TIMEOUT)
    # Not fatal (the file is re-read on every probe), but said once, naming flag and path.
    [warning] = [r.getMessage() for r in caplog.records
                 if r.levelno == logging.WARNING and "--health-check-ca-file" in r.getMessage()]
    assert str(missing) in warning and "CA file missing" in warning
    # Every probe fails with that reason and selection falls back to TCP health.
    wait_until(lambda: all(u.readiness == "unready" for u in app.registry.snapshot().upstreams),
               5)
    assert all(u.last_check_error == f"CA file missing: {missing}"
               for u in app.registry.snapshot().upstreams)
    assert {whoami_tls(app, ca) for _ in range(40)} == {"up0", "up1", "up2"}
    # The file appears: the next probes pass.
    ca.cert_pem.write_to_path(str(missing))
    wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)


def test_no_startup_warning_for_a_good_ca_file(app, caplog):
    assert not [r for r in caplog.records if "--health-check-ca-file" in r.getMessage()]


def test_token_gone_bad_while_running_keeps_connections_and_says_why(make_app, ups, ca,
                                                                     tmp_path, caplog):
    secret = "e2e-secret-token-value"
    ca_file, token = tmp_path / "ca.pem", tmp_path / "token"
    ca.cert_pem.write_to_path(str(ca_file))
    token.write_text(secret + "\n")
    caplog.set_level(logging.DEBUG)
    # A long grace period: the three upstreams turn unready one probe apart, and the
    # first must not lose its connections to the moment the others are still ready.
    app = make_app([u.endpoint for u in ups], health_check="readyz",
                   health_check_ca_file=str(ca_file), health_check_token_file=str(token),
                   health_interval=INTERVAL, health_timeout=TIMEOUT, drain_timeout=30.0)
    wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)
    with watch_on(app, ca, "up0") as stream:
        token.write_text(secret + "\x07\n")  # a control character: never sent
        wait_until(lambda: all(u.readiness == "unready"
                               for u in app.registry.snapshot().upstreams), 5)
        # The registry logs after releasing its lock: the line may follow the state.
        transitions = wait_until(lambda: len(ts := [
            r.getMessage() for r in caplog.records if "ready->unready" in r.getMessage()
        ]) == 3 and ts, 5)
        assert all(f"token file invalid: {token}: contains a control character" in line
                   for line in transitions), transitions
        assert not is_closed(stream, 1.0)  # nobody is ready: connections stay
        assert http(app.health_address, "/healthz")[0] == 200
        token.write_text(secret)
        wait_until(lambda: all(u.ready for u in app.registry.snapshot().upstreams), 5)
        assert not is_closed(stream, 0.2)
    assert secret not in caplog.text
