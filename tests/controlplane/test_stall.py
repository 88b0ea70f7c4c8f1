"""The stall check (--stall-timeout) on the real control plane: a SIGSTOPped and an
etcd-partitioned apiserver are found through the node's own traffic.

The health interval is 30 s, so the scheduled checks cannot explain an exclusion within a
few seconds of the fault: keep-alive clients (a GET every 0.5 s each) send requests that
the faulty apiserver never answers, their connections stall, the stall makes the proxy
check that apiserver at once, that check fails and the confirming one --health-recheck
later excludes it; the stalled connections close at the exclusion and the clients retry on
another apiserver. Figures are recorded (printed at the end of the session).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.controlplane import harness
from tests.controlplane.conftest import MARKS, SLACK, record, require_control_plane, wait_all_ready
from tests.controlplane.harness import Load, Sampler, mono
from tests.controlplane.test_scenarios import excluded, r
from tests.util import wait_until

require_control_plane()
pytestmark = MARKS

INTERVAL, TIMEOUT, RECHECK, STALL = 30.0, 1.0, 1.0, 2.0
PERIOD = 0.5  # each client's request period


def stall_checks(s: harness.Sample, addr: str, result: str) -> int:
    u = s.ups.get(addr) or {}
    return int((u.get("stall_checks") or {}).get(result, 0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["sigstop", "partition"])
def test_a_stuck_apiserver_is_found_through_the_stall_path(cluster: Any, tmp_path: Path,
                                                           fault: str) -> None:
    proxy = harness.start_proxy(
        cluster, tmp_path, interval=INTERVAL, timeout=TIMEOUT, name=f"stall-{fault}",
        extra=[f"--health-recheck={RECHECK:g}s", "--unready-drain-timeout=3s",
               f"--stall-timeout={STALL:g}s", "--upstream-selection=least-conn"])
    try:
        wait_all_ready(proxy, cluster.endpoints, timeout=60)
        sampler = Sampler(proxy.health_port).start()
        load = Load(proxy.port, cluster.ca, cluster.token(), keepalive=6, fresh=0,
                    period=PERIOD).start()
        target = ""
        try:
            wait_until(lambda: load.stats.ok >= 30, 30, message="load warmed up")
            last = sampler.samples[-1]
            target_addr = max(cluster.endpoints,
                              key=lambda a: (last.ups.get(a) or {}).get("active_connections", 0))
            target = next(api for api in ("api1", "api2", "api3")
                          if cluster.endpoint(api) == target_addr)
            conns = last.ups[target_addr]["active_connections"]
            failed_before = load.stats.failed
            t_fault = mono()
            if fault == "sigstop":
                cluster.stop(target)
            else:
                cluster.partition_etcd(target)
            # A request within one period of the fault, stalled T (+ a sample period)
            # later, a failing check within the timeout, the confirming one R after it.
            bound = PERIOD + STALL + STALL / 8 + TIMEOUT + RECHECK + TIMEOUT + SLACK
            # Or its exclusion first: the clients' own first-answer verdicts (two silent
            # ClientHellos, --answer-hedge-delay apart) can exclude it before the stall's
            # check has its result, and an excluded upstream asks for no stall check.
            s_check = sampler.wait_for(
                lambda s: stall_checks(s, target_addr, "failed") + stall_checks(
                    s, target_addr, "passed") >= 1 or excluded(s, target_addr), t_fault,
                bound, f"a stall-triggered check of {target_addr}, or its exclusion")
            s_ex = sampler.wait_for(lambda s: excluded(s, target_addr), t_fault, bound + 10,
                                    f"{target_addr} excluded")
            s_unstalled = sampler.wait_for(
                lambda s: (s.ups.get(target_addr) or {}).get("stalled_connections") == 0,
                s_ex.t, 5, "its stalled connections closed")
            wait_until(lambda: mono() >= s_ex.t + 3, 5)  # the clients carry on elsewhere
        finally:
            if target:
                cluster.cont(target) if fault == "sigstop" else cluster.heal(target)
            stats = load.stop()
            sampler.stop()
    finally:
        harness.stop_live()
        proxy.stop()
    figs = {"fault": fault, "target_connections": conns,
            "first_stall_check_result_after_s": r(s_check.t - t_fault),
            "excluded_after_s": r(s_ex.t - t_fault), "bound_s": r(bound),
            "stalled_closed_after_s": r(s_unstalled.t - t_fault),
            "stall_checks_failed": stall_checks(s_ex, target_addr, "failed"),
            "stall_checks_passed": stall_checks(s_ex, target_addr, "passed"),
            "stalls": (s_ex.ups.get(target_addr) or {}).get("stalls"),
            "requests_ok": stats.ok, "requests_failed": stats.failed - failed_before,
            "errors": stats.errors[:5]}
    record(f"stall check, {fault}", **figs)
    assert s_ex.t - t_fault <= bound, figs
    assert s_ex.t - t_fault < INTERVAL - TIMEOUT, figs  # not the scheduled checks
    assert figs["stall_checks_failed"] >= 1, figs
