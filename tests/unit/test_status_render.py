"""The status table renders what the document holds and shows "-" for what it lacks."""

from __future__ import annotations

import datetime

from extractedprism.ops.status import age, render

NOW = datetime.datetime(2026, 12, 1, 18, 30, 0, tzinfo=datetime.UTC)


def test_full_document_from_the_extended_upstreams():
    doc = {
        "version": "1.2.3", "relay": "native", "panic": False,
        "started": "2026-12-01T18:00:00.000+00:00",
        "connections_active": 3, "max_connections": 4096,
        "discovery": {"enabled": True, "connected": True, "last_event": None,
                      "last_error": ""},
        "upstreams": [
            {"address": "10.0.0.1:6443", "source": ["static", "kubernetes"],
             "state": "healthy", "ready": True, "tier": 0, "rtt_seconds": 0.0012,
             "active": 3, "total": 40, "since": "2026-12-01T18:25:55.148+00:00",
             "last_check_error": ""},
            {"address": "10.0.0.2:6443", "source": ["kubernetes"], "state": "admin-drain",
             "ready": False, "tier": None, "rtt_seconds": None, "active": 0, "total": 2,
             "since": "2026-12-01T16:00:00.000+00:00",
             "last_check_error": "connection refused", "last_error_source": "dial",
             "admin": {"action": "drain", "uid": 0, "at": "2026-12-01T17:00:00.000+00:00"}},
        ],
    }
    lines = render(doc, True, NOW).splitlines()
    assert lines[0].split()[:3] == ["ADDRESS", "SOURCE", "STATE"]
    one = lines[1].split()
    assert one == ["10.0.0.1:6443", "static,kubernetes", "healthy", "yes", "0",
                   "1.2ms", "3/40", "-", "-", "4m04s", "-", "-"]
    assert lines[2].split()[:11] == ["10.0.0.2:6443", "kubernetes", "admin-drain", "no",
                                     "-", "-", "0/2", "-", "-", "2h30m", "drain(uid=0)"]
    assert lines[2].endswith("connection refused (dial)")
    assert lines[3] == ("ready: 1/2 upstreams healthy, 1/2 ready, 1 drained (no new "
                        "connections), 3 connections (max 4096), discovery connected, relay "
                        "native, version 1.2.3, up 30m00s")


def test_a_drained_upstream_counts_as_healthy_and_ready_and_drained():
    # Issue 30: one drained of three read "1/3 healthy, 2/3 ready" (it was counted out of
    # healthy but into ready). Health, readiness and drain are now counted apart.
    ups = [{"address": f"10.0.0.{i}:6443", "state": "healthy", "healthy": True,
            "ready": True, "draining": False} for i in (1, 2, 3)]
    ups[1].update(state="admin-drain", draining_reason="admin")
    ups[2].update(state="unhealthy", healthy=False, ready=False)
    lines = render({"upstreams": ups}, True, NOW).splitlines()
    assert lines[-1] == ("ready: 2/3 upstreams healthy, 2/3 ready, 1 drained (no new "
                         "connections)")


def test_todays_document_and_missing_fields():
    doc = {"upstreams": [
        {"address": "a:1", "healthy": True, "draining": True, "ready": None,
         "readiness": "n/a", "active_connections": 1, "total_connections": 5},
        {"address": "b:1"},
    ], "panic": True}
    lines = render(doc, False, NOW).splitlines()
    assert lines[1].split() == ["a:1", "-", "draining", "-", "-", "-", "1/5", "-", "-", "-",
                                "-", "-"]
    assert lines[2].split() == ["b:1", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[3].startswith("NOT READY: 1/2 upstreams healthy")  # a:1 is healthy
    assert "1 drained" in lines[3] and "PANIC" in lines[3]


def test_no_upstreams_and_a_bad_time():
    text = render({"upstreams": []}, False, NOW)
    assert "(no upstreams)" in text
    assert age("yesterday", NOW) == "-" and age(None, NOW) == "-"
    assert age("2026-12-01T18:29:58Z", NOW) == "2s"


def test_share_weight_and_the_rebalance_line():
    doc = {
        "connections_active": 8,
        "rebalance": {"enabled": True, "closes": 3, "last_acted_at": "2026-12-01T18:26:00Z",
                      "last_result": "an upstream is draining",
                      "last_detail": "10.0.0.2:6443"},
        "upstreams": [
            {"address": "a:1", "state": "healthy", "connection_share": 0.75,
             "fair_share": 4.0, "weight": 1.0},
            {"address": "b:1", "state": "healthy", "connection_share": 0.25,
             "fair_share": 2.667, "weight": 0.4},
            {"address": "c:1", "state": "healthy", "connection_share": 0.0,
             "fair_share": None, "weight": None},
        ],
    }
    lines = render(doc, True, NOW).splitlines()
    assert "75% (fair 4.0)" in lines[1] and " w" not in lines[1]
    assert "25% (fair 2.7) w0.40" in lines[2]
    assert lines[3].split()[7] == "0%"
    assert ("rebalance: 3 closes, last 4m00s ago, last round: an upstream is draining "
            "(10.0.0.2:6443)") in lines[4]
    off = render({"rebalance": {"enabled": False}, "upstreams": []}, True, NOW)
    assert "rebalance" not in off


def test_the_stalls_column_and_the_stall_check_line():
    doc = {
        "stall_check": {"enabled": True, "timeout_seconds": 2.0},
        "upstreams": [
            {"address": "a:1", "state": "healthy", "stalls": 3, "stalled_connections": 1,
             "stall_checks": {"failed": 1, "passed": 1}},
            {"address": "b:1", "state": "healthy", "stalls": 0, "stalled_connections": 0,
             "stall_checks": {"failed": 0, "passed": 0}},
            {"address": "c:1", "state": "healthy", "stalls": None},
        ],
    }
    lines = render(doc, True, NOW).splitlines()
    col = lines[0].index("STALLS")
    assert lines[1][col:].startswith("3 (1 now) checks 1/2 failed")
    assert lines[2][col:].split()[0] == "0"
    assert lines[3][col:].split()[0] == "-"
    assert "stall check on (2s)" in lines[4]
    off = render({"stall_check": {"enabled": False}, "upstreams": []}, True, NOW)
    assert "stall check" not in off
