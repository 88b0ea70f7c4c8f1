"""Health server: routes, method rules, metrics and the liveness heartbeat."""

from __future__ import annotations

import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.util import http, wait_until


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
