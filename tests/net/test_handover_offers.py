"""Issue 22 item 8: whatever a predecessor hands over, the start goes on.

A fake offering instance (a real unix socket, descriptors passed with SCM_RIGHTS) offers
things that are not listening TCP sockets: a pipe, a regular file, a UDP socket, a TCP
socket that is not listening. The new instance logs what was wrong, opens its own
listeners, serves, and keeps none of the descriptors it received (the fd-leak guard of
tests/conftest.py fails the test otherwise). Before the fix a non-socket descriptor
raised out of handover.receive (exit 1) and leaked the others.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from extractedprism.ops import handover
from extractedprism.ops.admin import AdminServer
from tests.util import http, wait_until

pytestmark = pytest.mark.timeout(60)


class FakeOfferer:
    """Answers one successor on ``path`` with ``message`` and the descriptors ``fds``,
    then reads its answer."""

    def __init__(self, path: str, message: bytes, fds: list[int]) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.server.settimeout(10)
        self.message = message
        self.fds = fds
        self.reply = b""
        self.thread = threading.Thread(name="test-fake-offerer", target=self._serve,
                                       daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            socket.send_fds(conn, [self.message], self.fds)
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                self.reply += chunk

    def close(self) -> None:
        self.server.close()
        self.thread.join(10)


def _pipe() -> tuple[int, list[int]]:
    r, w = os.pipe()
    return r, [r, w]


def _file(tmp_path: Path) -> tuple[int, list[int]]:
    fd = os.open(tmp_path / "a-file", os.O_RDWR | os.O_CREAT, 0o600)
    return fd, [fd]


def _udp() -> tuple[int, list[int]]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s.detach(), []


def _tcp_not_listening() -> tuple[int, list[int]]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    fd = s.detach()
    return fd, [fd]


KINDS: dict[str, tuple[Callable[[Path], tuple[int, list[int]]], str]] = {
    "pipe": (lambda _p: _pipe(), "a pipe, not a socket"),
    "regular-file": (_file, "a regular file, not a socket"),
    "udp-socket": (lambda _p: _udp(), "a UDP socket, not a TCP one"),
    "tcp-not-listening": (lambda _p: _tcp_not_listening(), "a TCP socket that is not listening"),
}


@pytest.fixture
def opened() -> Iterator[list[int]]:
    fds: list[int] = []
    yield fds
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _greets(address: tuple[str, int], name: bytes) -> bool:
    with socket.create_connection(address, timeout=5) as c:
        c.settimeout(5)
        return c.recv(len(name)) == name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_unusable_descriptor_in_the_offer_is_closed_and_the_start_binds_its_own(
        kind: str, make_app, servers, tmp_path: Path, opened: list[int],
        caplog: pytest.LogCaptureFixture):
    (up,) = servers(1)
    make, reason = KINDS[kind]
    # Two of them, as the proxy's and the health server's listeners.
    proxy_fd, proxy_own = make(tmp_path)
    health_fd, health_own = make(tmp_path)
    opened.extend([*proxy_own, *health_own])
    sent = [proxy_fd, health_fd]
    opened.extend(fd for fd in sent if fd not in opened)
    path = str(tmp_path / "ho.sock")
    message = json.dumps({"version": 1, "pid": 4242, "listeners": ["proxy", "health"]})
    offerer = FakeOfferer(path, message.encode() + b"\n", sent)
    caplog.set_level(logging.INFO)
    try:
        app = make_app([up.endpoint], handover_socket=path)
        assert _greets(app.proxy_address, b"up0\n")
        assert http(app.health_address, "/healthz")[0] == 200
        wait_until(lambda: not offerer.thread.is_alive(), 10, message="the offerer answered")
        # Told it took nothing, so a real predecessor would go on accepting.
        reply = json.loads(offerer.reply)
        assert reply["taken"] == []
        # The successor names itself (its pid alone names nobody in a container).
        assert reply["pid"] == os.getpid() and reply["pidns"] > 0 and reply["host"]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for name in ("proxy", "health"):
            assert any(f"the predecessor's {name} listener is unusable" in m and reason in m
                       for m in warnings), warnings
    finally:
        offerer.close()


@pytest.fixture
def offer(tmp_path: Path, opened: list[int]) -> Iterator[Callable[..., str]]:
    """Starts a FakeOfferer of ``message`` with a pipe's read end first in its
    descriptors, then ``more``; returns the handover socket's path."""
    made: list[FakeOfferer] = []

    def factory(message: bytes, *more: int) -> str:
        r, w = os.pipe()
        opened.extend([r, w])
        path = str(tmp_path / "ho.sock")
        made.append(FakeOfferer(path, message, [r, *more]))
        return path

    yield factory
    for o in made:
        o.close()


def test_a_malformed_offer_closes_every_descriptor(offer, caplog: pytest.LogCaptureFixture):
    # A pid that is not a number, and two names for one descriptor.
    path = offer(b'{"version": 1, "pid": "x", "listeners": ["proxy", "health"]}\n')
    caplog.set_level(logging.WARNING)
    assert handover.receive(path) is None
    assert "2 listeners named, 1 descriptors received" in caplog.text


def test_a_usable_listener_next_to_a_pipe_is_taken(offer, caplog: pytest.LogCaptureFixture):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        path = offer(b'{"version": 1, "pid": 7, "listeners": ["health", "proxy"]}\n',
                     listener.fileno())
        caplog.set_level(logging.WARNING)
        received = handover.receive(path)
        assert received is not None and set(received.sockets) == {"proxy"}
        taken = received.take("proxy")
        assert taken is not None and taken.getsockname() == listener.getsockname()
        taken.close()
        received.abort()
    assert "the predecessor's health listener is unusable" in caplog.text


def test_neither_unix_socket_changes_the_process_umask(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    # The umask is process-wide: changing it while other threads create files (a state
    # file write, a log file) would give their files the wrong mode.
    calls: list[int] = []
    real = os.umask

    def spy(mask: int) -> int:
        calls.append(mask)
        return real(mask)

    monkeypatch.setattr(os, "umask", spy)
    offer = handover.Offer(str(tmp_path / "ho.sock"), dict, lambda names: None)
    offer.start()
    admin = AdminServer(str(tmp_path / "admin.sock"), None, list)  # type: ignore[arg-type]
    admin.bind()
    try:
        assert calls == []
        for p in ("ho.sock", "admin.sock"):
            assert ((tmp_path / p).stat().st_mode & 0o777) == 0o600
        assert sorted(os.listdir(tmp_path)) == ["admin.sock", "ho.sock"]
    finally:
        offer.stop()
        admin.stop()


def test_the_peer_is_described_by_pid_namespace_and_host_not_by_pid_alone():
    # In a container the predecessor's pid is 1 in its own PID namespace; the inode of
    # that namespace and the host name say which process it was (lsns -t pid).
    assert handover.describe_peer({"pid": 1, "pidns": 4026532801, "host": "node-a",
                                   "app": "1.2.3"}) == (
        "pid=1 pidns=4026532801 host=node-a app=1.2.3")
    # An older peer sends its pid only; odd values are quoted or left out, never trusted.
    assert handover.describe_peer({"pid": 77}) == "pid=77"
    assert handover.describe_peer({"pid": True, "host": "a b\n", "pidns": [1]}) == (
        "host='a b\\n'")
    assert handover.describe_peer({}) == "pid=?"
    me = handover.identity()
    assert me["pid"] == os.getpid() and me["pidns"] == os.stat("/proc/self/ns/pid").st_ino
