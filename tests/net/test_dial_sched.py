"""The upstream dial (non-blocking from birth, options set, deadline kept) and the
scheduling policy of the data-path threads."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import sched
from extractedprism.datapath.sockopts import CONNECTION_SOCKOPTS, dial
from tests.util import wait_until


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_dial_returns_connected_nonblocking_socket_with_options(native, host):
    # native: the relay extension's GIL-holding socket+options+connect; else the stdlib.
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host
                              else socket.AF_INET) as srv:
        port = srv.getsockname()[1]
        sock = dial(Endpoint(host, port), 2.0, native)
        with sock:
            peer, _ = srv.accept()
            with peer:
                assert sock.getpeername()[:2] == (host, port)
                assert not os.get_blocking(sock.fileno())
                for level, name, value in CONNECTION_SOCKOPTS:
                    assert sock.getsockopt(level, name) == value
                # The pipe relies on EAGAIN surfacing as BlockingIOError, not a wait.
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
                peer.sendall(b"x")
                wait_until(lambda: _readable(sock), 2)
                assert sock.recv(1) == b"x"


def _readable(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b"x"
    except BlockingIOError:
        return False


@pytest.mark.parametrize("native", [True, False])
def test_dial_refused_raises_connection_refused(native):
    # Bound but not listening: the kernel refuses, and the port stays ours meanwhile (a
    # port freed again could be taken by another process and accept the dial).
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectionRefusedError):
            dial(Endpoint("127.0.0.1", bound.getsockname()[1]), 2.0, native)


@pytest.mark.timeout(30)
def test_native_connect_sends_the_clients_first_bytes_on():
    """Dialer._fast's one call: a connect done at once also takes what the client has sent
    and sends it on (take_first); nothing sent yet: (None, 0), and the bytes stay put."""
    from extractedprism.datapath import sockopts

    if sockopts._native_connect is None:
        pytest.skip("the native relay extension is not built")
    client, proxy_side = socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as srv, client, proxy_side:
        target = (socket.AF_INET, "127.0.0.1", srv.getsockname()[1])
        fd, err, first, sent = sockopts.native_connect(target, proxy_side.fileno())
        assert err == 0 and (first, sent) == (None, 0)  # the client said nothing yet
        os.close(fd)
        srv.accept()[0].close()
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        wait_until(lambda: _has_bytes(proxy_side), 2)
        fd, err, first, sent = sockopts.native_connect(target, proxy_side.fileno())
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fd)
        with upstream, srv.accept()[0] as peer:
            assert err == 0 and first == b"GET / HTTP/1.1\r\n\r\n" and sent == len(first)
            peer.settimeout(2)
            assert peer.recv(100) == first
        # Without a client fd nothing is taken.
        fd, err, first, sent = sockopts.native_connect(target)
        assert (first, sent) == (None, 0)
        os.close(fd)


def _has_bytes(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def test_native_connect_leaves_odd_addresses_to_the_stdlib():
    from extractedprism.datapath import sockopts

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        # A hostname's resolved address goes the native way; "localhost" itself would not
        # parse as numeric and falls back, connecting all the same.
        for host in ("127.0.0.1", "localhost"):
            sock, err = sockopts.begin_connect(socket.AF_INET, (host, port), True)
            assert sock is not None and err in (0, errno.EINPROGRESS)
            sock.close()
            srv.accept()[0].close()


def test_dial_keeps_its_deadline_when_syns_go_unanswered():
    # A listener that never accepts and has a full queue drops further SYNs, like a
    # frozen API server: the dial must give up at its deadline, not the kernel's.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):
                s = socket.socket()
                s.setblocking(False)
                err = s.connect_ex(("127.0.0.1", port))
                assert err in (0, errno.EINPROGRESS)
                fillers.append(s)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                dial(Endpoint("127.0.0.1", port), 0.3)
            assert 0.25 <= time.monotonic() - t0 < 2.0
        finally:
            for s in fillers:
                s.close()


def _policy(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.sched_getscheduler(thread.native_id)


def _data_path_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name == "acceptor" or t.name.startswith("pipe-")]


@pytest.mark.parametrize(("policy", "number"), [("batch", os.SCHED_BATCH),
                                                ("normal", os.SCHED_OTHER)])
def test_data_path_threads_get_the_configured_policy(make_app, servers, policy, number):
    (up,) = servers(1)
    app = make_app([up.endpoint], pipe_sched=policy)
    assert app.config.pipe_sched == policy
    with socket.create_connection(app.proxy_address, timeout=5) as s:
        s.recv(64)  # the fake upstream says who it is: the pipe thread ran
    threads = wait_until(lambda: _data_path_threads() or None, 5)
    assert any(t.name == "acceptor" for t in threads)
    # The pipe thread that served it (threads start on demand).
    assert len([t for t in threads if t.name.startswith("pipe-")]) >= 1
    wait_until(lambda: all(_policy(t) == number for t in _data_path_threads()), 5)
    # Only the data path changes: the health server and ticker keep the default.
    others = [t for t in threading.enumerate()
              if t.name in ("ticker", "heartbeat") and t.native_id is not None]
    assert others and all(_policy(t) == os.SCHED_OTHER for t in others)


def test_refused_policy_is_logged_once_and_harmless(monkeypatch, caplog):
    def refuse(*_args: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(sched, "_warned", set())
    monkeypatch.setattr(os, "sched_getscheduler", lambda _pid: os.SCHED_OTHER)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert sched.apply_to_current_thread("batch") is False
    assert sched.apply_to_current_thread("batch") is False
    warnings = [r for r in caplog.records if "scheduling policy" in r.getMessage()]
    assert len(warnings) == 1
    assert "policy=batch" in warnings[0].getMessage()
    assert "not permitted" in warnings[0].getMessage()
