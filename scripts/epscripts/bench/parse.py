"""What the tools and /proc say, read into numbers (pure but for the /proc readers;
tested in tests/process/test_bench_smoke.py)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

_WRK_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def parse_wrk_time_ms(text: str) -> float:
    """'812.00us' / '1.23ms' / '2.00s' / '1.00m' -> milliseconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s|m|h)\s*", text)
    if not m:
        raise ValueError(f"not a wrk time: {text!r}")
    return float(m.group(1)) * _WRK_UNITS_MS[m.group(2)]


def parse_wrk(text: str) -> dict:
    """Parse `wrk --latency` output into requests/s, p50/p99 (ms), request and error counts."""
    out: dict = {"errors": 0, "non_2xx": 0}
    m = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.M)
    if not m:
        raise ValueError("no Requests/sec line in wrk output")
    out["rps"] = float(m.group(1))
    for pct, value in re.findall(r"^\s*(50|75|90|99)%\s+([0-9.]+\s*(?:us|ms|s|m|h))\s*$", text,
                                 re.M):
        out[f"p{pct}_ms"] = parse_wrk_time_ms(value)
    if "p50_ms" not in out or "p99_ms" not in out:
        raise ValueError("no latency distribution in wrk output (was --latency given?)")
    m = re.search(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h)", text, re.M)
    if m:
        out["requests"] = int(m.group(1))
        out["seconds"] = parse_wrk_time_ms(m.group(2) + m.group(3)) / 1000.0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        out["errors"] = sum(int(g) for g in m.groups())
        out["socket_errors"] = dict(zip(("connect", "read", "write", "timeout"),
                                        (int(g) for g in m.groups()), strict=True))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if m:
        out["non_2xx"] = int(m.group(1))
    return out


def parse_iperf3(text: str) -> dict:
    """Parse `iperf3 -J` client output: received Gbit/s and bytes."""
    data = json.loads(text)
    if data.get("error"):
        raise ValueError(f"iperf3: {data['error']}")
    recv = data["end"]["sum_received"]
    return {"gbps": recv["bits_per_second"] / 1e9, "bytes": int(recv["bytes"]),
            "seconds": float(recv["seconds"])}


def parse_status_kib(text: str, key: str) -> int:
    """A 'Key:   1234 kB' line of /proc/<pid>/status -> 1234."""
    m = re.search(rf"^{re.escape(key)}:\s+(\d+)", text, re.M)
    if not m:
        raise ValueError(f"no {key} in status")
    return int(m.group(1))


def spread(values: list[float]) -> float | None:
    """(max - min) / max of repeated measurements: the noise figure printed beside a value."""
    vals = [v for v in values if v is not None]
    if len(vals) < 2 or max(vals) == 0:
        return None
    return (max(vals) - min(vals)) / max(vals)


def best(values: list[float], higher_is_better: bool) -> float | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if higher_is_better else min(vals)



def cpu_seconds(pid: int) -> float:
    """utime + stime of all threads of pid so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_us_per_request(r: dict | None) -> float | None:
    """The proxy's CPU per request of one wrk run (None without a result or requests)."""
    if not r or not r.get("requests"):
        return None
    return r["proxy_cpu_s"] / r["requests"] * 1e6


def cores_note(r: dict, proc: object) -> str:
    """'  proxy cpu N cores' for a proxy's wrk line ('' for the direct path)."""
    if proc is None or not r.get("seconds"):
        return ""
    return f"  proxy cpu {r['proxy_cpu_s'] / r['seconds']:.2f} cores"


def proc_status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as fh:
        text = fh.read()
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = None
    return {"rss_kib": parse_status_kib(text, "VmRSS"),
            "rss_anon_kib": parse_status_kib(text, "RssAnon"),
            "threads": int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1)),
            "fds": fds}


def settled_rss(pid: int, timeout: float = 5.0, interval: float = 0.3,
                read: Callable[[int], dict] = proc_status) -> dict:
    """Poll ``read(pid)`` (default: VmRSS and friends) until two readings ``interval``
    apart differ by < 0.5% of RSS (or timeout)."""
    last = read(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = read(pid)
        if abs(now["rss_kib"] - last["rss_kib"]) <= max(64, last["rss_kib"] * 0.005):
            return now
        last = now
    return last
