"""The pipe-thread pool under a burst: growth bounded by live connections, and threads
and descriptors back to the idle baseline soon after."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from extractedprism.datapath import pool as pool_mod
from tests.fakes.upstream import IdentityServer
from tests.util import wait_until

_RST = struct.pack("ii", 1, 0)


def _pipe_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("pipe-"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("relay", ["native", "python"])
def test_burst_of_1000_connections_returns_to_the_idle_baseline(make_app, servers, relay):
    ups = servers(2, IdentityServer)
    app = make_app([u.endpoint for u in ups], relay=relay)
    # The idle baseline: the pre-started pool, before any connection (no kernel pipes).
    wait_until(lambda: _pipe_threads() >= pool_mod.PRESTART_THREADS, 5)
    threads0, fds0 = _pipe_threads(), _fds()
    # Sampled throughout: a thread is either idle or serving a live connection, never
    # neither (a finished thread that has not parked yet made the acceptor start
    # another one for the next client).
    bad: list[object] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            p = app.proxy.pipe_pool.view()
            if p.threads - p.idle > p.live:
                bad.append(p)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, name="test-pool-sampler")
    sampler.start()
    deadline = time.monotonic() + 40
    for i in range(1000):  # bounded in count and time
        if time.monotonic() > deadline:
            break
        s = socket.create_connection(app.proxy_address, timeout=5)
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
        s.close()
    done.set()
    sampler.join(5)
    assert i == 999, "the burst did not finish in time"
    assert not bad, bad[:3]
    pool = app.proxy.pipe_pool.view()
    # Never more threads than connections alive at once (beyond the pre-started ones).
    assert pool.peak_threads <= max(pool_mod.PRESTART_THREADS, pool.peak_live), pool
    t_end = time.monotonic()
    # Back to the baseline within 20 s: the extra threads exit, and parked threads give
    # their kernel pipes back.
    wait_until(lambda: _pipe_threads() <= threads0 and _fds() <= fds0, 20,
               message=f"threads <= {threads0} and fds <= {fds0} "
               f"(now {_pipe_threads()}, {_fds()})")
    assert time.monotonic() - t_end <= 20
    assert app.registry.snapshot().connections_active == 0
    # The pool still serves.
    with socket.create_connection(app.proxy_address, timeout=5) as s:
        assert s.recv(10).startswith(b"up")
