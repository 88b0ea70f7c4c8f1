"""scripts/bench.py: --help runs, and the pure parsers read captured tool output correctly.

No timing is asserted: the benchmark is a report, run by hand (scripts/bench).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"

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


def _load():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_help_runs() -> None:
    res = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0
    assert "--quick" in res.stdout


def test_parse_wrk_sample() -> None:
    r = bench.parse_wrk(WRK_SAMPLE)
    assert r["rps"] == pytest.approx(20787.45)
    assert r["p50_ms"] == pytest.approx(2.86)
    assert r["p99_ms"] == pytest.approx(0.812)
    assert r["requests"] == 62364
    assert r["seconds"] == pytest.approx(3.0)
    assert r["errors"] == 4
    assert r["non_2xx"] == 2


def test_parse_wrk_rejects_output_without_latency() -> None:
    with pytest.raises(ValueError):
        bench.parse_wrk("Requests/sec: 10.0\n")


@pytest.mark.parametrize(("text", "ms"), [("812.00us", 0.812), ("1.5ms", 1.5), ("2.00s", 2000.0),
                                          ("1.00m", 60000.0)])
def test_parse_wrk_time(text: str, ms: float) -> None:
    assert bench.parse_wrk_time_ms(text) == pytest.approx(ms)


def test_parse_iperf3_sample() -> None:
    sample = {"start": {}, "end": {"sum_received": {"bits_per_second": 8.5e9,
                                                    "bytes": 3187500000, "seconds": 3.0}}}
    r = bench.parse_iperf3(json.dumps(sample))
    assert r == {"gbps": pytest.approx(8.5), "bytes": 3187500000, "seconds": 3.0}
    with pytest.raises(ValueError):
        bench.parse_iperf3(json.dumps({"error": "unable to connect to server"}))


def test_parse_status_kib() -> None:
    text = "Name:\tpython\nVmRSS:\t   73976 kB\nRssAnon:\t   60000 kB\nThreads:\t2005\n"
    assert bench.parse_status_kib(text, "VmRSS") == 73976
    assert bench.parse_status_kib(text, "RssAnon") == 60000


def test_judge_and_summary() -> None:
    m = bench.METRIC_BY_KEY
    assert bench.judge(m["ka64_rps"], 8000.0, 10000.0) == (pytest.approx(0.8), "PASS")
    assert bench.judge(m["ka64_rps"], 6000.0, 10000.0)[1] == "FAIL"
    assert bench.judge(m["ka64_p99_ms"], 16.0, 10.0)[1] == "FAIL"
    assert bench.judge(m["idle_rss_kib_per_conn"], 23.0, 3.0)[1] == "PASS"
    assert bench.judge(m["ka64_rps"], None, 10000.0) == (None, "N/A")
    s = bench.summarize({"ka64_rps": {"haproxy": [10.0, 8.0], "extractedprism": [7.0, None]}})
    assert s["ka64_rps"]["haproxy"]["best"] == 10.0
    assert s["ka64_rps"]["haproxy"]["spread"] == pytest.approx(0.2)
    assert s["ka64_rps"]["ratio_ep_haproxy"] == pytest.approx(0.7)
    assert s["ka64_rps"]["status"] == "PASS"
    assert "keep-alive c=64" in bench.render_table(s)
