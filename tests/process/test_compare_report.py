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


def _rows(fault: str, **figs: dict) -> dict[str, dict]:
    """One row per balancer for ``fault``, each with the figures given for it."""
    out = {}
    for lb, f in figs.items():
        r = _row(lb, f.get("gap", 10.4), f.get("nr"))
        r["fault"] = fault
        r["watch"]["n1"]["requests_failed"] = f.get("failed", 0)
        r["watch"]["n1"]["gap_max_s"] = f.get("watch", 1.1)
        r["skew_after"] = f.get("skew", 1.0)
        r["exposed"] = {"kubelets": 1, "watches": f.get("exposed_watches", 1)}
        out[lb] = r
    return out


def test_as_good_is_a_row_per_metric_with_the_peers_better_and_the_same() -> None:
    rows = _rows("kill", extractedprism={"gap": 12.0, "failed": 2},
                 haproxy={"gap": 10.0, "failed": 0},
                 nginx={"gap": 30.0, "nr": {"n1": ["+55s Unknown"]}, "failed": 2},
                 **{"go-original": {"gap": 12.6, "failed": 9},
                    "extractedprism-stall": {"gap": 1.0, "failed": 0}})
    good = {g[0]: g[1:] for g in compare_doc.as_good(rows, list(rows))}
    # Closer than the metric's tolerance (1 s for Lease gaps) is the same, not better.
    assert good["longest Lease gap (s)"] == ("12", "HAProxy 10", "Go original 12.6")
    assert good["nodes NotReady"] == ("0", "-", "HAProxy 0, Go original 0")
    assert good["request loop: failed"] == ("2", "HAProxy 0", "nginx 2")
    # Our own variant is no peer.
    assert not any("stall" in x for g in good.values() for x in g)


def test_targets_met_and_missed_against_the_bound_and_the_best_peer() -> None:
    stop = _rows("stop", extractedprism={"gap": 16.0, "failed": 1, "watch": 7.6},
                 haproxy={"gap": 30.2, "failed": 0}, nginx={"gap": 30.3, "failed": 3})
    assert compare_doc.target("stop", "longest Lease gap (s)", stop) == ("≤ 15", 16.0, False)
    assert compare_doc.target("stop", "longest watch gap (s)", stop) == ("≤ 10", 7.6, True)
    assert compare_doc.target("stop", "request loop: failed", stop) == (
        "≤ 0 (best peer)", 1, False)
    assert compare_doc.target("stop", "nodes NotReady", stop) == ("0", 0, True)
    # No Lease-gap target on a kill, no skew target on a freeze.
    assert compare_doc.target("kill", "longest Lease gap (s)", stop) is None
    assert compare_doc.target("stop", "connection skew after (max/mean)", stop) is None
    roll = _rows("rolling", extractedprism={"skew": 1.25}, haproxy={"skew": 3.0})
    assert compare_doc.target("rolling", "connection skew after (max/mean)", roll)[2] is True
    roll["extractedprism"]["skew_after"] = 1.33
    assert compare_doc.target("rolling", "connection skew after (max/mean)", roll)[2] is False
    # Without a peer the relative target cannot be judged; without ours, nothing is.
    alone = _rows("kill", extractedprism={})
    assert compare_doc.target("kill", "request loop: failed", alone)[2] is None
    del stop["extractedprism"]
    assert compare_doc.target("stop", "nodes NotReady", stop) == ("0", None, None)


def _doc(results: list[dict], **kw: object) -> dict:
    doc = {"started": "2026-12-02 07:00 UTC", "argv": ["scripts/compare"], "nodes": 3,
           "commit": "0123456789ab", "faults": ["kill"], "lbs": ["extractedprism", "haproxy"],
           "skipped": {"go-original": "needs --go-original-bin"},
           "profile": ["--health-interval=5s", "--stall-timeout=2s"],
           "profile_source": "`extractedprism profile --format args`",
           "versions": {"kubernetes": "v1.34.4"},
           "timing": {"kill_down_s": 20, "stop_s": 30, "partition_s": 60, "watch_min_s": 65,
                      "after_s": 30, "settle_after_s": 80, "settle_rebalances": 4,
                      "write_period_s": 1, "request_period_s": 1},
           "results": results}
    doc.update(kw)
    return doc


def test_render_keeps_the_notes_and_says_what_was_not_measured(tmp_path: Path) -> None:
    doc = _doc([_row("extractedprism", 10.4),
                {"fault": "kill", "lb": "haproxy", "error": "FleetError: boom"}])
    path = tmp_path / "compare.md"
    compare_doc.write(path, doc)
    first = path.read_text()
    assert "| longest Lease gap (s) | 10.4 |  | error |" in first
    assert "Go original: needs --go-original-bin" in first
    assert "--health-interval=5s --stall-timeout=2s" in first
    path.write_text(first.replace("(no reading written yet)", "A person's reading."))
    compare_doc.write(path, doc)
    assert "A person's reading." in path.read_text()


def test_render_whole_matrix_targets_table_commit_once(tmp_path: Path) -> None:
    """A run of every balancer, the stall variant on the freeze and the partition only:
    targets beside our figures, the summary of targets, the peers' table, the commit
    named once, the stall variant's column only where it ran."""
    lbs = ["extractedprism", "haproxy", "nginx", "go-original", "extractedprism-stall"]
    five = ("scaleout", "kill", "stop", "partition", "rolling")  # the upgrade has no peer
    results = []
    for fault in five:
        figs = {"extractedprism": {"gap": 10.4 if fault != "partition" else 16.5,
                                   "skew": 1.0 if fault != "scaleout" else 1.5},
                "haproxy": {"gap": 30.2}, "nginx": {"gap": 30.3, "failed": 1},
                "go-original": {"gap": 30.1, "failed": 4}}
        if fault in ("stop", "partition"):
            figs["extractedprism-stall"] = {"gap": 12.0}
        results += list(_rows(fault, **figs).values())
    variants = {b: {"kind": "x", "extra": [], "faults": list(five)} for b in lbs}
    variants["extractedprism-stall"] = {"kind": "extractedprism",
                                        "extra": ["--stall-timeout=2s"],
                                        "faults": ["stop", "partition"]}
    doc = _doc(results, lbs=lbs, faults=list(five), skipped={}, variants=variants,
               took_s=2900)
    path = tmp_path / "compare.md"
    compare_doc.write(path, doc)
    text = path.read_text()
    assert text.count("0123456789ab") == 1
    assert "Not measured" not in text
    # The summary: 5 NotReady + 2 Lease + 4 watch + 5 failures + 2 skew targets.
    assert "Met: 16 of 18." in text
    assert "| longest Lease gap at most 15 s on the freeze and the partition |  |  | " \
           "10.4: met | 16.5: **missed** |  |" in text
    assert "| 1.5: **missed** |" in text
    assert "| 0 (best peer 0): met |" in text
    # Beside our figure in the fault's own table.
    kill = text[text.index("### kill -9"):text.index("### SIGSTOP")]
    assert ("| | extractedprism | target | HAProxy | nginx | Go original |\n" in kill)
    assert "| request loop: failed | 0 | ≤ 0 (best peer): met | 0 | 1 | 4 |" in kill
    assert "extractedprism, spec timings + stall check" not in kill
    stop = text[text.index("### SIGSTOP"):text.index("### The API server carrying")]
    assert ("| Go original | extractedprism, spec timings + stall check |" in stop)
    # The peers' table: one line per metric, not a paragraph.
    assert "| | extractedprism | better | as good |" in kill
    assert "| request loop: failed | 0 | - | HAProxy 0 |" in kill
    assert "Another balancer as good or better here" not in text
    assert "`--stall-timeout=2s`" in text
    # A run of the freeze only: no line for the targets of the roll and the scale-out.
    doc = _doc([r for r in results if r["fault"] == "stop"], lbs=lbs, faults=["stop"],
               variants=variants, skipped={})
    path.unlink()
    compare_doc.write(path, doc)
    text = path.read_text()
    assert "| target, extractedprism as shipped | SIGSTOP 30 s |" in text
    assert "connection skew at most" not in text and "Met: 4 of 4." in text


def test_saved_results_and_document_name_no_machine_path(tmp_path: Path) -> None:
    """What the run stores is scrubbed: its command line relative, errors and notes
    without /work, /tmp, /root paths; the rendered document has none either."""
    root = str(compare.repo_root())
    argv = compare.relative_argv([
        "scripts/compare", "--go-original-bin", "/tmp/fleetwork/extractedprism-go",
        f"--ep-cmd={root}/.venv/bin/python -m extractedprism", "--results",
        f"{root}/docs/compare.json", "--doc=/work/elsewhere/compare.md"])
    assert argv == ["scripts/compare", "--go-original-bin", "<path>",
                    "--ep-cmd=.venv/bin/python -m extractedprism", "--results",
                    "docs/compare.json", "--doc=<path>"]
    assert compare.relative_argv(["--go-original-bin=/x/y"]) == ["--go-original-bin=<path>"]
    row = _row("extractedprism", 10.4)
    row["notes"] = ["log in /tmp/extractedprism-compare/run-1/fleet/n1/lb.log",
                    f"from {root}/scripts/x.py", "GET /api/v1/nodes and /readyz kept"]
    err = {"fault": "kill", "lb": "haproxy",
           "error": "FleetError: lb-n1 exited; /root/.cache/extractedprism/bin/etcd: gone"}
    doc = compare.scrub(_doc([row, err], argv=argv))
    dumped = json.dumps(doc)
    for machine in ("/tmp", "/work", "/root", root):
        assert machine not in dumped
    assert "GET /api/v1/nodes and /readyz kept" in dumped
    assert "from scripts/x.py" in dumped
    path = tmp_path / "compare.md"
    compare_doc.write(path, doc)
    text = path.read_text()
    for machine in ("/tmp/", "/work/", "/root/", "/home/", root):
        assert machine not in text
    assert "`scripts/compare --go-original-bin <path> --ep-cmd=.venv/bin/python" in text


def test_profile_comes_from_the_product_and_the_stall_variant_takes_only_its_stall() -> None:
    profile = ["--health-check=readyz", "--health-interval=5s", "--stall-timeout=2s",
               "--rebalance-interval=15s", "--slow-start=20s"]
    assert compare.lb_extra("extractedprism", profile) == profile
    assert compare.lb_extra("extractedprism-stall", profile) == ["--stall-timeout=2s"]
    assert compare.lb_extra("haproxy", profile) == []
    assert compare.settle_after(profile) == 4 * 15 + 20
    assert compare.settle_after([]) == compare.AFTER_S
    assert compare.seconds("500ms") == 0.5 and compare.seconds("2m") == 120
    # The product's own answer when it has the command; the fallback only when it has not.
    args, source = compare.read_profile([sys.executable, "-c",
                                         "print('--health-interval=5s --slow-start=20s')"])
    assert args == ["--health-interval=5s", "--slow-start=20s"] and "profile" in source
    args, source = compare.read_profile([sys.executable, "-c",
                                         "import sys; sys.exit('error: unrecognized "
                                         "arguments: profile --format args')"])
    assert args == compare.PROFILE_FALLBACK and "PROFILE_FALLBACK" in source
    with pytest.raises(compare.FleetError, match="exit 3"):
        compare.read_profile([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_the_command_line_names_no_path_of_the_measuring_machine():
    assert [compare_doc.portable(a) for a in ["scripts/compare", "--go-original-bin",
                                  "/tmp/fleetwork/extractedprism-go", "--ep-cmd",
                                  "/work/main/.venv/bin/python", "-m", "extractedprism"]] == [
        "scripts/compare", "--go-original-bin", "DIR/extractedprism-go", "--ep-cmd",
        ".venv/bin/python", "-m", "extractedprism"]
