"""One node's DaemonSet rollout, re-enacted with the environment the chart renders.

Two real processes get the chart's EP_ variables (the old pod's and the surge pod's), the
chart's handover socket in a shared directory (the hostPath), and the order the DaemonSet
controller uses with maxSurge 1 / maxUnavailable 0: the new pod starts while the old one
runs, then the old one gets SIGTERM. A client opening a new connection every 5 ms across
the switch must see no refused or reset connection, and the old pod's long-lived
connections must close spread over the chart's shutdown drain window.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from extractedprism.config.flags import parse_duration
from tests.deploy.helpers import container, env_of, render
from tests.fakes.upstream import IdentityServer
from tests.process.lifecycle import (
    ClientLoop,
    HeldConnections,
    Proc,
    healthz_ok,
    max_in_any_window,
)
from tests.util import free_ports, wait_until

HELD = 8
DRAIN = "4s"


def _chart_env(upstream: str, bind: int, health: int, run_dir: Path) -> dict[str, str]:
    docs, _ = render({"endpoints": [upstream], "bindPort": bind, "healthPort": health,
                      "enableDiscovery": False, "shutdownDrainTimeout": DRAIN,
                      "handoverSocket": str(run_dir / "handover.sock")})
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > parse_duration(DRAIN) + 10
    # The surge pod is not kept off the node: no host ports.
    assert "ports" not in pod["containers"][0]
    return env_of(container(docs))


def _own_admin_dir(env: dict[str, str], directory: Path) -> dict[str, str]:
    directory.mkdir(mode=0o700, exist_ok=True)
    return {**env, "EP_ADMIN_SOCKET": str(directory / Path(env["EP_ADMIN_SOCKET"]).name)}


@pytest.mark.timeout(90)
def test_rollout_on_one_node_refuses_nothing_and_spreads_the_old_pods_closes(tmp_path
                                                                            ) -> None:
    upstream = IdentityServer(name="apiserver").start()
    greeting = b"apiserver"
    run_dir = tmp_path / "run-extractedprism"  # the hostPath both pods mount
    run_dir.mkdir(mode=0o700)
    old = new = None
    held = loop = None
    try:
        for _attempt in range(3):  # a fixed port taken between picking and binding: retry
            bind, health = free_ports(2)
            env = _chart_env(upstream.address, bind, health, run_dir)
            # Each pod has its own emptyDir for the admin socket.
            old = Proc([], env=_own_admin_dir(env, tmp_path / "old-admin"))
            wait_until(lambda p=old, h=health: p.popen.poll() is not None or healthz_ok(h),
                       timeout=30, message="the old pod serving")
            if old.popen.poll() is None:
                break
            old.reap()
        assert old is not None and old.popen.poll() is None, old.log if old else ""
        wait_until(lambda: old.saw("handover: offering listeners"), 10,
                   message="the old pod offers its listeners on the chart's socket")
        held = HeldConnections(bind, HELD, greeting)
        loop = ClientLoop(bind, greeting).start()

        # The surge pod: same ports, same handover socket path.
        new = Proc([], env=_own_admin_dir(env, tmp_path / "new-admin"))
        wait_until(lambda: new.saw("handover: took over listeners"), 20,
                   message=f"the new pod takes the listeners over\n{new.log}")
        wait_until(lambda: old.saw("a successor accepts now"), 10,
                   message="the old pod stops accepting")
        assert new.popen.poll() is None, new.log
        wait_until(lambda: healthz_ok(health), 10, message="the new pod answers the probes")

        # The controller deletes the old pod once the new one is ready.
        old.signal(signal.SIGTERM)
        window = parse_duration(DRAIN)
        assert old.wait(timeout=window + 10) == 0, old.log
        wait_until(held.all_closed, 5, message="every held connection closed")
        result = loop.stop()
        loop = None
        assert result.attempts > 50, "the client loop ran across the switch"
        assert result.failed == 0, f"connection attempts failed: {dict(result.failures)}"
        closes = list(held.closed_at.values())
        print(f"rollout figures: attempts={result.attempts} failed={result.failed} "
              f"closes over {max(closes) - min(closes):.2f}s of a {window:g}s window, "
              f"max {max_in_any_window(closes, window / 10)} of {HELD} in any tenth")
        # Spread over the window: no more than a quarter within any tenth of it.
        assert max_in_any_window(closes, window / 10) <= math.ceil(HELD / 4), sorted(closes)
        assert max(closes) - min(closes) >= window / 2

        # The new pod serves on and is itself a clean SIGTERM away.
        assert healthz_ok(health)
        new.signal(signal.SIGTERM)
        assert new.wait(timeout=window + 10) == 0, new.log
    finally:
        if loop is not None:
            loop.stop()
        if held is not None:
            held.close()
        for proc in (old, new):
            if proc is not None:
                proc.reap()
        upstream.stop()
