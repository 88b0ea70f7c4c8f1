"""The metrics operators look for (issue 15 item 5): name, type and labels of each, read
from a real App's /metrics text with the client library's own parser."""

from __future__ import annotations

import platform
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extractedprism import __version__
from extractedprism.config.endpoints import Endpoint
from extractedprism.upstreams.state import ProbeResult
from tests.net.test_upstreams_doc import doc, when
from tests.util import connect, dropped, first_checks_recorded, http, wait_until, whoami


def families(app: Any) -> dict[str, Any]:
    status, _, body = http(app.health_address, "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def samples(app: Any, name: str) -> list[Any]:
    fam = families(app).get(name)
    return [] if fam is None else list(fam.samples)


def value(app: Any, sample: str, labels: dict[str, str]) -> float | None:
    for fam in families(app).values():
        for s in fam.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return None


def ok_prober(ep: Endpoint, timeout: float, readyz: object) -> ProbeResult:
    return ProbeResult(ok=True, rtt=0.001, reason="")


def test_process_and_platform_collectors(make_app, servers) -> None:
    app = make_app([u.endpoint for u in servers(1)])
    fams = families(app)
    for name in ("process_resident_memory_bytes", "process_virtual_memory_bytes",
                 "process_open_fds", "process_max_fds", "process_start_time_seconds"):
        assert fams[name].type == "gauge", name
    assert fams["process_cpu_seconds"].type == "counter"
    start = fams["process_start_time_seconds"].samples[0].value
    assert time.time() - 3600 < start <= time.time()
    assert fams["process_resident_memory_bytes"].samples[0].value > 1 << 20
    (info,) = fams["python_info"].samples
    assert info.value == 1 and info.labels["version"] == platform.python_version()
    assert "python_gc_collections" in fams


def test_build_info(make_app, servers) -> None:
    app = make_app([u.endpoint for u in servers(1)])
    fam = families(app)["extractedprism_build_info"]
    assert fam.type == "gauge"
    (s,) = fam.samples
    assert s.value == 1
    # --relay=auto with the extension built (pip install .): the native relay.
    assert app.relay == "native"
    assert s.labels == {"version": __version__, "python": platform.python_version(),
                        "relay": "native"}


def test_dial_duration_observes_every_client_dial_not_health_checks(make_app, servers
                                                                    ) -> None:
    (live,) = servers(1)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # refuses every connect
    try:
        gone = Endpoint("127.0.0.1", dead.getsockname()[1])
        app = make_app([live.endpoint, gone], prober=ok_prober, health_interval=60.0,
                       health_timeout=1.0)
        fam = families(app)["extractedprism_dial_duration_seconds"]
        assert fam.type == "histogram"
        # Health checks ran (the prober), but no client has dialed yet.
        assert value(app, "extractedprism_dial_duration_seconds_count",
                     {"upstream": str(live.endpoint)}) in (None, 0.0)
        for _ in range(10):
            assert whoami(app) == "up0"
        ok = value(app, "extractedprism_dial_duration_seconds_count",
                   {"upstream": str(live.endpoint)})
        assert ok == 10
        failed = value(app, "extractedprism_dial_duration_seconds_count",
                       {"upstream": str(gone)})
        assert failed is not None and failed >= 1  # failed dials count as well
        buckets = [s for s in samples(app, "extractedprism_dial_duration_seconds")
                   if s.name.endswith("_bucket") and s.labels["upstream"] == str(live.endpoint)]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 10
        assert all(set(s.labels) == {"upstream", "le"} for s in buckets)
        total = value(app, "extractedprism_dial_duration_seconds_sum",
                      {"upstream": str(live.endpoint)})
        assert total is not None and 0 < total < 10
    finally:
        dead.close()


def test_upstream_bytes_total_by_direction(make_app, servers) -> None:
    ups = servers(1)
    app = make_app([u.endpoint for u in ups])
    with connect(app) as s:
        assert s.recv(4) == b"up0\n"
        s.sendall(b"abcdef")
        got = b""
        while len(got) < 6:
            got += s.recv(6)
    addr = str(ups[0].endpoint)
    wait_until(lambda: value(app, "extractedprism_upstream_bytes_total",
                             {"upstream": addr, "direction": "down"}) == 10, 5)
    assert families(app)["extractedprism_upstream_bytes"].type == "counter"
    assert value(app, "extractedprism_upstream_bytes_total",
                 {"upstream": addr, "direction": "up"}) == 6


def test_connection_errors_none_counts_each_client_turned_away(make_app) -> None:
    deads = [socket.socket() for _ in range(2)]
    try:
        for d in deads:
            d.bind(("127.0.0.1", 0))
        eps = [Endpoint("127.0.0.1", d.getsockname()[1]) for d in deads]
        app = make_app(eps)
        assert families(app)["extractedprism_connection_errors"].type == "counter"
        assert value(app, "extractedprism_connection_errors_total", {"upstream": "none"}) == 0
        wait_until(lambda: doc(app)["panic"], 5, message="both marked down")
        for _ in range(3):
            with connect(app) as s:
                assert dropped(s)
        wait_until(lambda: value(app, "extractedprism_connection_errors_total",
                                 {"upstream": "none"}) == 3, 5)
    finally:
        for d in deads:
            d.close()


@pytest.mark.timeout(90)
def test_discovery_gauges_and_document(api, tmp_path: Path) -> None:
    from tests.net.test_discovery_e2e import start_app

    app = start_app(api, tmp_path)
    try:
        labels = {"provider": "kubernetes"}
        wait_until(lambda: api.open_streams() == 1, 10, message="watch open")
        wait_until(lambda: value(app, "extractedprism_discovery_connected", labels) == 1, 5)
        fams = families(app)
        assert fams["extractedprism_discovery_connected"].type == "gauge"
        assert fams["extractedprism_discovery_last_event_timestamp_seconds"].type == "gauge"
        last = value(app, "extractedprism_discovery_last_event_timestamp_seconds", labels)
        assert last is not None and abs(time.time() - last) < 60
        d = doc(app)["discovery"]
        assert d["enabled"] is True and d["connected"] is True and d["last_error"] is None
        assert abs(when(d["last_event"]) - last) < 0.01
        api.fail("watch", 500, count=None)
        api.drop_streams()
        wait_until(lambda: value(app, "extractedprism_discovery_connected", labels) == 0, 10)
        wait_until(lambda: doc(app)["discovery"]["last_error"], 10)
        assert doc(app)["discovery"]["connected"] is False
    finally:
        assert app.stop()


def test_health_checks_alone_do_not_observe_dials(make_app, servers) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups])
    wait_until(lambda: first_checks_recorded(ups), 5)
    assert [s for s in samples(app, "extractedprism_dial_duration_seconds")
            if s.name.endswith("_count") and s.value] == []
