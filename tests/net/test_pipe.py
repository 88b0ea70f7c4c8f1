"""Pipe in isolation on real loopback TCP pairs: what one pipe thread leaves behind."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from extractedprism import pipe as pipe_mod
from extractedprism.pipe import Pipe


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


@pytest.mark.parametrize("mode", ["splice", "buffer"])
def test_bytes_stranded_by_a_dead_upstream_never_reach_the_next_connection(mode):
    """A write that fails after the read must not leave bytes in the thread's kernel pipe."""
    results: dict[str, bytes] = {}

    def one_thread() -> None:
        # Connection 1: the upstream is already reset when the client's bytes arrive.
        client, proxy_c = tcp_pair()
        proxy_u, upstream = tcp_pair()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        upstream.close()
        client.sendall(b"STRANDED" * 1000)
        Pipe(proxy_c, proxy_u, client_addr="c1", upstream_addr="u1", mode=mode).run()
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
        Pipe(proxy_c, proxy_u, client_addr="c2", upstream_addr="u2", mode=mode).run()
        reader.join(5)
        assert not reader.is_alive(), "the upstream never saw the client's EOF"
        results["got"] = got
        client.close()
        upstream.close()

    run_in_thread(one_thread)
    assert results["got"] == b"HELLO"


def test_thread_pipes_are_reused_across_connections():
    seen: list[object] = []

    def one_thread() -> None:
        for _ in range(2):
            client, proxy_c = tcp_pair()
            proxy_u, upstream = tcp_pair()
            client.sendall(b"x")
            client.shutdown(socket.SHUT_WR)
            upstream.shutdown(socket.SHUT_WR)
            Pipe(proxy_c, proxy_u, client_addr="c", upstream_addr="u", mode="splice").run()
            seen.append(pipe_mod._local.pipes)
            assert upstream.recv(10) == b"x"
            client.close()
            upstream.close()

    run_in_thread(one_thread)
    assert seen[0] is seen[1] and seen[0] is not None
