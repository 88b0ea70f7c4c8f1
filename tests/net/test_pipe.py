"""Pipe in isolation on real loopback TCP pairs: what one pipe thread leaves behind."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from extractedprism.datapath import pipe as pipe_mod
from extractedprism.datapath.pipe import Pipe
from extractedprism.datapath.relay import resolve
from tests.util import wait_until


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    return a, b


def run_in_thread(target) -> None:  # type: ignore[no-untyped-def]
    """Run ``target`` on a thread that ends like a product pipe thread: it gives its
    kernel pipes back, which would otherwise stay open after the thread is gone."""
    def pipe_thread() -> None:
        try:
            target()
        finally:
            pipe_mod.release_thread_resources()

    t = threading.Thread(target=pipe_thread, name="test-pipe-thread")
    t.start()
    t.join(10)
    assert not t.is_alive()


# (relay, python loop's copy): the C extension, and the Python loop with splice and with
# its buffer fallback.
PATHS = [("native", "splice"), ("python", "splice"), ("python", "buffer")]
PATH_IDS = ["native", "python", "python-buffer"]


def make_pipe(client: socket.socket, upstream: socket.socket, path: tuple[str, str],
              name: str = "c") -> Pipe:
    relay, mode = path
    return Pipe(client, upstream, client_addr=name, upstream_addr="u", relay=resolve(relay),
                mode=mode)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_bytes_stranded_by_a_dead_upstream_never_reach_the_next_connection(path):
    """A write that fails after the read must not leave bytes in the thread's kernel pipe."""
    results: dict[str, bytes] = {}

    def one_thread() -> None:
        # Connection 1: the upstream is already reset when the client's bytes arrive.
        client, proxy_c = tcp_pair()
        proxy_u, upstream = tcp_pair()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        upstream.close()
        client.sendall(b"STRANDED" * 1000)
        make_pipe(proxy_c, proxy_u, path).run()
        client.close()
        # Connection 2 on the same pipe thread (same reusable kernel pipes).
        client, proxy_c = tcp_pair()
        proxy_u, upstream = tcp_pair()
        client.sendall(b"HELLO")
        client.shutdown(socket.SHUT_WR)
        upstream.settimeout(5)
        got = b""

        def drain_upstream() -> None:
            nonlocal got
            while chunk := upstream.recv(65536):
                got += chunk
            upstream.shutdown(socket.SHUT_WR)

        reader = threading.Thread(target=drain_upstream, name="test-upstream-reader")
        reader.start()
        make_pipe(proxy_c, proxy_u, path).run()
        reader.join(5)
        assert not reader.is_alive(), "the upstream never saw the client's EOF"
        results["got"] = got
        client.close()
        upstream.close()

    run_in_thread(one_thread)
    assert results["got"] == b"HELLO"


@pytest.mark.parametrize("relay", ["native", "python"])
def test_thread_pipes_are_reused_across_connections(relay):
    seen: list[object] = []

    def one_thread() -> None:
        for _ in range(2):
            client, proxy_c = tcp_pair()
            proxy_u, upstream = tcp_pair()
            client.sendall(b"x")
            client.shutdown(socket.SHUT_WR)
            upstream.shutdown(socket.SHUT_WR)
            make_pipe(proxy_c, proxy_u, (relay, "splice")).run()
            seen.append(pipe_mod._local.pipes)
            assert upstream.recv(10) == b"x"
            client.close()
            upstream.close()

    run_in_thread(one_thread)
    assert seen[0] is seen[1] and seen[0] is not None


def piped(path: tuple[str, str]) -> tuple[socket.socket, socket.socket, Pipe]:
    """A client and an upstream socket with a Pipe (not yet run) between their peers."""
    client, proxy_c = tcp_pair()
    proxy_u, upstream = tcp_pair()
    return client, upstream, make_pipe(proxy_c, proxy_u, path)


def start_pipe(p: Pipe) -> threading.Thread:
    """Run ``p`` on a thread that gives its kernel pipes back at the end, as pipe threads do."""
    def pipe_thread() -> None:
        try:
            p.run()
        finally:
            pipe_mod.release_thread_resources()

    t = threading.Thread(target=pipe_thread, name="test-pipe-run")
    t.start()
    return t


def _reset_seen(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    return False


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_reset_from_the_client_resets_the_upstream(path):
    client, upstream, p = piped(path)
    t = start_pipe(p)
    client.sendall(b"x" * 1000)
    upstream.settimeout(5)
    assert upstream.recv(1000)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    t.join(5)
    assert not t.is_alive()
    assert _reset_seen(upstream)  # passed on as a reset, not a clean EOF
    upstream.close()


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_close_from_another_thread_ends_a_busy_transfer(path):
    """Pipe.close() (drains, readiness moves, shutdown) wakes the relay mid-transfer;
    both peers see a reset; the relay's thread returns."""
    client, upstream, p = piped(path)
    stop = threading.Event()

    def pump_both() -> None:  # both directions busy, nobody reads the upstream's side
        chunk = b"y" * 65536
        client.setblocking(False)
        while not stop.is_set():
            try:
                client.send(chunk)
            except BlockingIOError:
                stop.wait(0.001)
            except OSError:
                return

    done = threading.Event()

    def run() -> None:
        try:
            p.run()
        finally:
            pipe_mod.release_thread_resources()
            done.set()

    sender = threading.Thread(target=pump_both, name="test-sender")
    relay = threading.Thread(target=run, name="test-pipe-run")
    sender.start()
    relay.start()
    try:
        wait_until(lambda: p.bytes_up > 1_000_000 or done.is_set(), 10)
        assert not done.is_set()  # the upstream never reads: the relay is stuck on POLLOUT
        p.close()
        assert done.wait(5), "close() did not end the relay"
        assert _reset_seen(upstream)
    finally:
        stop.set()
        sender.join(5)
        relay.join(5)
        client.close()
        upstream.close()


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_byte_counters_are_live_while_the_connection_runs(path):
    client, upstream, p = piped(path)
    relay = start_pipe(p)
    try:
        client.sendall(b"u" * 300_000)
        got = 0
        upstream.settimeout(5)
        while got < 300_000:
            got += len(upstream.recv(65536))
        upstream.sendall(b"d" * 5000)
        # Read from this thread while the relay still blocks (no EOF yet on either side).
        wait_until(lambda: (p.bytes_up, p.bytes_down) == (300_000, 5000), 5)
        assert relay.is_alive()
        client.shutdown(socket.SHUT_WR)
        upstream.shutdown(socket.SHUT_WR)
        relay.join(5)
        assert not relay.is_alive()
        assert (p.bytes_up, p.bytes_down) == (300_000, 5000)
    finally:
        client.close()
        upstream.close()
        relay.join(5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_up_answered_is_the_client_count_at_the_upstreams_latest_bytes(path):
    """The stall check's mark (upstreams/activity.py): client bytes beyond it came after
    the upstream's latest bytes, i.e. are unanswered."""
    client, upstream, p = piped(path)
    relay = start_pipe(p)
    try:
        upstream.settimeout(5)
        client.settimeout(5)
        client.sendall(b"GET 1\n")
        assert upstream.recv(100) == b"GET 1\n"
        wait_until(lambda: (p.bytes_up, p.up_answered) == (6, 0), 5)  # asked, unanswered
        upstream.sendall(b"answer 1\n")
        assert client.recv(100) == b"answer 1\n"
        wait_until(lambda: (p.bytes_down, p.up_answered) == (9, 6), 5)  # answered
        client.sendall(b"GET 22\n")  # the next request: unanswered again
        assert upstream.recv(100) == b"GET 22\n"
        wait_until(lambda: p.bytes_up == 13, 5)
        assert p.up_answered == 6
        upstream.sendall(b"x")
        wait_until(lambda: p.up_answered == 13, 5)
        client.shutdown(socket.SHUT_WR)
        upstream.shutdown(socket.SHUT_WR)
        relay.join(5)
        assert not relay.is_alive()
    finally:
        client.close()
        upstream.close()
        relay.join(5)


def test_native_relay_releases_the_gil():
    """The native relay blocks without the GIL: another thread runs Python meanwhile."""
    client, upstream, p = piped(("native", "splice"))
    relay = start_pipe(p)
    try:
        spins = 0
        t_end = threading.Event()
        timer = threading.Timer(0.3, t_end.set)
        timer.start()
        while not t_end.is_set():
            spins += 1
        assert spins > 10_000 and relay.is_alive()
    finally:
        client.close()
        upstream.close()
        relay.join(5)
