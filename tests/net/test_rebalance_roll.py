"""A rolling restart on loopback, four proxies standing for four nodes (issue 23's proof in
small; the real control plane's is in tests/controlplane): 4 in-process Apps x 6
long-lived quiet clients that reconnect when closed, three identity upstreams restarted
one after the other. Without rebalancing the upstream restarted last ends with nothing;
with it, the skew (max / mean of the upstreams' connections over all four proxies) is at
most 1.25 within four rebalance intervals of the last upstream being healthy again."""

from __future__ import annotations

import logging
import select
import socket
import time

import pytest

from tests.util import connect, read_line, wait_until

log = logging.getLogger(__name__)

PROXIES, CLIENTS = 4, 6
INTERVAL = 1.0


def skew(counts: list[int]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


class Clients:
    """Quiet long-lived clients of several proxies that reconnect at once when closed."""

    def __init__(self, apps) -> None:  # type: ignore[no-untyped-def]
        self.apps = apps
        self.socks: dict[socket.socket, int] = {}  # -> which proxy

    def open(self, i: int) -> None:
        while True:  # an upstream going down may end a fresh connection: dial again
            s = connect(self.apps[i])
            if read_line(s):
                self.socks[s] = i
                return
            s.close()

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select(list(self.socks), [], [], left)
            for s in readable:
                data = b""
                try:
                    data = s.recv(1)
                except ConnectionResetError:
                    pass
                assert data == b""
                i = self.socks.pop(s)
                s.close()
                self.open(i)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def per_upstream(apps, ups) -> list[int]:  # type: ignore[no-untyped-def]
    counts = {u.address: 0 for u in ups}
    for app in apps:
        for u in app.registry.snapshot().upstreams:
            counts[u.address] += u.active_connections
    return [counts[u.address] for u in ups]


def healthy_everywhere(apps, up) -> bool:  # type: ignore[no-untyped-def]
    return all(app.registry.snapshot().get(up.address).healthy for app in apps)


@pytest.mark.parametrize("rebalance", [False, True], ids=["off", "on"])
def test_rolling_restart_leaves_no_upstream_empty(make_app, servers, rebalance):
    ups = servers(3)
    flags = dict(upstream_selection="least-conn", rebalance_quiet=0.3,
                 rebalance_interval=INTERVAL if rebalance else 0.0)
    apps = [make_app([u.endpoint for u in ups], **flags) for _ in range(PROXIES)]
    clients = Clients(apps)
    try:
        for i in range(PROXIES):
            for _ in range(CLIENTS):
                clients.open(i)
        for up in ups:  # the roll: each one down, its clients move, then back up
            up.stop()
            wait_until(lambda up=up: not any(
                app.registry.snapshot().get(up.address).healthy for app in apps), 10)
            clients.pump(0.2)
            up.start()
            deadline = time.monotonic() + 10
            while not healthy_everywhere(apps, up):
                assert time.monotonic() < deadline, f"{up.name} never healthy again"
                clients.pump(0.05)
        after_roll = per_upstream(apps, ups)
        log.info("after the roll counts=%s skew=%.2f rebalance=%s", after_roll,
                 skew(after_roll), rebalance)
        clients.pump(4 * INTERVAL * 1.1)
        final = per_upstream(apps, ups)
        log.info("four intervals later counts=%s skew=%.2f rebalance=%s", final, skew(final),
                 rebalance)
        assert sum(final) == PROXIES * CLIENTS
        if rebalance:
            assert skew(final) <= 1.25, final
        else:
            # The last one restarted has (almost) nothing, and nothing moves it back.
            assert final == after_roll and skew(final) >= 1.4, final
    finally:
        clients.close()


def test_scale_out_a_new_upstream_fills_up_over_the_slow_start_window(make_app, servers):
    ups = servers(3)
    window, interval = 3.0, 0.25  # rounds far faster than the ramp: it alone holds them back
    apps = [make_app([u.endpoint for u in ups[:2]], upstream_selection="least-conn",
                     rebalance_interval=interval, rebalance_quiet=0.1, slow_start=window)
            for _ in range(PROXIES)]
    clients = Clients(apps)
    try:
        for i in range(PROXIES):
            for _ in range(CLIENTS):
                clients.open(i)
        t0 = time.monotonic()
        for app in apps:  # discovery lists a third API server
            app.registry.membership.set_endpoints([u.endpoint for u in ups])
        # Early in the ramp the new one holds at most its ramped share (the weight at
        # the end of the wait, the highest it had).
        clients.pump(window / 3)
        early = per_upstream(apps, ups)
        weight = min(1.0, 0.1 + 0.9 * (time.monotonic() - t0) / window)
        bound = PROXIES * CLIENTS * weight / (2 + weight)
        log.info("a third of the window in counts=%s bound=%.1f", early, bound)
        assert early[2] <= bound, (early, bound)
        # After the window, it has its full share within four intervals.
        clients.pump(max(0.0, t0 + window - time.monotonic()) + 4 * interval * 1.1)
        final = per_upstream(apps, ups)
        log.info("window + four intervals counts=%s skew=%.2f", final, skew(final))
        assert skew(final) <= 1.25, final
    finally:
        clients.close()
