"""End to end: a real App whose discovery reaches the fake API server through its own
listener, and whose discovered endpoints become upstreams that receive connections."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extractedprism.app import App
from extractedprism.config.endpoints import Endpoint
from tests.conftest import fast_config
from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.fakes.upstream import IdentityServer
from tests.util import sample, wait_until

pytestmark = pytest.mark.timeout(90)

ERRORS = "extractedprism_discovery_errors_total"
UPDATES = "extractedprism_discovery_updates_total"


def _same_port_idents() -> dict[str, IdentityServer]:
    """a on 127.0.0.2 port 0, then b and c on 127.0.0.3/.4 on a's port. Another process may
    hold that port on .3 or .4: then everything is stopped and the caller tries again."""
    a = IdentityServer(name="a", host="127.0.0.2").start()
    made = {"a": a}
    try:
        for i, name in ((3, "b"), (4, "c")):
            made[name] = IdentityServer(name=name, host=f"127.0.0.{i}", port=a.port).start()
    except OSError:
        for s in made.values():
            s.stop()
        raise
    return made


@pytest.fixture
def idents() -> Iterator[dict[str, IdentityServer]]:
    """a, b, c on 127.0.0.2/.3/.4 sharing one port (as one EndpointSlice port needs)."""
    for attempt in range(5):
        try:
            made = _same_port_idents()
            break
        except OSError:
            if attempt == 4:
                raise
    yield made
    for s in made.values():
        s.stop()


def start_app(api: FakeApiServer, tmp_path: Path, static: list[Endpoint] | None = None,
              **overrides: object) -> App:
    sa = api.write_service_account(tmp_path / "sa")
    cfg = fast_config(static or [Endpoint("127.0.0.1", api.port)], enable_discovery=True,
                      **overrides)
    app = App(cfg, sa_dir=str(sa))
    app.start()
    return app


def upstreams(app: App) -> set[str]:
    return {u.address for u in app.registry.snapshot().upstreams}


def pickable(app: App) -> set[str]:
    return {u.address for u in app.registry.snapshot().upstreams if u.pickable}


def connect_named(app: App) -> tuple[socket.socket, str | None]:
    """A client connection through the proxy and the identity of its upstream (None for the
    fake API server, which says nothing first)."""
    host, port = app.proxy_address
    s = socket.create_connection((host, port), timeout=2)
    s.settimeout(0.5)
    try:
        line = s.recv(64)
    except TimeoutError:
        return s, None
    return s, line.decode().strip() or None


def seen_names(app: App, want: set[str], attempts: int = 60) -> set[str]:
    seen: set[str] = set()
    for _ in range(attempts):
        s, name = connect_named(app)
        s.close()
        if name:
            seen.add(name)
        if want <= seen:
            break
    return seen


def hold(app: App, name: str, attempts: int = 60) -> socket.socket:
    for _ in range(attempts):
        s, got = connect_named(app)
        if got == name:
            return s
        s.close()
    raise AssertionError(f"no connection reached {name}")


def hold_a_while_it_drains(api: FakeApiServer, app: App, port: int) -> socket.socket:
    """A connection held to a (127.0.0.2), which then leaves the slice: back once a is
    draining."""
    addr = f"127.0.0.2:{port}"
    wait_until(lambda: addr in pickable(app), 10)
    s = hold(app, "a")
    try:
        api.set_slice(make_slice("kubernetes", ["127.0.0.3"], port=port))
        wait_until(lambda: (u := app.registry.snapshot().get(addr)) is not None
                   and u.draining, 5, message="draining")
    except BaseException:
        s.close()
        raise
    return s


def echoes(s: socket.socket) -> bool:
    try:
        s.sendall(b"ping\n")
        return s.recv(16) == b"ping\n"
    except OSError:
        return False


def test_discovered_endpoints_become_upstreams_and_receive_connections(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    app = start_app(api, tmp_path)
    try:
        static = f"127.0.0.1:{api.port}"
        wait_until(lambda: upstreams(app) == {static, f"127.0.0.2:{port}", f"127.0.0.3:{port}"},
                   10, message="discovered upstreams")
        wait_until(lambda: len(pickable(app)) == 3, 10)
        assert seen_names(app, {"a", "b"}) == {"a", "b"}
        assert sample(app.metrics, ERRORS, {"provider": "kubernetes"}) in (None, 0.0)
        assert sample(app.metrics, UPDATES, {"provider": "kubernetes"}) == 1
        assert sample(app.metrics, UPDATES, {"provider": "static"}) == 1
    finally:
        assert app.stop()


def test_discovery_goes_through_the_proxys_own_listener(
        api: FakeApiServer, tmp_path: Path) -> None:
    app = start_app(api, tmp_path)
    try:
        wait_until(lambda: api.open_streams() == 1, 10, message="watch open")
        list_req, watch_req = api.slice_requests()[:2]
        assert list_req.authorized and watch_req.authorized
        # the client knows only the proxy's address, and the proxy carries the open watch
        # (no test client is connected) to its only upstream, the API server
        static = app.registry.snapshot().get(f"127.0.0.1:{api.port}")
        assert static is not None and static.active_connections >= 1
        assert app.discovery is not None and app.discovery._client is not None
        assert app.discovery._client.host == f"https://127.0.0.1:{app.proxy_address[1]}"
        assert "kubernetes.default.svc" in api.sni_names
    finally:
        assert app.stop()


def test_ready_false_is_excluded_and_slice_deletion_recomputes(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port,
                             not_ready=["127.0.0.3"]))
    api.set_slice(make_slice("kubernetes-extra", ["127.0.0.4"], port=port))
    app = start_app(api, tmp_path, drain_timeout=0.0)
    static = f"127.0.0.1:{api.port}"
    try:
        wait_until(lambda: upstreams(app) == {static, f"127.0.0.2:{port}",
                                              f"127.0.0.4:{port}"}, 10)
        api.delete_slice("kubernetes")
        wait_until(lambda: upstreams(app) == {static, f"127.0.0.4:{port}"}, 10)
        assert seen_names(app, {"c"}) == {"c"}
    finally:
        assert app.stop()


def test_removed_endpoint_drains_then_closes(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    app = start_app(api, tmp_path, drain_timeout=1.0)
    addr = f"127.0.0.2:{port}"
    try:
        with hold_a_while_it_drains(api, app, port) as s:
            assert echoes(s)  # existing connection keeps working while draining
            assert addr not in pickable(app)
            wait_until(lambda: addr not in upstreams(app), 5, message="drained and removed")
            s.settimeout(2)
            try:
                closed = s.recv(16) == b""
            except TimeoutError:
                closed = False  # silent, not closed: the proxy kept it open
            except OSError:
                closed = True  # reset
            assert closed
    finally:
        assert app.stop()


def test_readding_aborts_the_drain(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
    app = start_app(api, tmp_path, drain_timeout=1.5)
    addr = f"127.0.0.2:{port}"
    try:
        with hold_a_while_it_drains(api, app, port) as s:
            api.set_slice(make_slice("kubernetes", ["127.0.0.2", "127.0.0.3"], port=port))
            wait_until(lambda: addr in pickable(app), 5, message="drain aborted")
            # past the drain deadline the connection is still open and served
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                assert echoes(s)
                time.sleep(0.2)
    finally:
        assert app.stop()


def test_removing_every_slice_leaves_the_static_endpoints(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2"], port=port))
    api.set_slice(make_slice("kubernetes-2", ["127.0.0.3"], port=port))
    app = start_app(api, tmp_path, drain_timeout=0.0)
    static = f"127.0.0.1:{api.port}"
    try:
        wait_until(lambda: len(upstreams(app)) == 3, 10)
        api.delete_slice("kubernetes")
        api.delete_slice("kubernetes-2")
        wait_until(lambda: upstreams(app) == {static}, 10, message="static only")
        assert pickable(app) == {static}
    finally:
        assert app.stop()


def test_malformed_slice_is_skipped_and_discovery_goes_on(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    bad = make_slice("kubernetes-bad", ["127.0.0.9"], port=port)
    bad["ports"] = [{"name": "https", "port": "not-a-number"}]
    api.set_slice(bad)
    app = start_app(api, tmp_path)
    static = f"127.0.0.1:{api.port}"
    try:
        wait_until(lambda: api.open_streams() == 1, 10)
        assert upstreams(app) == {static}
        api.inject_raw(b"garbage that is not json")
        api.set_slice(make_slice("kubernetes", ["127.0.0.2"], port=port))
        wait_until(lambda: upstreams(app) == {static, f"127.0.0.2:{port}"}, 10)
        assert sample(app.metrics, ERRORS, {"provider": "kubernetes"}) in (None, 0.0)
    finally:
        assert app.stop()


# The kubernetes client keeps the connection of a failed request (an ApiException holds
# the unread response; urllib3 neither closes nor pools it) until the exception object
# is freed, which a captured log record can delay past the test. Freed with it, so not
# a leak of the proxy's; the guard reports it in the log instead of failing.
@pytest.mark.fd_leak_ok("kubernetes client connections of failed requests")
def test_failing_kubernetes_provider_leaves_static_serving(
        idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    # the API answers every call with 500: discovery fails entirely, static keeps serving
    with FakeApiServer() as api:
        api.fail("any", 500, count=None)
        a = idents["a"]
        app = start_app(api, tmp_path, static=[Endpoint("127.0.0.1", api.port),
                                               Endpoint(a.host, a.port)])
        try:
            wait_until(lambda: (sample(app.metrics, ERRORS, {"provider": "kubernetes"}) or 0)
                       >= 1, 10, message="discovery error counted")
            assert upstreams(app) == {f"127.0.0.1:{api.port}", f"127.0.0.2:{a.port}"}
            assert seen_names(app, {"a"}) == {"a"}
            assert app.discovery is not None and app.discovery.restarts == 0
        finally:
            assert app.stop()


def test_no_service_account_runs_static_only(
        idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    a = idents["a"]
    cfg = fast_config([Endpoint(a.host, a.port)], enable_discovery=True)
    app = App(cfg, sa_dir=str(tmp_path / "nothing-here"))
    app.start()
    try:
        assert seen_names(app, {"a"}) == {"a"}
        assert app.discovery is not None and app.discovery.restarts == 0
        assert not app.discovery.running
    finally:
        assert app.stop()


def test_bad_input_neither_stops_discovery_nor_drops_connections(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2"], port=port))
    # Straight to the fake API server: through the proxy's own listener a re-watch could
    # be routed to an identity server (no API server), a Watch failure counted on top.
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    app = start_app(api, tmp_path, drain_timeout=0.3, kubeconfig=str(kubeconfig))
    addr = f"127.0.0.2:{port}"
    try:
        wait_until(lambda: addr in pickable(app), 10)
        s = hold(app, "a")
        with s:
            corrupt = make_slice("kubernetes", ["127.0.0.2"], port=port)
            for broken in ({"ports": None}, {"ports": [{"name": "https", "port": 0}]},
                           {"endpoints": "127.0.0.2"}, {"addressType": "IPv5"},
                           {"endpoints": [{"addresses": ["127.0.0.300"]}]}):
                api.set_slice(corrupt | broken)
            for raw in (b"not json", b'{"type":"ADDED","object":{"metadata":{"name":"x',
                        b'{"type":"NOPE","object":{"metadata":{"name":"kubernetes"}}}',
                        b'{"type":"BOOKMARK","object":{"metadata":{}}}',
                        b'{"type":"DELETED","object":{"metadata":{"name":"ghost"}}}'):
                api.inject_raw(raw)
            api.set_slice(make_slice("kubernetes-other", ["127.0.0.9"], port=port,
                                     service="not-kubernetes"))
            api.send_error_event(403, message="forbidden, say")  # counted; re-watch
            wait_until(lambda: len(api.watch_requests()) >= 2 and api.open_streams() == 1, 10,
                       message="re-watch after the ERROR event")
            # a marker: once it is applied, everything before it has been too
            api.set_slice(make_slice("kubernetes-2", ["127.0.0.3"], port=port))
            wait_until(lambda: f"127.0.0.3:{port}" in upstreams(app), 10, message="marker")
            u = app.registry.snapshot().get(addr)
            assert u is not None and not u.draining and addr in pickable(app)
            assert echoes(s)
            assert f"127.0.0.9:{port}" not in upstreams(app)
        assert sample(app.metrics, ERRORS, {"provider": "kubernetes"}) == 1
        assert app.discovery is not None and app.discovery.running
        assert app.discovery.restarts == 0
    finally:
        assert app.stop()


def test_emptying_the_only_slice_leaves_the_static_endpoints(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    port = idents["a"].port
    api.set_slice(make_slice("kubernetes", ["127.0.0.2"], port=port))
    app = start_app(api, tmp_path, drain_timeout=0.0)
    static = f"127.0.0.1:{api.port}"
    try:
        wait_until(lambda: upstreams(app) == {static, f"127.0.0.2:{port}"}, 10)
        # what the API server's reconciler writes when no API server is left
        api.set_slice(make_slice("kubernetes", [], port=port) | {"endpoints": None,
                                                                 "ports": None})
        wait_until(lambda: upstreams(app) == {static}, 10, message="static only")
        assert pickable(app) == {static}
        assert sample(app.metrics, ERRORS, {"provider": "kubernetes"}) in (None, 0.0)
    finally:
        assert app.stop()


def test_ipv6_slice_endpoints_are_dialled_in_brackets(
        api: FakeApiServer, tmp_path: Path) -> None:
    try:
        v6 = IdentityServer(name="v6", host="::1").start()
    except OSError as exc:  # pragma: no cover - no IPv6 loopback here
        pytest.skip(f"no ::1: {exc}")
    try:
        api.set_slice(make_slice("kubernetes", ["0:0:0:0:0:0:0:1"], port=v6.port,
                                 address_type="IPv6"))
        app = start_app(api, tmp_path)
        try:
            wait_until(lambda: f"[::1]:{v6.port}" in pickable(app), 10)
            assert seen_names(app, {"v6"}) == {"v6"}
        finally:
            assert app.stop()
    finally:
        v6.stop()


def test_a_dying_watcher_does_not_fail_healthz_and_is_restarted(
        api: FakeApiServer, idents: dict[str, IdentityServer], tmp_path: Path) -> None:
    # Provider failures are isolated: a watcher that dies is restarted and counted, and
    # /healthz (a kubelet restart would cut every connection of the node) stays 200.
    # The old heartbeat failed liveness with "discovery thread exited".
    from extractedprism.discovery import watch
    from tests.util import http

    deaths: list[int] = []

    def always_dies(self: object, client: object) -> None:
        deaths.append(1)
        raise RuntimeError("bug in the loop")

    a = idents["a"]
    original = watch.KubernetesProvider._watch_forever
    watch.KubernetesProvider._watch_forever = always_dies  # type: ignore[method-assign]
    try:
        app = start_app(api, tmp_path, static=[Endpoint(a.host, a.port)])
    finally:
        watch.KubernetesProvider._watch_forever = original  # type: ignore[method-assign]
    try:
        wait_until(lambda: deaths, 10, message="the watcher died")
        beat = app.heartbeat.last_beat
        # several heartbeats (--liveness-interval) after the death
        wait_until(lambda: app.heartbeat.last_beat > beat + 3 * app.config.liveness_interval,
                   10 * app.config.liveness_threshold, message="heartbeats after the death")
        assert http(app.health_address, "/healthz")[0] == 200
        assert app.discovery is not None and app.discovery.running  # waiting to restart
        assert sample(app.metrics, ERRORS, {"provider": "kubernetes"}) == len(deaths) >= 1
        assert seen_names(app, {"a"}) == {"a"}
    finally:
        assert app.stop()
