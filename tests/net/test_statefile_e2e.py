"""--state-file end to end: a real App, its discovery through its own listener to the fake
API server, and the state file on disk (issue 14 item 5)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from extractedprism.discovery import statefile
from tests.conftest import fast_config
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.fakes.upstream import IdentityServer
from tests.net.test_discovery_e2e import idents, upstreams  # noqa: F401 (fixture)
from tests.util import wait_until

pytestmark = pytest.mark.timeout(90)


def _app(api: FakeApiServer, tmp_path: Path, static: list[Endpoint], **overrides: object
         ) -> App:
    sa = api.write_service_account(tmp_path / "sa")
    cfg = fast_config(static, enable_discovery=True, **overrides)
    app = App(cfg, sa_dir=str(sa))
    app.start()
    return app


def _file_endpoints(path: Path) -> list[str] | None:
    try:
        return json.loads(path.read_text())["endpoints"]
    except (OSError, ValueError, KeyError):
        return None


def test_written_when_discovery_changes_the_list(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path):  # noqa: F811
    port = idents["a"].port
    state = tmp_path / "state.json"
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    app = _app(api, tmp_path, [Endpoint("127.0.0.1", api.port)], state_file=str(state))
    try:
        wait_until(lambda: _file_endpoints(state) == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"],
                   10, message="the discovered list on disk")
        doc = json.loads(state.read_text())
        assert doc["version"] == 1 and doc["written"].endswith("Z")
        api.set_slice(make_slice("kubernetes", ["127.0.0.3"], port=port))
        wait_until(lambda: _file_endpoints(state) == [f"127.0.0.3:{port}"], 10,
                   message="the changed list on disk")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state")] == []
    finally:
        assert app.stop()


def test_cache_reaches_the_api_when_every_static_endpoint_is_gone_then_is_dropped(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path):  # noqa: F811
    port = idents["a"].port
    state = tmp_path / "state.json"
    cached = f"127.0.0.1:{api.port}"  # the API server, known only from the last run
    statefile.write(str(state), [Endpoint("127.0.0.1", api.port)])
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    dead = Endpoint("127.0.0.1", 1)  # the static endpoint was decommissioned
    app = _app(api, tmp_path, [dead], state_file=str(state), drain_timeout=1.0)
    try:
        assert cached in upstreams(app)
        # Discovery reached the API server through the cached endpoint: its first list
        # replaced the cache, whose endpoint drains and leaves.
        want = {str(dead), f"127.0.0.2:{port}", f"127.0.0.3:{port}"}
        wait_until(lambda: want <= upstreams(app), 15, message="the discovered upstreams")
        wait_until(lambda: cached not in upstreams(app), 10, message="the cache dropped")
        assert api.list_requests()
        wait_until(lambda: _file_endpoints(state) == [f"127.0.0.2:{port}",
                                                      f"127.0.0.3:{port}"], 10,
                   message="the discovered list on disk")
    finally:
        app.stop()


def test_corrupt_file_is_one_warning_and_a_start_without_it(
        api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    state = tmp_path / "state.json"
    state.write_text('{"apiVersion": "v1", "kind": "Secret"}')
    caplog.set_level(logging.INFO)
    app = _app(api, tmp_path, [Endpoint("127.0.0.1", api.port)], state_file=str(state))
    try:
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno >= logging.WARNING and "state file" in r.getMessage()]
        assert len(warnings) == 1 and str(state) in warnings[0], warnings
        assert upstreams(app) == {f"127.0.0.1:{api.port}"}
    finally:
        assert app.stop()


def test_not_read_with_discovery_off(make_app, servers, tmp_path: Path):
    (up,) = servers(1)
    state = tmp_path / "state.json"
    statefile.write(str(state), [Endpoint("127.0.0.9", 6443)])
    app = make_app([up.endpoint], state_file=str(state))
    assert {u.address for u in app.registry.snapshot().upstreams} == {str(up.endpoint)}
    # Neither read nor written: the command line's one warning about it is
    # tests/process/test_cli_mistakes.py's state-file-without-discovery case.
    before = state.stat().st_mtime_ns, state.read_bytes()
    app.stop()
    assert (state.stat().st_mtime_ns, state.read_bytes()) == before
