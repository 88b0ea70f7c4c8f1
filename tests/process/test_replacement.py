"""A replacement started while its predecessor drains after SIGTERM (issue 40).

`kubectl delete pod`, an eviction or a node drain sends SIGTERM to the running pod and
starts its replacement at once, beside it. Before this, the draining process closed the
proxy port at SIGTERM but held the health port through its whole drain: the replacement
exited on "cannot listen on 127.0.0.1:<health>: address already in use", the kubelet's
back-off did the rest, and the proxy port refused connections for ~22 s on a real node
(435-465 refused). Two real processes on loopback here, the second started once the
first logs its drain.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.fakes.upstream import IdentityServer
from tests.process.lifecycle import (
    ClientLoop,
    HeldConnections,
    Proc,
    healthz_ok,
    proxy_args,
    start_first,
)
from tests.util import wait_until

pytestmark = pytest.mark.timeout(120)

GREETING = b"up\n"
SHUTDOWN_BOUND_S = 6.0  # the program's shutdown after the drain (docs/lifecycle.md)


@pytest.fixture
def upstream():
    up = IdentityServer(name="up").start()
    yield up
    up.stop()


def test_replacement_during_the_drain_takes_over_without_a_refused_connection(
        upstream, tmp_path: Path):
    sock_path = str(tmp_path / "handover.sock")
    drain = 6.0
    extra = ("--handover-socket", sock_path, "--shutdown-drain-timeout", f"{drain:g}s")
    old, bind, health = start_first(upstream.address, *extra)
    new: Proc | None = None
    loop: ClientLoop | None = None
    held: HeldConnections | None = None
    try:
        wait_until(lambda: os.path.exists(sock_path), 10, message="the old one offers")
        held = HeldConnections(bind, 6, GREETING)
        loop = ClientLoop(bind, GREETING, every=0.005, max_attempts=6000, max_s=60).start()
        wait_until(lambda: loop.result.ok >= 50, 20, message="the loop runs through the old one")
        t_term = time.monotonic()
        old.signal(signal.SIGTERM)
        wait_until(lambda: old.saw("shutdown drain: accepting and offering"), drain,
                   message="the old one drains and still offers")
        # Still accepting while it drains, before any successor exists.
        before = loop.result.ok
        wait_until(lambda: loop.result.ok >= before + 20, drain / 2,
                   message="connections accepted during the drain")
        # The replacement: same command line, started while the old one drains.
        new = Proc(proxy_args(bind, health, upstream.address, *extra))
        wait_until(lambda: new.saw("handover: took over listeners"), 20,
                   message="the replacement took the listeners")
        assert new.popen.poll() is None, new.log
        wait_until(lambda: old.saw("a successor accepts now"), 5,
                   message="the old one stopped accepting")
        # The predecessor is named by more than its pid (1 in a container).
        assert "pidns=" in new.log and "host=" in new.log
        assert old.wait(drain + SHUTDOWN_BOUND_S + 5) == 0
        assert time.monotonic() - t_term < drain + SHUTDOWN_BOUND_S
        before = loop.result.ok
        wait_until(lambda: loop.result.ok >= before + 50, 20,
                   message="connections through the replacement after the old one exited")
        result = loop.stop()
        assert result.failed == 0, (result.failures, result.attempts)
        assert new.popen.poll() is None and healthz_ok(health)
        wait_until(held.all_closed, 5, message="the old one's connections closed")
        # Ready for the next one: it offers on the path now.
        assert os.path.exists(sock_path) and new.saw("handover: offering listeners")
    finally:
        if loop is not None:
            loop.stop()
        if held is not None:
            held.close()
        old.reap()
        if new is not None:
            new.reap()


def test_the_offer_stands_for_the_whole_window_with_no_connection_to_drain(
        upstream, tmp_path: Path):
    # No connection open at SIGTERM: the closes are over at once, but the listeners stay
    # open and offered for the window, for a replacement still starting (a pod's takes
    # seconds). Found on a real node: a DaemonSet pod with no long-lived client exited
    # at SIGTERM and 7447 refused until its replacement bound.
    sock_path = str(tmp_path / "handover.sock")
    drain = 6.0
    extra = ("--handover-socket", sock_path, "--shutdown-drain-timeout", f"{drain:g}s")
    old, bind, health = start_first(upstream.address, *extra)
    new: Proc | None = None
    loop: ClientLoop | None = None
    try:
        wait_until(lambda: os.path.exists(sock_path), 10, message="the old one offers")
        old.signal(signal.SIGTERM)
        t_term = time.monotonic()
        wait_until(lambda: old.saw("shutdown drain: accepting and offering"), drain,
                   message="the old one drains and still offers")
        loop = ClientLoop(bind, GREETING, every=0.005, max_attempts=6000, max_s=60).start()
        # Half the window later the old one still accepts, then the replacement comes.
        wait_until(lambda: time.monotonic() - t_term >= drain / 2, drain, interval=0.05,
                   message="half the window")
        assert old.popen.poll() is None, old.log
        new = Proc(proxy_args(bind, health, upstream.address, *extra))
        wait_until(lambda: new.saw("handover: took over listeners"), 20,
                   message="the replacement took the listeners")
        assert old.wait(drain + SHUTDOWN_BOUND_S + 5) == 0
        before = loop.result.ok
        wait_until(lambda: loop.result.ok >= before + 50, 20,
                   message="connections through the replacement")
        result = loop.stop()
        assert result.failed == 0, (result.failures, result.attempts)
        assert new.popen.poll() is None
    finally:
        if loop is not None:
            loop.stop()
        old.reap()
        if new is not None:
            new.reap()


def test_replacement_without_handover_binds_both_ports_during_the_drain(upstream):
    # No handover socket: the listener closes at SIGTERM (refused until the replacement
    # binds, as docs/lifecycle.md says), and the health port is released with it, so the
    # replacement starts instead of failing on a port the old one still drains on.
    drain = 6.0
    old, bind, health = start_first(upstream.address, "--shutdown-drain-timeout",
                                    f"{drain:g}s")
    new: Proc | None = None
    held: HeldConnections | None = None
    try:
        held = HeldConnections(bind, 4, GREETING)
        old.signal(signal.SIGTERM)
        wait_until(lambda: old.saw("shutdown drain: closing connections"), drain,
                   message="the old one drains")
        new = Proc(proxy_args(bind, health, upstream.address, "--shutdown-drain-timeout",
                              f"{drain:g}s"))
        wait_until(lambda: healthz_ok(health), 15, message="the replacement serves health")
        assert new.popen.poll() is None, new.log
        assert "address already in use" not in new.log
        assert old.popen.poll() is None  # still draining: both ran side by side
        assert old.wait(drain + SHUTDOWN_BOUND_S + 5) == 0
        assert new.popen.poll() is None and healthz_ok(health)
    finally:
        if held is not None:
            held.close()
        old.reap()
        if new is not None:
            new.reap()
