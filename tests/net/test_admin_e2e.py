"""Runtime control end to end (issue 15 item 3): a real App with --admin-socket, real
upstreams and live client connections, driven through the `extractedprism admin` client."""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extractedprism.app import App
from extractedprism.ops import admin
from tests.conftest import fast_config
from tests.net.test_drain import closed, open_to, still_open
from tests.net.test_upstreams_doc import entry, readyz_by_hand, when
from tests.util import first_checks_recorded, wait_until, whoami


@pytest.fixture
def sock_path() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ep-adm-", dir="/tmp")  # short: unix paths max 107 bytes
    yield os.path.join(d, "admin.sock")
    shutil.rmtree(d, ignore_errors=True)


def run(path: str, *args: str) -> int:
    return admin.main(["--socket", path, *args])


def names(app: Any, n: int = 20) -> set[str]:
    return {whoami(app) for _ in range(n)}


def test_socket_is_0600_and_goes_with_the_app(make_app, servers, sock_path) -> None:
    ups = servers(1)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path)
    st = os.stat(sock_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert app.stop()
    assert not os.path.exists(sock_path)


def test_drain_keeps_live_connections_stops_new_ones_and_undrain_restores(
        make_app, servers, sock_path, capsys, caplog) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path)
    addr = str(ups[0].endpoint)
    (conn,) = open_to(app, "up0")
    with conn:
        assert run(sock_path, "drain", addr) == 0
        assert addr in capsys.readouterr().out
        assert names(app) == {"up1"}
        assert still_open(conn)  # existing connections stay
        u = entry(app, addr)
        assert u["state"] == "admin-drain"
        assert u["draining"] is False and u["draining_reason"] == "admin"
        assert u["close_deadline"] is None
        assert u["admin"]["action"] == "drain" and u["admin"]["uid"] == os.getuid()
        when(u["admin"]["at"])
        assert u["active_connections"] == 1
        # Still health-checked while drained (each check is one accepted connection).
        seen = ups[0].accepted
        wait_until(lambda: ups[0].accepted >= seen + 2, 5, message="probes continue")
        logged = [r.getMessage() for r in caplog.records if r.name == "extractedprism.ops.admin"]
        assert any(f"action=drain upstream={addr} uid={os.getuid()}" in m for m in logged)

        assert run(sock_path, "undrain", addr) == 0
        u = entry(app, addr)
        assert u["state"] == "healthy" and u["admin"] is None and u["draining_reason"] is None
        wait_until(lambda: "up0" in names(app), 5)
        assert still_open(conn)


def test_undrain_brings_it_back_only_once_healthy(make_app, servers, sock_path, capsys
                                                  ) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path)
    wait_until(lambda: first_checks_recorded(ups), 5)
    addr = str(ups[0].endpoint)
    assert run(sock_path, "drain", addr) == 0
    ups[0].close_listener()
    wait_until(lambda: entry(app, addr)["healthy"] is False, 5, message="probed while drained")
    assert run(sock_path, "undrain", addr) == 0
    assert "unhealthy" in capsys.readouterr().out  # says it is not back yet
    assert entry(app, addr)["state"] == "unhealthy"
    assert names(app) == {"up1"}
    ups[0].start()
    wait_until(lambda: entry(app, addr)["healthy"], 5)
    wait_until(lambda: "up0" in names(app), 5)


def _close_times(conns: list[socket.socket], limit: float) -> list[float]:
    """When each connection was closed by the proxy (EOF or reset), within ``limit`` s."""
    sel = selectors.DefaultSelector()
    for c in conns:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
    out: list[float] = []
    deadline = time.monotonic() + limit
    try:
        while len(out) < len(conns) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.05):
                try:
                    data = key.fileobj.recv(100)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    out.append(time.monotonic())
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
    return out


def test_close_spreads_the_closes_over_the_drain_timeout(make_app, servers, sock_path
                                                         ) -> None:
    drain = 1.5
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path, drain_timeout=drain)
    addr = str(ups[0].endpoint)
    conns = open_to(app, "up0", want=3)
    try:
        t0 = time.monotonic()
        wall0 = time.time()
        assert run(sock_path, "close", addr) == 0
        # The command returns at once: the closes go on in the background.
        assert sum(still_open(c) for c in conns) >= 2
        u = entry(app, addr)
        assert u["state"] == "admin-drain" and u["draining_reason"] == "admin"
        assert u["admin"]["action"] == "close"
        assert wall0 + drain - 0.5 <= when(u["close_deadline"]) <= time.time() + drain + 0.5
        assert names(app) == {"up1"}  # close also stops new picks
        times = _close_times(conns, drain + 3)
        assert len(times) == 3
        assert times[-1] - t0 <= drain + 1.5
        # Spread, not all at once: from a third of the timeout to all of it.
        assert times[-1] - times[0] >= drain / 3
        wait_until(lambda: entry(app, addr)["active_connections"] == 0, 5)
        u = entry(app, addr)
        assert u["close_deadline"] is None and u["state"] == "admin-drain"
        assert names(app) == {"up1"}
    finally:
        for c in conns:
            c.close()


def test_close_is_refused_when_nothing_healthy_would_be_left_unless_forced(
        make_app, servers, sock_path, capsys) -> None:
    ups = servers(2)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path, drain_timeout=0.0)
    addr = str(ups[0].endpoint)
    (conn,) = open_to(app, "up0")
    with conn:
        ups[1].close_listener()
        wait_until(lambda: entry(app, str(ups[1].endpoint))["healthy"] is False, 5)
        assert run(sock_path, "close", addr) == 1
        err = capsys.readouterr().err
        assert "refused" in err and "no other healthy upstream" in err and "--force" in err
        assert entry(app, addr)["admin"] is None and entry(app, addr)["state"] == "healthy"
        assert still_open(conn)
        assert run(sock_path, "close", "--force", addr) == 0
        assert closed(conn)
        assert entry(app, addr)["admin"]["action"] == "close"


def test_close_in_readyz_mode_needs_another_ready_upstream(make_app, servers, sock_path,
                                                           tmp_path: Path, capsys) -> None:
    ups = servers(2)
    ready = {str(ups[0].endpoint): True, str(ups[1].endpoint): False}
    app = make_app([u.endpoint for u in ups], **readyz_by_hand(ready, tmp_path),
                   admin_socket=sock_path)
    addr = str(ups[0].endpoint)
    wait_until(lambda: entry(app, str(ups[1].endpoint))["readiness"] == "unready", 5)
    # up1 is healthy (TCP) but not ready: closing up0 would leave nothing ready.
    assert run(sock_path, "close", addr) == 1
    assert "no other ready upstream" in capsys.readouterr().err
    ready[str(ups[1].endpoint)] = True
    wait_until(lambda: entry(app, str(ups[1].endpoint))["ready"], 5)
    assert run(sock_path, "close", addr) == 0


def test_unknown_address_and_unreachable_socket_exit_2(make_app, servers, sock_path, capsys
                                                       ) -> None:
    ups = servers(1)
    app = make_app([u.endpoint for u in ups], admin_socket=sock_path)
    assert run(sock_path, "drain", "127.0.0.1:1") == 2
    err = capsys.readouterr().err
    assert "unknown upstream 127.0.0.1:1" in err and str(ups[0].endpoint) in err
    assert run(sock_path, "list") == 0
    out = capsys.readouterr().out
    assert str(ups[0].endpoint) in out and "healthy" in out
    app.stop()
    assert run(sock_path, "list") == 2
    assert "cannot reach the admin socket" in capsys.readouterr().err


def test_a_missing_directory_fails_start_naming_the_flag(servers, sock_path) -> None:
    ups = servers(1)
    bad = os.path.join(os.path.dirname(sock_path), "missing", "admin.sock")
    app = App(fast_config([u.endpoint for u in ups], admin_socket=bad))
    try:
        with pytest.raises(OSError, match=r"--admin-socket .*missing does not exist"):
            app.start()
    finally:
        app.stop()
