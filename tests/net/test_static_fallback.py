"""--static-endpoints=fallback (issue 14 item 6): once discovery has produced a list, a
static endpoint it lacks is a last resort: state ``fallback``, still probed, not counted,
never picked while a discovered endpoint is pickable, tried in panic mode."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from tests.conftest import fast_config
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.fakes.upstream import IdentityServer
from tests.net.test_discovery_e2e import idents  # noqa: F401 (fixture)
from tests.util import http, wait_until

pytestmark = pytest.mark.timeout(90)


def _name(address: tuple[str, int]) -> str | None:
    try:
        with socket.create_connection(address, timeout=2) as s:
            s.settimeout(1)
            return s.recv(16).decode().strip() or None
    except OSError:
        return None


def _metric(app: App, name: str) -> float | None:
    text = http(app.health_address, "/metrics")[2].decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _entries(app: App) -> dict[str, dict]:
    doc = json.loads(http(app.health_address, "/upstreams")[2])
    return {u["address"]: u for u in doc["upstreams"]}


def test_fallback_is_never_picked_while_a_discovered_one_is_then_in_panic(make_app, servers):
    a, b, c = servers(3)
    app = make_app([a.endpoint, c.endpoint], static_endpoints="fallback")
    # Before discovery has produced a list, the static endpoints are ordinary.
    assert _entries(app)[str(c.endpoint)]["state"] == "healthy"
    app._on_discovered([a.endpoint, b.endpoint])  # what the watcher hands over
    entries = _entries(app)
    assert entries[str(c.endpoint)]["state"] == "fallback"
    assert entries[str(c.endpoint)]["source"] == ["static"]
    assert entries[str(a.endpoint)]["source"] == ["static", "kubernetes"]
    assert entries[str(b.endpoint)]["source"] == ["kubernetes"]
    assert _metric(app, "extractedprism_upstreams_total") == 2
    assert _metric(app, "extractedprism_upstreams_active") == 2
    probed = c.accepted
    seen = {_name(app.proxy_address) for _ in range(40)}
    assert seen == {"up0", "up1"}
    # Still probed.
    wait_until(lambda: c.accepted >= probed + 2, 10, message="the fallback is probed")
    # Every discovered endpoint fails: panic mode tries the fallback.
    a.stop()
    b.stop()
    wait_until(lambda: app.registry.snapshot().panic, 10, message="panic mode")
    assert wait_until(lambda: _name(app.proxy_address) == "up2", 10,
                      message="a connection through the fallback")


def test_always_keeps_the_union(make_app, servers):
    a, b, c = servers(3)
    app = make_app([a.endpoint, c.endpoint])
    app._on_discovered([a.endpoint, b.endpoint])
    entries = _entries(app)
    assert entries[str(c.endpoint)]["state"] == "healthy"
    assert _metric(app, "extractedprism_upstreams_total") == 3
    assert {_name(app.proxy_address) for _ in range(60)} == {"up0", "up1", "up2"}


def test_fallback_end_to_end_with_discovery(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path):  # noqa: F811
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    api.set_slice(make_slice("kubernetes-api", ["127.0.0.1"], port=api.port))
    gone = idents["c"].endpoint  # static, but discovery no longer lists it
    sa = api.write_service_account(tmp_path / "sa")
    cfg = fast_config([Endpoint("127.0.0.1", api.port), gone], enable_discovery=True,
                      static_endpoints="fallback")
    app = App(cfg, sa_dir=str(sa))
    app.start()
    try:
        wait_until(lambda: _entries(app).get(str(gone), {}).get("state") == "fallback", 15,
                   message="the static endpoint demoted")
        entries = _entries(app)
        assert entries[f"127.0.0.1:{api.port}"]["source"] == ["static", "kubernetes"]
        assert entries[str(gone)]["source"] == ["static"]
        assert _metric(app, "extractedprism_upstreams_total") == 3
        names = {_name(app.proxy_address) for _ in range(40)}
        assert "c" not in names and {"a", "b"} <= names
        # Listed again: an ordinary upstream again.
        api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
                                 port=port))
        wait_until(lambda: _entries(app)[str(gone)]["state"] == "healthy", 15,
                   message="promoted")
        assert _entries(app)[str(gone)]["source"] == ["static", "kubernetes"]
    finally:
        assert app.stop()
