"""The admin socket and the `extractedprism admin` client, against a stub registry side.

Real unix sockets in a private directory, real SO_PEERCRED, the client run in-process
(``admin.main``) and once as a subprocess. The registry's own admin behaviour (drain,
close against live connections, the refusal) is tested in tests/net/test_admin_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from extractedprism.ops import admin
from tests.util import run_cli, send_and_read_to_eof, wait_until


class StubTarget:
    """Records calls; answers what the test set."""

    def __init__(self, known: list[str]) -> None:
        self.known = known
        self.calls: list[tuple[Any, ...]] = []
        self.answer: tuple[int, str] = (0, "ok")
        self.explode = False
        self.lock = threading.Lock()

    def known_addresses(self) -> list[str]:
        return list(self.known)

    def _call(self, *args: Any) -> tuple[int, str]:
        with self.lock:
            self.calls.append(args)
        if self.explode:
            raise RuntimeError("boom")
        return self.answer

    def drain(self, address: str, uid: int) -> tuple[int, str]:
        return self._call("drain", address, uid)

    def undrain(self, address: str, uid: int) -> tuple[int, str]:
        return self._call("undrain", address, uid)

    def close(self, address: str, uid: int, *, force: bool) -> tuple[int, str]:
        return self._call("close", address, uid, force)


def listing() -> list[dict[str, Any]]:
    return [{"address": "127.0.0.1:6443", "state": "admin-drain", "healthy": True,
             "ready": None, "active_connections": 2,
             "admin": {"action": "drain", "uid": 1000, "at": "2026-12-01T20:00:00.000+00:00"}}]


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Short on purpose: a unix socket path has at most 107 bytes.
    d = tempfile.mkdtemp(prefix="ep-adm-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def served(sockdir: str) -> Iterator[tuple[admin.AdminServer, StubTarget]]:
    target = StubTarget(["127.0.0.1:6443", "[::1]:6443"])
    server = admin.AdminServer(os.path.join(sockdir, "admin.sock"), target, listing)
    server.start()
    yield server, target
    server.stop()


def raw_request(path: str, data: bytes, *, shut: bool = True) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        buf = send_and_read_to_eof(s, data, half_close=shut)
    return json.loads(buf)


def answers_a_list(path: str) -> bool:
    """An AdminServer started on ``path`` answers a list request (stopped after)."""
    server = admin.AdminServer(path, StubTarget([]), listing)
    server.start()
    try:
        return raw_request(path, b'{"command": "list"}\n')["code"] == 0
    finally:
        server.stop()


# -- the socket ---------------------------------------------------------------------------


def test_socket_is_created_with_mode_0600_and_removed_on_stop(sockdir: str) -> None:
    path = os.path.join(sockdir, "admin.sock")
    server = admin.AdminServer(path, StubTarget([]), listing)
    server.start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert os.listdir(sockdir) == ["admin.sock"]  # no temporary name left behind
    finally:
        assert server.stop()
    assert not os.path.exists(path)


def test_a_stale_socket_is_replaced(sockdir: str) -> None:
    path = os.path.join(sockdir, "admin.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a killed process leaves
    assert answers_a_list(path)


def test_a_live_socket_or_a_regular_file_is_not_taken_over(
        served: tuple[admin.AdminServer, StubTarget], sockdir: str) -> None:
    server, _ = served
    other = admin.AdminServer(server.path, StubTarget([]), listing)
    with pytest.raises(OSError, match=r"--admin-socket .*another process is serving on it"):
        other.bind()
    plain = os.path.join(sockdir, "file")
    with open(plain, "w") as fh:
        fh.write("keep me")
    with pytest.raises(OSError, match=r"--admin-socket .*exists and is not a socket"):
        admin.AdminServer(plain, StubTarget([]), listing).bind()
    with open(plain) as fh:
        assert fh.read() == "keep me"
    with pytest.raises(OSError, match=r"--admin-socket .*directory .*nope does not exist"):
        admin.AdminServer(os.path.join(sockdir, "nope", "a.sock"), StubTarget([]),
                          listing).bind()


def test_a_path_near_the_unix_limit_still_works_and_a_longer_one_is_named(sockdir: str
                                                                         ) -> None:
    room = 107 - len(os.fsencode(sockdir)) - 1
    path = os.path.join(sockdir, "a" * room)  # exactly the longest a unix socket takes
    assert answers_a_list(path)
    with pytest.raises(OSError, match=r"--admin-socket .*too long"):
        admin.AdminServer(path + "a", StubTarget([]), listing).bind()


def test_peer_credentials_are_this_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert admin.peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())


# -- requests -----------------------------------------------------------------------------


def test_actions_reach_the_target_with_the_callers_uid(
        served: tuple[admin.AdminServer, StubTarget], caplog: pytest.LogCaptureFixture
) -> None:
    server, target = served
    uid = os.getuid()
    assert raw_request(server.path, b'{"command": "drain", "address": "127.0.0.1:6443"}\n'
                       ) == {"code": 0, "message": "ok"}
    # Addresses are normalised to the registry's spelling (brackets for IPv6).
    raw_request(server.path, b'{"command": "close", "address": "[::1]:6443", "force": true}\n')
    raw_request(server.path, b'{"command": "undrain", "address": " 127.0.0.1:6443"}\n')
    assert target.calls == [("drain", "127.0.0.1:6443", uid), ("close", "[::1]:6443", uid, True),
                            ("undrain", "127.0.0.1:6443", uid)]
    logged = [r.getMessage() for r in caplog.records if r.name == "extractedprism.ops.admin"]
    assert any(f"action=drain upstream=127.0.0.1:6443 uid={uid} pid={os.getpid()}" in m
               for m in logged), logged


@pytest.mark.parametrize(("data", "expect"), [
    (b"not json\n", "not a JSON object"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"command": "shutdown"}\n', "unknown command 'shutdown'"),
    (b'{"command": "drain"}\n', "drain needs an upstream address"),
    (b'{"command": "drain", "address": "nohost"}\n', "'nohost' is not an upstream address"),
    (b'{"command": "drain", "address": "10.9.9.9:6443"}\n',
     "unknown upstream 10.9.9.9:6443; known upstreams: 127.0.0.1:6443, [::1]:6443"),
    (b'{"command": "close", "address": "127.0.0.1:6443", "force": "yes"}\n',
     "force must be true or false"),
    (b"\xff\xfe\n", "not a JSON object"),
    (b"x" * (admin.MAX_REQUEST_BYTES + 10), "longer than 4096 bytes"),
    (b"", "empty request"),
])
def test_bad_requests_get_code_2_naming_the_problem(
        served: tuple[admin.AdminServer, StubTarget], data: bytes, expect: str) -> None:
    server, target = served
    reply = raw_request(server.path, data)
    assert reply["code"] == 2
    assert expect in reply["message"]
    assert target.calls == []
    # ...and the server goes on answering.
    assert raw_request(server.path, b'{"command": "list"}\n')["code"] == 0


def test_a_silent_client_does_not_block_the_socket_for_long(
        served: tuple[admin.AdminServer, StubTarget]) -> None:
    server, _ = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(server.path)
        # Answered with a timeout message once REQUEST_TIMEOUT_S passes; the next
        # client is served after that.
        silent.settimeout(admin.REQUEST_TIMEOUT_S * 5)
        reply = json.loads(silent.recv(65536))
        assert reply["code"] == 2 and "not complete within" in reply["message"]
    assert raw_request(server.path, b'{"command": "list"}\n')["code"] == 0


def test_a_crashing_target_does_not_end_the_thread(
        served: tuple[admin.AdminServer, StubTarget]) -> None:
    server, target = served
    target.explode = True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(server.path)
        s.sendall(b'{"command": "drain", "address": "127.0.0.1:6443"}\n')
        assert s.recv(100) == b""  # no answer, connection closed
    target.explode = False
    assert raw_request(server.path, b'{"command": "list"}\n')["code"] == 0


# -- the client -----------------------------------------------------------------------------


def test_client_exit_status_follows_the_answer(
        served: tuple[admin.AdminServer, StubTarget], capsys: pytest.CaptureFixture[str]
) -> None:
    server, target = served
    assert admin.main(["--socket", server.path, "drain", "127.0.0.1:6443"]) == 0
    assert "ok" in capsys.readouterr().out
    target.answer = (1, "closing 127.0.0.1:6443 would leave no other healthy upstream")
    assert admin.main(["--socket", server.path, "close", "127.0.0.1:6443"]) == 1
    assert "would leave no other healthy upstream" in capsys.readouterr().err
    assert admin.main(["--socket", server.path, "close", "--force", "127.0.0.1:6443"]) == 1
    assert target.calls[-1] == ("close", "127.0.0.1:6443", os.getuid(), True)
    assert admin.main(["--socket", server.path, "drain", "10.1.1.1:6443"]) == 2
    assert "unknown upstream 10.1.1.1:6443" in capsys.readouterr().err


def test_client_list_prints_a_table(
        served: tuple[admin.AdminServer, StubTarget], capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = served
    assert admin.main(["--socket", server.path, "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ADDRESS", "STATE", "HEALTHY", "READY", "ACTIVE", "ADMIN"]
    assert out[1].split()[:5] == ["127.0.0.1:6443", "admin-drain", "yes", "-", "2"]
    assert "drain by uid 1000" in out[1]


def test_client_usage_errors_exit_2(sockdir: str, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(admin.ENV_SOCKET, raising=False)
    assert admin.main(["drain", "127.0.0.1:6443"]) == 2
    assert "no admin socket: pass --socket PATH or set EP_ADMIN_SOCKET" in capsys.readouterr().err
    path = os.path.join(sockdir, "none.sock")
    assert admin.main(["--socket", path, "list"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the admin socket {path}" in err
    assert admin.main(["--socket", path, "frobnicate"]) == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
    assert admin.main(["--socket", path, "drain"]) == 2
    assert "ADDR" in capsys.readouterr().err
    assert admin.main(["--socket", path, "drain", "no-port"]) == 2
    assert "'no-port' is not an upstream address" in capsys.readouterr().err
    assert admin.main(["--socket", path]) == 2
    assert "give a command" in capsys.readouterr().err


def test_socket_may_follow_the_command(
        served: tuple[admin.AdminServer, StubTarget], capsys: pytest.CaptureFixture[str]
) -> None:
    server, target = served
    assert admin.main(["close", "--socket", server.path, "127.0.0.1:6443", "--force"]) == 0
    assert admin.main(["--socket", "/nonexistent", "list", "--socket", server.path]) == 0
    assert admin.main(["--socket", server.path, "list"]) == 0
    assert target.calls == [("close", "127.0.0.1:6443", os.getuid(), True)]


def test_client_reads_the_socket_from_the_environment(
        served: tuple[admin.AdminServer, StubTarget], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    server, target = served
    monkeypatch.setenv(admin.ENV_SOCKET, server.path)
    assert admin.main(["undrain", "127.0.0.1:6443"]) == 0
    assert target.calls == [("undrain", "127.0.0.1:6443", os.getuid())]


def test_the_subcommand_runs_through_the_entry_point(
        served: tuple[admin.AdminServer, StubTarget]) -> None:
    server, target = served
    res = run_cli("admin", "drain", "127.0.0.1:6443", env={"EP_ADMIN_SOCKET": server.path})
    assert res.returncode == 0, res.stderr
    wait_until(lambda: target.calls, 5)
    assert target.calls[0][:2] == ("drain", "127.0.0.1:6443")
    res = run_cli("admin", "--help")
    assert res.returncode == 0 and "drain" in res.stdout and "Exit status" in res.stdout


NOBODY = 65534
_CONNECT_AS = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES")
    raise SystemExit(0)
s.sendall(b'{"command": "drain", "address": "127.0.0.1:6443"}\\n')
print(json.loads(s.recv(65536))["message"])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_other_users_cannot_connect_and_are_refused_if_the_mode_is_loosened(
        served: tuple[admin.AdminServer, StubTarget], sockdir: str) -> None:
    import subprocess

    # The test's own interpreter may sit where nobody may read (/root/.pyenv, say); the
    # client needs only the standard library.
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 to run as another user")
    server, target = served
    os.chmod(sockdir, 0o755)  # the directory is not what keeps them out: the mode is

    def as_nobody() -> str:
        return subprocess.run([python, "-c", _CONNECT_AS, server.path], user=NOBODY,
                              capture_output=True, text=True, timeout=20, cwd="/"
                              ).stdout.strip()

    assert as_nobody() == "EACCES"
    os.chmod(server.path, 0o666)
    assert as_nobody() == f"uid {NOBODY} may not use this admin socket"
    assert target.calls == []
