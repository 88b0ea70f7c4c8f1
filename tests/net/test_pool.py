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
    # The idle baseline: no pipe thread before any connection (threads start on demand).
    assert _pipe_threads() == 0
    app.proxy.pipe_pool.idle_exit_s = 1.0  # the surplus' retirement, shortened
    threads0, fds0 = pool_mod.WARM_THREADS, _fds()
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
    # Never more threads than connections alive at once.
    assert pool.peak_threads <= pool.peak_live, pool
    t_end = time.monotonic()
    # Back to the baseline within 20 s: the threads beyond the warm ones exit, and parked
    # threads give their kernel pipes back.
    wait_until(lambda: _pipe_threads() <= threads0 and _fds() <= fds0, 20,
               message=f"threads <= {threads0} and fds <= {fds0} "
               f"(now {_pipe_threads()}, {_fds()})")
    assert time.monotonic() - t_end <= 20
    assert app.registry.snapshot().connections_active == 0
    # The pool still serves.
    with socket.create_connection(app.proxy_address, timeout=5) as s:
        assert s.recv(10).startswith(b"up")


def _wakeups(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as fh:
        for line in fh:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


@pytest.mark.timeout(60)
def test_an_idle_pool_keeps_a_few_warm_threads_asleep(make_app, servers):
    ups = servers(1, IdentityServer)
    app = make_app([u.endpoint for u in ups])
    pool = app.proxy.pipe_pool
    pool.idle_exit_s = pool_mod.PIPE_IDLE_RELEASE_S + 0.5  # surplus retires soon after
    assert _pipe_threads() == 0  # nothing before the first client
    n = pool_mod.WARM_THREADS + 6
    burst = [socket.create_connection(app.proxy_address, timeout=5) for _ in range(n)]
    for s in burst:
        assert s.recv(10).startswith(b"up")
    assert _pipe_threads() == n
    for s in burst:
        s.close()
    wait_until(lambda: _pipe_threads() == pool_mod.WARM_THREADS, 20,
               message="the threads beyond the warm ones retire")
    warm = [t for t in threading.enumerate() if t.name.startswith("pipe-")]
    # Each warm thread has made its one "am I surplus?" check (idle_exit_s after parking)
    # and sleeps WARM_RECHECK_S now: over a window far shorter than that, none wakes.
    time.sleep(0.5)  # not a race: only makes the window start after the last check
    before = {t.native_id: _wakeups(t.native_id) for t in warm}
    window = pool.idle_exit_s  # the old policy woke every idle_exit_s - release
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        time.sleep(0.1)
    after = {tid: _wakeups(tid) for tid in before}
    assert after == before, "a parked warm thread woke up"
    assert pool.view().idle == pool_mod.WARM_THREADS
    with socket.create_connection(app.proxy_address, timeout=5) as s:  # still serves
        assert s.recv(10).startswith(b"up")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held", [2, 3])
def test_warm_threads_and_the_trim_count_parked_threads_only(make_app, servers, monkeypatch,
                                                             held):
    """Issue 29, item 9: long-lived connections keep their threads busy; they are not
    warm. After a burst the pool keeps WARM_THREADS parked threads beside them, and the
    last surplus thread to leave trims the heap."""
    ups = servers(1, IdentityServer)
    app = make_app([u.endpoint for u in ups])
    pool = app.proxy.pipe_pool
    pool.idle_exit_s = pool_mod.PIPE_IDLE_RELEASE_S + 0.5  # surplus retires soon after
    trims: list[float] = []
    monkeypatch.setattr(pool_mod.heap, "trim", lambda: trims.append(time.monotonic()))
    long_lived = [socket.create_connection(app.proxy_address, timeout=5) for _ in range(held)]
    try:
        for s in long_lived:
            assert s.recv(10).startswith(b"up")
        burst = [socket.create_connection(app.proxy_address, timeout=5) for _ in range(6)]
        for s in burst:
            assert s.recv(10).startswith(b"up")
        for s in burst:
            s.close()
        wait_until(lambda: pool.view().threads == held + pool_mod.WARM_THREADS, 20,
                   message=f"{pool_mod.WARM_THREADS} warm threads beside {held} busy "
                   f"(now {pool.view()})")
        wait_until(lambda: trims, 5, message="the heap trimmed once the surplus left")
        time.sleep(pool.idle_exit_s + 0.5)  # the warm ones stay (deliberate wait)
        view = pool.view()
        assert view.idle == pool_mod.WARM_THREADS, view
        assert len(trims) == 1
    finally:
        for s in long_lived:
            s.close()
