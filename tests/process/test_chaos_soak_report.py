"""scripts/chaos (epscripts.fleet.soak): the seeded sequence and the /upstreams invariant
checker, on synthetic input (the soak itself runs in tests/controlplane/test_chaos_soak.py).

Every rule of the checker is shown to fire on a document that breaks it and to stay
silent on a clean sequence, so a soak that reports no violation has checked something.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from epscripts.fleet import invariants, soak  # noqa: E402
from epscripts.fleet.invariants import Checker  # noqa: E402

pytestmark = pytest.mark.timeout(60)

A, B = "192.168.200.11:6443", "192.168.200.12:6443"
T0 = 1_800_000_000.0


def ts(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def up(addr: str, active: int, total: int, share: float, **kw: Any) -> dict[str, Any]:
    return {"address": addr, "active_connections": active, "total_connections": total,
            "connection_share": share, "dials_in_flight": 0, "draining_reason": None,
            "close_deadline": None, "state": "healthy", **kw}


def doc(*ups: dict[str, Any], started: str = "s1") -> dict[str, Any]:
    return {"started": started, "connections_active": sum(u["active_connections"] for u in ups),
            "upstreams": list(ups)}


def clean(n: int) -> list[tuple[float, dict[str, Any], float, dict[str, int]]]:
    """n seconds of a proxy whose counts add up: (t, doc, metric read after it, sockets)."""
    out = []
    for i in range(n):
        d = doc(up(A, 2, 10 + i, 0.6667), up(B, 1, 5 + i, 0.3333))
        out.append((T0 + i, d, float(15 + 2 * i + 1), {A: 2, B: 1}))
    return out


def feed(c: Checker, obs: list[tuple[float, dict[str, Any], float, dict[str, int]]]) -> None:
    for t, d, m, s in obs:
        c.observe(t, d, m, s)


def rules(c: Checker) -> list[str]:
    return [v.rule for v in c.violations]


def test_a_clean_sequence_has_no_violation() -> None:
    c = Checker("n1")
    feed(c, clean(20))
    assert c.observations == 20 and c.violations == []


def test_sum_and_share_and_active_over_total() -> None:
    c = Checker("n1")
    d = doc(up(A, 2, 1, 0.5), up(B, 1, 5, 0.25))
    d["connections_active"] = 4
    c.observe(T0, d, None, {})
    assert sorted(rules(c)) == ["active>total", "share", "sum"]


def test_total_decreasing_and_counter_drift_within_one_process() -> None:
    c = Checker("n1")
    obs = clean(3)
    t, d, _, s = obs[2]
    d = copy.deepcopy(d)
    d["upstreams"][0]["total_connections"] = 3  # went down
    feed(c, obs[:2])
    c.observe(t, d, None, s)
    assert rules(c) == ["total-decreased", "counter"]
    # A restarted process (another `started`) starts from 0: not a violation.
    c2 = Checker("n1")
    feed(c2, clean(2))
    c2.observe(T0 + 3, doc(up(A, 0, 0, 0.0), up(B, 0, 0, 0.0), started="s2"), 0.0, {})
    assert c2.violations == []


def test_metric_above_the_next_documents_totals_is_drift() -> None:
    c = Checker("n1")
    obs = clean(2)
    c.observe(*obs[0][:2], 99.0, obs[0][3])  # counted more than the upstreams ever had
    c.observe(*obs[1][:2], obs[1][2], obs[1][3])
    assert rules(c) == ["counter"]


def test_a_reservation_that_never_ends() -> None:
    c = Checker("n1", leak_s=5.0)
    obs = clean(10)
    for i, (t, d, m, s) in enumerate(obs):
        d["upstreams"][1]["dials_in_flight"] = 1 if i != 3 else 0  # back to 0 once at 3 s
        c.observe(t, d, m, s)
    # 0-2 s: too short; from 4 s on it stays: reported once, at 9 s.
    assert rules(c) == ["reservation"]
    assert c.violations[0].t == T0 + 9 and B in c.violations[0].detail


def test_connections_on_a_removed_upstream_after_its_drain() -> None:
    c = Checker("n1", slack_s=2.0)
    for i in range(6):
        d = doc(up(A, 2, 10, 0.6667),
                up(B, 1, 5, 0.3333, draining_reason="removed", state="draining",
                   close_deadline=ts(T0 + 1)))
        c.observe(T0 + i, d, 15.0, {A: 2, B: 1})
    assert rules(c) == ["removed-after-drain"]  # once, at T0 + 4 (> deadline + 2 s)
    assert c.violations[0].t == T0 + 4


def test_a_socket_to_an_address_no_longer_listed() -> None:
    c = Checker("n1", slack_s=2.0)
    for i in range(5):
        c.observe(T0 + i, doc(up(A, 2, 10, 1.0)), 10.0, {A: 2, B: 1})
    assert rules(c) == ["socket-on-removed"]
    assert c.violations[0].t == T0 + 2
    # A probe seen once is not a connection left behind.
    c2 = Checker("n1", slack_s=2.0)
    for i in range(5):
        c2.observe(T0 + i, doc(up(A, 2, 10, 1.0)), 10.0, {A: 2, B: 1} if i == 2 else {A: 2})
    assert c2.violations == []


def test_proc_net_tcp_and_metric_parsing() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        # 127.0.0.1:40000 -> 192.168.200.11:6443 established
        "   0: 0100007F:9C40 0BC8A8C0:192B 01 00000000:00000000\n"
        # the same peer in TIME_WAIT: not counted
        "   1: 0100007F:9C41 0BC8A8C0:192B 06 00000000:00000000\n"
        # another port
        "   2: 0100007F:9C42 0BC8A8C0:1D1D 01 00000000:00000000\n")
    assert invariants.parse_proc_net_tcp(text, 6443) == {A: 1}
    metrics = ("# TYPE extractedprism_connections_total counter\n"
               "extractedprism_connections_total 42.0\n"
               "extractedprism_connections_total_other 1\n")
    assert invariants.metric_value(metrics, "extractedprism_connections_total") == 42.0
    assert invariants.metric_value(metrics, "absent") is None


def test_the_same_seed_gives_the_same_sequence() -> None:
    nodes = ["n1", "n2", "n3"]
    a = soak.plan(7, nodes, soak.LONG, short=False)
    assert a == soak.plan(7, nodes, soak.LONG, short=False)
    assert a != soak.plan(8, nodes, soak.LONG, short=False)
    short = soak.plan(7, nodes, soak.SHORT, short=True)
    assert sorted(s.kind for s in short) == sorted(soak.KINDS)  # each kind once
    assert all((s.node in nodes) == (s.kind in soak.PROXY_FAULTS) for s in a)
    # Every kind recurs in the long plan (rounds of all eight).
    assert len(a) % len(soak.KINDS) == 0 and len(a) >= 2 * len(soak.KINDS)


def test_plan_only_prints_the_seeded_sequence() -> None:
    def run(*args: str) -> str:
        proc = subprocess.run([str(SCRIPTS / "chaos"), "--plan-only", *args],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = run("--seed", "11", "--short")
    assert out.startswith("seed 11\n") and len(out.splitlines()) == 1 + len(soak.KINDS)
    assert out == run("--seed", "11", "--short")
