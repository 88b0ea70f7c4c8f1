"""scripts/bench (epscripts.bench): --help runs, and the pure parsers read captured tool
output correctly.

No timing is asserted: the benchmark is a report, run by hand (scripts/bench).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# The scripts are a package under scripts/ (scripts/bench runs it with scripts/ on PYTHONPATH).
sys.path.insert(0, str(SCRIPTS))

from epscripts.bench import cli, parse, phases, report, services  # noqa: E402

WRK_SAMPLE = """\
Running 3s test @ http://127.0.0.1:40001/
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.12ms    1.05ms  26.71ms   88.10%
    Req/Sec    20.88k     1.20k   22.31k    83.33%
  Latency Distribution
     50%    2.86ms
     75%    3.40ms
     90%    4.10ms
     99%  812.00us
  62364 requests in 3.00s, 22.42MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 2
Requests/sec:  20787.45
Transfer/sec:      7.47MB
"""


def test_help_runs() -> None:
    res = subprocess.run([sys.executable, "-m", "epscripts.bench", "--help"],
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHONPATH=str(SCRIPTS)))
    assert res.returncode == 0
    assert "--quick" in res.stdout


def test_parse_wrk_sample() -> None:
    r = parse.parse_wrk(WRK_SAMPLE)
    assert r["rps"] == pytest.approx(20787.45)
    assert r["p50_ms"] == pytest.approx(2.86)
    assert r["p99_ms"] == pytest.approx(0.812)
    assert r["requests"] == 62364
    assert r["seconds"] == pytest.approx(3.0)
    assert r["errors"] == 4
    assert r["non_2xx"] == 2


def test_parse_wrk_rejects_output_without_latency() -> None:
    with pytest.raises(ValueError):
        parse.parse_wrk("Requests/sec: 10.0\n")


@pytest.mark.parametrize(("text", "ms"), [("812.00us", 0.812), ("1.5ms", 1.5), ("2.00s", 2000.0),
                                          ("1.00m", 60000.0)])
def test_parse_wrk_time(text: str, ms: float) -> None:
    assert parse.parse_wrk_time_ms(text) == pytest.approx(ms)


def test_parse_iperf3_sample() -> None:
    sample = {"start": {}, "end": {"sum_received": {"bits_per_second": 8.5e9,
                                                    "bytes": 3187500000, "seconds": 3.0}}}
    r = parse.parse_iperf3(json.dumps(sample))
    assert r == {"gbps": pytest.approx(8.5), "bytes": 3187500000, "seconds": 3.0}
    with pytest.raises(ValueError):
        parse.parse_iperf3(json.dumps({"error": "unable to connect to server"}))


def test_parse_status_kib() -> None:
    text = "Name:\tpython\nVmRSS:\t   73976 kB\nRssAnon:\t   60000 kB\nThreads:\t2005\n"
    assert parse.parse_status_kib(text, "VmRSS") == 73976
    assert parse.parse_status_kib(text, "RssAnon") == 60000


def test_judge_and_summary() -> None:
    m = report.METRIC_BY_KEY
    assert report.judge(m["ka64_rps"], 8000.0, 10000.0) == (pytest.approx(0.8), "PASS")
    assert report.judge(m["ka64_rps"], 6000.0, 10000.0)[1] == "FAIL"
    assert report.judge(m["ka64_p99_ms"], 40.0, 10.0)[1] == "FAIL"  # target: <= 3x HA
    assert report.judge(m["idle_rss_kib_per_conn"], 23.0, 3.0)[1] == "PASS"
    assert report.judge(m["ka64_rps"], None, 10000.0) == (None, "N/A")
    s = report.summarize({"ka64_rps": {"haproxy": [10.0, 8.0], "extractedprism": [7.0, None]}})
    assert s["ka64_rps"]["haproxy"]["best"] == 10.0
    assert s["ka64_rps"]["haproxy"]["spread"] == pytest.approx(0.2)
    assert s["ka64_rps"]["ratio_ep_haproxy"] == pytest.approx(0.7)
    assert s["ka64_rps"]["status"] == "PASS"
    assert "keep-alive c=64" in report.render_table(s)


def test_summary_and_table_carry_reference_paths() -> None:
    s = report.summarize({"ka64_rps": {"haproxy": [10.0], "extractedprism": [5.0],
                                      "ref-c": [8.0], "ref-py": [6.0]}})
    e = s["ka64_rps"]
    assert e["ratio_ep_haproxy"] == pytest.approx(0.5)
    assert e["status"] == "FAIL"  # the verdict is extractedprism's, never a reference's
    assert e["ratio_ref-c_haproxy"] == pytest.approx(0.8)
    assert e["status_ref-c"] == "PASS"
    assert e["ratio_ref-py_haproxy"] == pytest.approx(0.6)
    table = report.render_table(s)
    assert "ref-c/HA" in table and "ref-py/HA" in table
    row = next(line for line in table.splitlines() if line.startswith("keep-alive c=64 "))
    assert row.split()[-7:] == ["0.50", "0.80", "0.60", ">=", "0.7x", "HA", "FAIL"]
    # Without reference runs the table keeps its usual columns.
    plain = report.render_table(report.summarize({"ka64_rps": {"haproxy": [10.0]}}))
    assert "ref-c" not in plain


def _echo_upstream() -> tuple[socket.socket, threading.Thread]:
    """A loopback upstream that echoes each connection until EOF, then half-closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(30)

    def serve() -> None:
        with contextlib.suppress(OSError):
            c, _ = srv.accept()
            with c:
                while data := c.recv(65536):
                    c.sendall(data)
                c.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=serve, name="test-echo-upstream", daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("ref", ["ref-py", "ref-c"])
def test_reference_proxy_carries_bytes_and_half_close(ref: str, tmp_path: Path) -> None:
    """The references must be real proxies, or their figures would mean nothing."""
    if ref == "ref-c" and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    args = cli.parse_args(["--paths", f"direct,{ref}"])
    procs = services.Procs(tmp_path)
    b = phases.Bench(args, procs, tmp_path)
    srv, t = _echo_upstream()
    try:
        started = b.start_ref(ref, "test", srv.getsockname()[1])
        assert started is not None, b.ref_errors
        proc, port = started
        payload = os.urandom(3 * 1024 * 1024)
        with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
            sender = threading.Thread(target=lambda: (c.sendall(payload),
                                                      c.shutdown(socket.SHUT_WR)),
                                      name="test-sender", daemon=True)
            sender.start()
            got = bytearray()
            while chunk := c.recv(65536):
                got += chunk
            sender.join(20)
        assert bytes(got) == payload  # and EOF arrived: the half-close went both ways
        # The harness started it with the product's default scheduling policy.
        assert os.sched_getscheduler(proc.popen.pid) == os.SCHED_BATCH
    finally:
        procs.stop_all()
        srv.close()
        t.join(10)


def test_ep_pythonpath_runs_that_copy_of_the_package(tmp_path: Path) -> None:
    """--ep-pythonpath must win over the repo's own package (python -m puts the working
    directory first on sys.path, so the harness must not start it from the repo)."""
    pkg = tmp_path / "copy" / "extractedprism"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    marker = tmp_path / "ran-the-copy"
    (pkg / "__main__.py").write_text(
        "import http.server, pathlib, sys\n"
        f"pathlib.Path({str(marker)!r}).write_text('yes')\n"
        "port = int(sys.argv[sys.argv.index('--health-port') + 1])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    args = cli.parse_args(["--paths", "extractedprism",
                             "--ep-pythonpath", str(tmp_path / "copy")])
    work = tmp_path / "work"
    work.mkdir()
    procs = services.Procs(work)
    b = phases.Bench(args, procs, work)
    try:
        assert b.start_ep("test", 1) is not None, b.ep_error
        assert marker.read_text() == "yes"
    finally:
        procs.stop_all()


def test_same_run_ratios_median_and_best() -> None:
    runs = {"ka64_rps": {"haproxy": [10.0, 20.0, 10.0], "extractedprism": [8.0, 10.0, 6.0],
                         "ep-python": [3.0, None, 5.0]},
            "ka64_p99_ms": {"haproxy": [2.0, 4.0], "extractedprism": [4.0, 4.0]}}
    r = report.rep_ratios(runs)
    assert r["ka64_rps"]["extractedprism"]["runs"] == pytest.approx([0.8, 0.5, 0.6])
    assert r["ka64_rps"]["extractedprism"]["median"] == pytest.approx(0.6)
    assert r["ka64_rps"]["extractedprism"]["best"] == pytest.approx(0.8)
    assert r["ka64_rps"]["ep-python"]["median"] == pytest.approx(0.4)  # (0.3 + 0.5) / 2
    assert r["ka64_p99_ms"]["extractedprism"]["best"] == pytest.approx(1.0)  # lower wins
    text = report.render_rep_ratios(r)
    assert "0.60 (0.80)" in text and "ep-python/HA" in text


def test_http_upstreams_give_every_proxy_every_address() -> None:
    """--http-upstreams N: nginx listens on N loopback addresses, HAProxy gets N servers."""
    args = cli.parse_args(["--http-upstreams", "3"])
    assert args.http_hosts == ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    cfg = services.haproxy_config(7445, 8080, 2, args.http_hosts)
    assert [line.split()[2] for line in cfg.splitlines() if line.strip().startswith("server")] \
        == ["127.0.0.1:8080", "127.0.0.2:8080", "127.0.0.3:8080"]
    conf = services.nginx_config(Path("/tmp/x"), 8080, args.http_hosts)
    assert conf.count("listen 127.0.0.") == 3
    assert cli.parse_args([]).http_hosts == ("127.0.0.1",)
    with pytest.raises(SystemExit):
        cli.parse_args(["--http-upstreams", "9"])
