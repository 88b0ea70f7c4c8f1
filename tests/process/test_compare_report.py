"""scripts/compare (epscripts.fleet.compare): --help runs, and the pure parts that turn a
cell's raw records into figures and the figures into docs/compare.md are right.

The comparison itself is a report run by hand on a real control plane (its last run's
output is committed as docs/compare.md); nothing here starts a control plane.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from epscripts.fleet import compare, compare_doc  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_help_runs() -> None:
    proc = subprocess.run([str(SCRIPTS / "compare"), "--help"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "--faults" in proc.stdout and "--lbs" in proc.stdout


def test_unknown_fault_is_named(tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPTS / "compare"), "--faults", "kill,explode"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "explode" in proc.stderr


def test_watch_gap_lost_events_and_request_failures(tmp_path: Path) -> None:
    t0, t1 = 1000.0, 1060.0
    written = [(s, t0 + s) for s in range(1, 51)]  # seq s acknowledged at t0+s
    recs = [{"t": t0 - 0.5, "kind": "event", "name": "tick", "seq": 0}]
    # Received promptly except 11..29, which arrive together at t0+30 after a reconnect,
    # and 40, which never arrives.
    for s in range(1, 51):
        if s == 40:
            continue
        recs.append({"t": t0 + 30.0 if 11 <= s <= 29 else t0 + s + 0.1, "kind": "event",
                     "name": "tick", "seq": s})
    recs.append({"t": t0 + 29.9, "kind": "watch-end", "rc": 1})
    recs += [{"t": t0 + i, "kind": "req", "ok": not 5 <= i <= 8, "status": 200}
             for i in range(1, 60)]
    recs.append({"t": t0 + 6, "kind": "req", "ok": False, "status": 0, "err": "TimeoutError: x"})
    out = compare.watch_figures(_jsonl(tmp_path / "c.jsonl", recs), written, t0, t1)
    # Longest silence: seq 10 at t0+10.1, then the burst at t0+30: 19.9 s.
    assert out["gap_max_s"] == pytest.approx(19.9)
    assert out["reconnects"] == 1
    assert out["events_due"] == 50 and out["lost"] == 1
    assert out["requests_failed"] == 5
    assert out["request_gap_max_s"] == pytest.approx(5.0)  # ok at +4, next ok at +9
    assert out["request_errors"] == {"HTTP 200": 4, "TimeoutError": 1}


def test_watch_gap_counts_silence_up_to_the_end(tmp_path: Path) -> None:
    recs = [{"t": 1001.0, "kind": "event", "name": "tick", "seq": 1}]
    out = compare.watch_figures(_jsonl(tmp_path / "c.jsonl", recs), [(1, 1001.0)], 1000.0,
                                1050.0)
    assert out["gap_max_s"] == pytest.approx(49.0)


def test_failed_requests_counts_errors_5xx_and_429_only() -> None:
    before = {"200": 10, "<error>": 1, "503": 0}
    after = {"200": 30, "<error>": 4, "503": 2, "404": 7, "429": 1}
    assert compare.failed_requests(before, after) == 3 + 2 + 1


def _row(lb: str, gap: float, nr: dict | None = None) -> dict:
    w = {"gap_max_s": 2.0, "lost": 0, "requests_failed": 0, "request_gap_max_s": 1.0,
         "reconnects": 0, "relists": 0, "events_due": 60, "request_errors": {}}
    return {"fault": "kill", "lb": lb, "target": "api2", "not_ready": nr or {},
            "lease_gap_max_s": gap, "lease_gaps_s": {"n1": gap},
            "kubelet_failed": {"n1": 0}, "kubelet_codes_delta": {"n1": {}},
            "watch": {"n1": w}, "connections_after": {"api1": 1, "api2": 1, "api3": 1},
            "skew_after": 1.0, "kubelet_apis_before": {"n1": ["api2"]}, "nodes": 1,
            "kubelet_apis_after": {"n1": ["api1"]},
            "lb_rss_mib": {"n1": 50.0}, "lb_cpu_s": {"n1": 1.0}, "fault_window_s": 60.0,
            "load": {"mean": 3.0, "max": 4.0}, "writer_failures": 0, "notes": []}


def test_as_good_names_every_row_where_another_balancer_matches_or_beats() -> None:
    rows = {"extractedprism": _row("extractedprism", 12.0), "haproxy": _row("haproxy", 10.0),
            "nginx": _row("nginx", 30.0, {"n1": ["+55s Unknown"]}),
            "go-original": _row("go-original", 12.6)}
    good = compare_doc.as_good(rows, ["extractedprism", "haproxy", "nginx", "go-original"])
    assert "longest Lease gap (s): better through HAProxy 10 (extractedprism 12)" in good
    # Closer than the metric's tolerance (1 s for Lease gaps) is the same, not better/worse.
    assert ("longest Lease gap (s): the same through Go original 12.6 (extractedprism 12, "
            "within 1)") in good
    assert ("nodes NotReady: the same through HAProxy 0, Go original 0 (extractedprism 0)"
            in good)
    assert not any("nginx" in g for g in good if g.startswith(("nodes", "longest Lease")))


def _doc(results: list[dict]) -> dict:
    return {"started": "2026-12-02 07:00 UTC", "argv": ["scripts/compare"], "nodes": 3,
            "faults": ["kill"], "lbs": ["extractedprism", "haproxy"], "skipped": {
                "go-original": "needs --go-original-bin"},
            "ep_recommended": compare.EP_RECOMMENDED, "versions": {"kubernetes": "v1.34.4"},
            "timing": {"kill_down_s": 20, "stop_s": 30, "partition_s": 60, "watch_min_s": 65,
                       "after_s": 30, "write_period_s": 1, "request_period_s": 1},
            "results": results}


def test_render_keeps_the_notes_and_says_what_was_not_measured(tmp_path: Path) -> None:
    doc = _doc([_row("extractedprism", 10.4),
                {"fault": "kill", "lb": "haproxy", "error": "FleetError: boom"}])
    path = tmp_path / "compare.md"
    compare_doc.write(path, doc)
    first = path.read_text()
    assert "| longest Lease gap (s) | 10.4 | error |" in first
    assert "Go original: needs --go-original-bin" in first
    assert " ".join(compare.EP_RECOMMENDED) in first
    path.write_text(first.replace("(no reading written yet)", "A person's reading."))
    compare_doc.write(path, doc)
    assert "A person's reading." in path.read_text()


def test_the_command_line_names_no_path_of_the_measuring_machine():
    assert [compare_doc.portable(a) for a in ["scripts/compare", "--go-original-bin",
                                  "/tmp/fleetwork/extractedprism-go", "--ep-cmd",
                                  "/work/main/.venv/bin/python", "-m", "extractedprism"]] == [
        "scripts/compare", "--go-original-bin", "DIR/extractedprism-go", "--ep-cmd",
        ".venv/bin/python", "-m", "extractedprism"]
