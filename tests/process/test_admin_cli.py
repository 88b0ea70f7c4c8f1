"""`extractedprism admin` against a real proxy process, as `kubectl exec` would run it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator

import pytest

from tests.fakes.upstream import IdentityServer
from tests.process.test_cli import reap, start_proxy
from tests.util import free_ports, http, run_cli, wait_until


@pytest.fixture
def sock_path() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ep-adm-", dir="/tmp")
    yield os.path.join(d, "admin.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def two() -> Iterator[list[IdentityServer]]:
    ups = [IdentityServer(name=f"up{i}").start() for i in range(2)]
    yield ups
    for u in ups:
        u.stop()


def test_drain_list_undrain_against_a_running_proxy(two, sock_path) -> None:
    a, b = (u.address for u in two)
    proc, _bind, health = start_proxy("--endpoints", f"{a},{b}", "--admin-socket", sock_path)
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        res = run_cli("admin", "--socket", sock_path, "drain", a)
        assert res.returncode == 0, res.stderr
        doc = json.loads(http(("127.0.0.1", health), "/upstreams")[2])
        (entry,) = [u for u in doc["upstreams"] if u["address"] == a]
        assert entry["state"] == "admin-drain" and entry["admin"]["uid"] == os.getuid()
        res = run_cli("admin", "list", env={"EP_ADMIN_SOCKET": sock_path})
        assert res.returncode == 0, res.stderr
        line = next(x for x in res.stdout.splitlines() if x.startswith(a))
        assert "admin-drain" in line and f"drain by uid {os.getuid()}" in line
        res = run_cli("admin", "--socket", sock_path, "close", "--force", "10.0.0.1:6443")
        assert res.returncode == 2 and "unknown upstream 10.0.0.1:6443" in res.stderr
        res = run_cli("admin", "--socket", sock_path, "undrain", a)
        assert res.returncode == 0, res.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not os.path.exists(sock_path)
    finally:
        reap(proc)


def test_an_unusable_admin_socket_path_exits_1_naming_the_flag(two, sock_path) -> None:
    bad = os.path.join(os.path.dirname(sock_path), "missing", "admin.sock")
    bind, health = free_ports(2)
    res = run_cli("--endpoints", two[0].address, "--bind-port", str(bind), "--health-port",
                  str(health), "--enable-discovery=false", "--admin-socket", bad)
    assert res.returncode == 1
    assert "--admin-socket" in res.stderr and "does not exist" in res.stderr


def test_proxy_still_runs_after_garbage_on_the_admin_socket(two, sock_path) -> None:
    import socket

    proc, _bind, health = start_proxy("--endpoints", two[0].address, "--admin-socket",
                                      sock_path)
    try:
        for junk in (b"\x00" * 10000, b"{", b'{"command": 5}\n', b"\n"):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(sock_path)
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
        wait_until(lambda: run_cli("admin", "--socket", sock_path, "list").returncode == 0, 5)
        assert http(("127.0.0.1", health), "/healthz")[0] == 200
        assert proc.poll() is None
    finally:
        reap(proc)
