#!/usr/bin/env python3
"""Side-by-side benchmark: direct path vs HAProxy (mode tcp) vs extractedprism, on loopback.

Owns: starting the upstreams (iperf3 server, nginx, an idle-connection holder), the two
proxies, the load generators (iperf3 client, wrk, an in-process idle-connection opener),
and turning their output into one table and one JSON file with ratios extractedprism/HAProxy
and PASS/FAIL against the targets of issue 3. Runs single-threaded in the main thread; every
child runs in its own session and is killed by process group on exit, error or Ctrl-C.

Every load is bounded in time (iperf3 -t, wrk -d, deadlines) and count (--idle-conns), and
the whole run is bounded by a watchdog alarm (--max-seconds). Only 127.0.0.1 is used.
The exit status is 0 whatever the targets say (it is a report); non-zero only when the
harness itself could not run (a tool missing, an upstream or HAProxy not starting).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
PATHS = ("direct", "haproxy", "extractedprism")
# Opt-in reference proxies with extractedprism's data-path shape (scripts/bench_ref/): in C,
# and in the least CPython that expresses it. They tell what the shape costs on this
# machine and what CPython adds, in the same run (docs/performance.md).
# "ep-python" is extractedprism itself with --relay python (the pure-Python fallback),
# beside "extractedprism" (--relay native), so both relays get a column in every run.
REFS = ("ep-python", "ref-c", "ref-py")
DEFAULT_PATHS = (*PATHS, "ep-python")
REF_DIR = Path(__file__).resolve().parent / "bench_ref"
PROXIES = ("haproxy", "extractedprism")
PHASES = ("bulk", "keepalive", "newconn", "idle")
BODY_SIZE = 128  # bytes of the static body nginx serves: a "small request/response"
NOFILE_WANTED = 65536


class HarnessError(Exception):
    """The harness itself could not run (exit status 2)."""


class Watchdog(Exception):
    """The whole run exceeded --max-seconds."""


# --- pure helpers (tested in tests/process/test_bench_smoke.py) --------------------------

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


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    # ("ratio_min", x): ep/haproxy >= x; ("ratio_max", x): ep/haproxy <= x;
    # ("abs_max", x): ep value <= x; None: informational.
    target: tuple[str, float] | None = None
    paths: tuple[str, ...] = PATHS


METRICS: tuple[Metric, ...] = (
    # Targets: issue 16 (the native relay), as ratios to HAProxy in the same run.
    Metric("bulk1_gbps", "bulk 1 stream", "Gbit/s", True, ("ratio_min", 1.3)),
    Metric("bulk4_gbps", "bulk 4 streams", "Gbit/s", True, ("ratio_min", 1.3)),
    Metric("bulk1_cpu_s_per_gb", "  proxy CPU, bulk 1", "cpu-s/GB", False, None, PROXIES),
    Metric("bulk4_cpu_s_per_gb", "  proxy CPU, bulk 4", "cpu-s/GB", False, None, PROXIES),
    Metric("ka1_rps", "keep-alive c=1", "req/s", True, ("ratio_min", 1.0)),
    Metric("ka1_p50_ms", "keep-alive c=1 p50", "ms", False),
    Metric("ka1_p99_ms", "keep-alive c=1 p99", "ms", False),
    Metric("ka1_cpu_us_per_req", "  proxy CPU, c=1", "cpu-us/req", False, None, PROXIES),
    Metric("ka64_rps", "keep-alive c=64", "req/s", True, ("ratio_min", 0.7)),
    Metric("ka64_p50_ms", "keep-alive c=64 p50", "ms", False),
    Metric("ka64_p99_ms", "keep-alive c=64 p99", "ms", False, ("ratio_max", 3.0)),
    Metric("ka64_cpu_us_per_req", "  proxy CPU, c=64", "cpu-us/req", False, ("ratio_max", 2.0),
           PROXIES),
    Metric("nc1_cps", "new connections c=1", "conn/s", True, ("ratio_min", 0.9)),
    Metric("nc1_cpu_us_per_conn", "  proxy CPU, new conn c=1", "cpu-us/conn", False, None,
           PROXIES),
    Metric("newconn_cps", "new connections", "conn/s", True, ("ratio_min", 0.45)),
    Metric("newconn_p99_ms", "new connections p99", "ms", False, ("ratio_max", 3.0)),
    Metric("newconn_cpu_us_per_conn", "  proxy CPU, new conn", "cpu-us/conn", False, None,
           PROXIES),
    Metric("idle_rss_kib_per_conn", "RSS per idle conn", "KiB", False, ("abs_max", 24.0),
           PROXIES),
    Metric("idle_rss_total_mib", "  RSS with idle conns", "MiB", False, None, PROXIES),
)
METRIC_BY_KEY = {m.key: m for m in METRICS}


def judge(metric: Metric, ep: float | None, ha: float | None) -> tuple[float | None, str]:
    """(ratio extractedprism/haproxy, PASS/FAIL/INFO/N/A) for one metric."""
    ratio = ep / ha if ep is not None and ha not in (None, 0) else None
    if metric.target is None:
        return ratio, "INFO"
    kind, limit = metric.target
    if kind == "abs_max":
        return ratio, "N/A" if ep is None else ("PASS" if ep <= limit else "FAIL")
    if ratio is None:
        return None, "N/A"
    if kind == "ratio_min":
        return ratio, "PASS" if ratio >= limit else "FAIL"
    return ratio, "PASS" if ratio <= limit else "FAIL"


def target_text(metric: Metric) -> str:
    if metric.target is None:
        return ""
    kind, limit = metric.target
    return {"ratio_min": f">= {limit:g}x HA", "ratio_max": f"<= {limit:g}x HA",
            "abs_max": f"<= {limit:g} {metric.unit}"}[kind]


def refs_in(runs_or_summary: dict) -> list[str]:
    """The reference paths that have any value in a runs dict or a summary."""
    return [r for r in REFS if any(isinstance(v, dict) and r in v
                                   for v in runs_or_summary.values())]


def summarize(runs: dict[str, dict[str, list[float | None]]]) -> dict:
    """runs[metric][path] = values of each repetition -> JSON-ready summary with verdicts."""
    summary: dict = {}
    refs = refs_in(runs)
    for metric in METRICS:
        per_path = runs.get(metric.key, {})
        entry: dict = {"label": metric.label.strip(), "unit": metric.unit,
                       "higher_is_better": metric.higher_is_better,
                       "target": target_text(metric) or None}
        extra = tuple(refs) if "extractedprism" in metric.paths else ()
        for path in metric.paths + extra:
            vals = per_path.get(path, [])
            entry[path] = {"best": best(vals, metric.higher_is_better), "runs": vals,
                           "spread": spread(vals)}
        ep = entry.get("extractedprism", {}).get("best")
        ha = entry.get("haproxy", {}).get("best")
        entry["ratio_ep_haproxy"], entry["status"] = judge(metric, ep, ha)
        for ref in extra:
            # What the target would say of the reference: informational, never the verdict.
            entry[f"ratio_{ref}_haproxy"], entry[f"status_{ref}"] = judge(
                metric, entry[ref]["best"], ha)
        summary[metric.key] = entry
    return summary


def rep_ratios(runs: dict[str, dict[str, list[float | None]]]) -> dict:
    """Same-repetition ratios path/HAProxy: {metric: {path: {"runs", "median", "best"}}}.

    Each repetition measures every path within a few seconds, so its own ratio is the
    figure least moved by other load on the machine; "best" follows the metric's
    direction (highest rate, lowest latency or cost)."""
    out: dict = {}
    for metric in METRICS:
        per_path = runs.get(metric.key, {})
        ha = per_path.get("haproxy", [])
        for path in ("extractedprism", *REFS):
            vals = per_path.get(path, [])
            ratios = [v / h for v, h in zip(vals, ha, strict=False)
                      if v is not None and h not in (None, 0)]
            if not ratios:
                continue
            ordered = sorted(ratios)
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            out.setdefault(metric.key, {})[path] = {
                "runs": ratios, "median": median,
                "best": max(ratios) if metric.higher_is_better else min(ratios)}
    return out


def render_rep_ratios(ratios: dict) -> str:
    """One line per metric: median and best of the same-run ratios of each path."""
    paths = [p for p in ("extractedprism", *REFS) if any(p in v for v in ratios.values())]
    rows = [("metric", *(f"{p}/HA median (best)" for p in paths))]
    for metric in METRICS:
        e = ratios.get(metric.key)
        if not e:
            continue
        rows.append((metric.label, *(f"{e[p]['median']:.2f} ({e[p]['best']:.2f})" if p in e
                                     else "" for p in paths)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in rows)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def render_table(summary: dict) -> str:
    """The human-readable table: best of N per cell, and the spread (max-min)/max of the runs."""
    refs = refs_in(summary)
    head = ("metric", "unit", *PATHS, *refs, "ep/HA", *(f"{r}/HA" for r in refs), "target",
            "status")
    rows = [head]
    for metric in METRICS:
        e = summary.get(metric.key)
        if e is None:
            continue
        cells = [metric.label, metric.unit]
        for path in (*PATHS, *refs):
            if path not in e:
                cells.append("")
                continue
            b, s = e[path]["best"], e[path]["spread"]
            cells.append(_fmt(b) + (f" ±{s * 100:.0f}%" if s is not None and b is not None
                                    else ""))
        for key in ("ratio_ep_haproxy", *(f"ratio_{r}_haproxy" for r in refs)):
            r = e.get(key)
            cells.append(f"{r:.2f}" if r is not None else "")
        cells += [target_text(metric), e["status"] if metric.target else ""]
        rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


# --- processes -------------------------------------------------------------------------


def raise_nofile() -> None:
    """Raise RLIMIT_NOFILE to the hard limit (children inherit it, 2,000 idle conns need it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, NOFILE_WANTED)
    if hard == resource.RLIM_INFINITY:
        want = NOFILE_WANTED
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def child_setup_batch() -> None:
    """raise_nofile, and SCHED_BATCH for every thread the child starts (they inherit it):
    the reference proxies get the policy extractedprism's --pipe-sched gives its own."""
    raise_nofile()
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class Procs:
    """Every child the harness starts; each in its own session so it can be killed as a group."""

    tmp: Path
    live: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict | None = None,
              cwd: Path | None = None, batch: bool = False) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as fh:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                                     env=env, cwd=cwd, start_new_session=True,
                                     preexec_fn=child_setup_batch if batch else raise_nofile)
        proc = Proc(name, popen, log)
        self.live.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 5.0) -> None:
        if proc in self.live:
            self.live.remove(proc)
        if proc.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            # Still alive (or its group is): SIGKILL the group it leads, which we started.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(2.0)

    def stop_all(self) -> None:
        for proc in reversed(list(self.live)):
            self.stop(proc)

    def log_tail(self, proc: Proc, lines: int = 15) -> str:
        try:
            return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_healthy(hport: int, proc: Proc, timeout: float = 20.0) -> bool:
    """Poll GET /healthz on the health port until 200, the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://{HOST}:{hport}/healthz", timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: Proc, procs: Procs, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise HarnessError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                               f"{procs.log_tail(proc)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise HarnessError(f"{proc.name} not listening on {port} after {timeout}s")


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


def settled_rss(pid: int, timeout: float = 5.0) -> dict:
    """Poll VmRSS until two readings 0.3 s apart differ by < 0.5% (or timeout)."""
    last = proc_status(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = proc_status(pid)
        if abs(now["rss_kib"] - last["rss_kib"]) <= max(64, last["rss_kib"] * 0.005):
            return now
        last = now
    return last


# --- upstreams and proxies ---------------------------------------------------------------


def haproxy_config(port: int, upstream: int, nbthread: int, hosts: tuple[str, ...] = (HOST,)
                   ) -> str:
    """HAProxy as an operator would run it for this job: mode tcp, defaults otherwise.

    nbthread = CPU count (what HAProxy 2.x picks by itself), no health checks (extractedprism's
    run at a long interval, so neither side pays for checks), maxconn high enough for the
    idle-connection test, default 16 KiB buffers and no splice (HAProxy's defaults).
    """
    return f"""global
    maxconn 8000
    nbthread {nbthread}

defaults
    mode tcp
    timeout connect 5s
    timeout client 10m
    timeout server 10m

frontend fe
    bind {HOST}:{port}
    default_backend be

backend be
""" + "".join(f"    server up{i} {h}:{upstream}\n" for i, h in enumerate(hosts))


def nginx_config(tmp: Path, port: int, hosts: tuple[str, ...] = (HOST,)) -> str:
    listen = "".join(f"        listen {h}:{port} backlog=4096;\n" for h in hosts)
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    default_type application/octet-stream;
    server {{
{listen}        location / {{ root {tmp}/www; }}
    }}
}}
"""


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Procs
    tmp: Path
    runs: dict = field(default_factory=dict)  # runs[metric][path] = [values]
    notes: list[str] = field(default_factory=list)
    ep_error: str | None = None
    ref_errors: dict = field(default_factory=dict)  # reference path -> why it is skipped

    def record(self, key: str, path: str, value: float | None) -> None:
        self.runs.setdefault(key, {}).setdefault(path, []).append(value)

    def note(self, text: str) -> None:
        print(f"  ! {text}", flush=True)
        self.notes.append(text)

    # proxies ------------------------------------------------------------------------------

    def start_haproxy(self, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                      ) -> tuple[Proc, int]:
        port = free_port()
        cfg = self.tmp / f"haproxy-{tag}.cfg"
        cfg.write_text(haproxy_config(port, upstream, self.args.haproxy_threads, hosts))
        proc = self.procs.start(f"haproxy-{tag}", ["haproxy", "-db", "-f", str(cfg)])
        wait_listening(port, proc, self.procs)
        return proc, port

    def start_ep(self, tag: str, upstream: int, relay: str = "native",
                 hosts: tuple[str, ...] = (HOST,)) -> tuple[Proc, int] | None:
        """Start extractedprism; on failure remember why and return None (not a harness error)."""
        if self.ep_error and not self.args.ep_retry:
            return None
        if self.args.ep_cmd_given:
            relay_args: list[str] = []  # a prototype's own command: its flags as given
        else:
            relay_args = ["--relay", relay]
        port, hport = free_port(), free_port()
        argv = [*shlex.split(self.args.ep_cmd.format(python=sys.executable)),
                "--endpoints", ",".join(f"{h}:{upstream}" for h in hosts),
                "--bind-address", HOST, "--bind-port", str(port), "--health-port", str(hport),
                "--enable-discovery=false", "--health-interval", self.args.ep_health_interval,
                "--health-timeout", "1s", "--max-connections", str(self.args.ep_max_connections),
                "--log-level", "warn", *relay_args, *shlex.split(self.args.ep_args)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.args.ep_pythonpath or str(REPO), env.get("PYTHONPATH", "")) if p)
        # Not cwd=REPO: "python -m" puts the working directory first on sys.path, which
        # would shadow --ep-pythonpath with the repo's own package.
        proc = self.procs.start(f"extractedprism-{relay}-{tag}", argv, env=env, cwd=self.tmp)
        if wait_healthy(hport, proc):
            return proc, port
        tail = self.procs.log_tail(proc)
        self.procs.stop(proc)
        self.ep_error = f"extractedprism did not become healthy ({' '.join(argv)}):\n{tail}"
        self.note(self.ep_error)
        return None

    def ref_argv(self, path: str) -> list[str] | None:
        """The command of a reference proxy (ref-c is compiled once per run), or None."""
        if path == "ref-py":
            return [sys.executable, str(REF_DIR / "tpc_min.py")]
        binary = self.tmp / "tpc"
        if not binary.exists():
            cc = shutil.which("cc") or shutil.which("gcc")
            res = None if cc is None else subprocess.run(
                [cc, "-O2", "-pthread", "-o", str(binary), str(REF_DIR / "tpc.c")],
                capture_output=True, text=True, timeout=120, check=False)
            if res is None or res.returncode != 0:
                why = "no C compiler (cc/gcc) on PATH" if res is None else res.stderr[-2000:]
                self.note(f"ref-c skipped: could not build {REF_DIR / 'tpc.c'}: {why}")
                return None
        return [str(binary)]

    def start_ref(self, path: str, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                  ) -> tuple[Proc, int] | None:
        """Start a reference proxy with the flags extractedprism gets (it ignores the rest)."""
        if path in self.ref_errors:
            return None
        cmd = self.ref_argv(path)
        if cmd is None:
            self.ref_errors[path] = "could not build"
            return None
        port, hport = free_port(), free_port()
        argv = [*cmd, "--endpoints", ",".join(f"{h}:{upstream}" for h in hosts),
                "--bind-address", HOST,
                "--bind-port", str(port), "--health-port", str(hport)]
        proc = self.procs.start(f"{path}-{tag}", argv, cwd=REPO, batch=True)
        if wait_healthy(hport, proc):
            return proc, port
        self.ref_errors[path] = f"{path} did not start: {self.procs.log_tail(proc)}"
        self.note(self.ref_errors[path])
        self.procs.stop(proc)
        return None

    def start_proxy(self, path: str, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                    ) -> tuple[Proc | None, int] | None:
        """(proxy process or None for direct, port to load), or None if it could not start.
        ``hosts``: the upstream's addresses, one endpoint / server each (direct: the first)."""
        if path == "direct":
            return None, upstream
        if path == "haproxy":
            return self.start_haproxy(tag, upstream, hosts)
        if path == "ep-python":
            return self.start_ep(tag, upstream, relay="python", hosts=hosts)
        if path in REFS:
            return self.start_ref(path, tag, upstream, hosts)
        return self.start_ep(tag, upstream, hosts=hosts)

    def proxies_for(self, tag: str, upstream: int, hosts: tuple[str, ...] = (HOST,)
                    ) -> dict[str, tuple[Proc | None, int]]:
        """{path: (proxy process or None, port)} for the selected paths that started."""
        out: dict[str, tuple[Proc | None, int]] = {}
        for path in self.args.paths:
            started = self.start_proxy(path, tag, upstream, hosts)
            if started:
                out[path] = started
        return out

    def stop_proxies(self, proxies: dict) -> None:
        for proc, _ in proxies.values():
            if proc is not None:
                self.procs.stop(proc)

    def py_spy(self, phase: str, path: str, proc: Proc | None, seconds: float) -> Proc | None:
        """Attach py-spy to extractedprism for one run of the phase named by --py-spy."""
        if self.args.py_spy != phase or path != "extractedprism" or proc is None:
            return None
        spy = shutil.which("py-spy") or str(REPO / ".venv/bin/py-spy")
        out = Path(self.args.py_spy_dir) / f"{phase}-{int(time.time())}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"  py-spy -> {out}", flush=True)
        return self.procs.start(f"py-spy-{phase}", [
            spy, "record", "--pid", str(proc.popen.pid), "--format", "raw", "--threads",
            "--rate", "250", "--duration", str(max(1, int(seconds))), "--output", str(out)])

    def timed(self, phase: str, path: str, proc: Proc | None, argv: list[str],
              seconds: float) -> tuple[str, float | None]:
        """Run one bounded load command; return its stdout and the proxy's CPU seconds."""
        spy = self.py_spy(phase, path, proc, seconds)
        cpu0 = cpu_seconds(proc.popen.pid) if proc else None
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 20,
                                 stdin=subprocess.DEVNULL)
        finally:
            if spy is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.popen.wait(10)
                self.procs.stop(spy)
        cpu = cpu_seconds(proc.popen.pid) - cpu0 if proc else None
        if res.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {res.returncode}: "
                               f"{(res.stderr or res.stdout)[-500:]}")
        return res.stdout, cpu

    # phases -----------------------------------------------------------------------------

    def phase_bulk(self) -> None:
        print("== bulk throughput (iperf3)", flush=True)
        up = free_port()
        srv = self.procs.start("iperf3-server", ["iperf3", "-s", "-p", str(up), "-B", HOST])
        wait_listening(up, srv, self.procs)
        time.sleep(0.2)  # let iperf3 get over the probe connection above
        proxies = self.proxies_for("bulk", up)
        try:
            for rep in range(self.args.reps):
                for streams in (1, 4):
                    for path, (proc, port) in proxies.items():
                        argv = ["iperf3", "-c", HOST, "-p", str(port), "-t",
                                str(self.args.bulk_seconds), "-P", str(streams), "-J"]
                        key = f"bulk{streams}"
                        try:
                            out, cpu = self.timed("bulk", path, proc, argv,
                                                  self.args.bulk_seconds)
                            r = parse_iperf3(out)
                        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                            self.note(f"bulk {streams} {path} rep {rep}: {e}")
                            self.record(f"{key}_gbps", path, None)
                            time.sleep(1.0)  # iperf3 server needs a moment after an error
                            continue
                        self.record(f"{key}_gbps", path, r["gbps"])
                        if proc is not None:
                            self.record(f"{key}_cpu_s_per_gb", path,
                                        cpu / (r["bytes"] / 1e9) if r["bytes"] else None)
                        print(f"  rep {rep} streams {streams} {path:15s} {r['gbps']:7.2f} Gbit/s"
                              + (f"  proxy cpu {cpu / r['seconds']:.2f} cores" if cpu else ""),
                              flush=True)
        finally:
            self.stop_proxies(proxies)
            self.procs.stop(srv)

    def wrk(self, phase: str, path: str, proc: Proc | None, port: int, conns: int,
            close: bool) -> dict | None:
        argv = ["wrk", "-t", "1", "-c", str(conns), "-d", f"{self.args.wrk_seconds}s",
                "--latency", "--timeout", "2s"]
        if close:
            argv += ["-H", "Connection: close"]
        argv.append(f"http://{HOST}:{port}/")
        try:
            out, cpu = self.timed(phase, path, proc, argv, self.args.wrk_seconds)
            r = parse_wrk(out)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            self.note(f"wrk {phase} c={conns} {path}: {e}")
            return None
        r["proxy_cpu_s"] = cpu
        if r["errors"] or r["non_2xx"]:
            self.note(f"wrk {phase} c={conns} {path}: {r['errors']} socket errors "
                      f"{r.get('socket_errors')}, {r['non_2xx']} non-2xx")
        return r

    def start_nginx(self) -> tuple[Proc, int]:
        up = free_port()
        www = self.tmp / "www"
        www.mkdir(exist_ok=True)
        (www / "index.html").write_bytes(b"x" * (BODY_SIZE - 1) + b"\n")
        conf = self.tmp / "nginx.conf"
        conf.write_text(nginx_config(self.tmp, up, self.args.http_hosts))
        srv = self.procs.start("nginx", ["nginx", "-p", str(self.tmp), "-c", str(conf),
                                         "-e", str(self.tmp / "nginx-error.log")])
        wait_listening(up, srv, self.procs)
        return srv, up

    def check_http(self, path: str, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/", timeout=3) as r:
                ok = r.status == 200 and len(r.read()) == BODY_SIZE
        except OSError as e:
            self.note(f"{path}: HTTP check through port {port} failed: {e}")
            return False
        if not ok:
            self.note(f"{path}: HTTP check through port {port} returned a wrong body")
        return ok

    def phase_keepalive(self, srv_port: int) -> None:
        print("== keep-alive request/response (wrk -> nginx)", flush=True)
        proxies = self.proxies_for("keepalive", srv_port, self.args.http_hosts)
        try:
            proxies = {p: v for p, v in proxies.items() if self.check_http(p, v[1])}
            for rep in range(self.args.reps):
                for conns in (1, 64):
                    for path, (proc, port) in proxies.items():
                        r = self.wrk("keepalive", path, proc, port, conns, close=False)
                        key = f"ka{conns}"
                        self.record(f"{key}_rps", path, r and r["rps"])
                        self.record(f"{key}_p50_ms", path, r and r["p50_ms"])
                        self.record(f"{key}_p99_ms", path, r and r["p99_ms"])
                        if proc is not None:
                            self.record(f"{key}_cpu_us_per_req", path, cpu_us_per_request(r))
                        if r:
                            print(f"  rep {rep} c={conns:<3d} {path:15s} {r['rps']:9.0f} req/s"
                                  f"  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms"
                                  + cores_note(r, proc), flush=True)
        finally:
            self.stop_proxies(proxies)

    def phase_newconn(self, srv_port: int) -> None:
        print(f"== new connection per request (wrk -c 1 and -c {self.args.newconn_conns}, "
              "Connection: close)", flush=True)
        proxies = self.proxies_for("newconn", srv_port, self.args.http_hosts)
        try:
            proxies = {p: v for p, v in proxies.items() if self.check_http(p, v[1])}
            for rep in range(self.args.reps):
                for conns, key in ((1, "nc1"), (self.args.newconn_conns, "newconn")):
                    for path, (proc, port) in proxies.items():
                        r = self.wrk("newconn", path, proc, port, conns, close=True)
                        self.record(f"{key}_cps", path, r and r["rps"])
                        if key == "newconn":
                            self.record("newconn_p99_ms", path, r and r["p99_ms"])
                        if proc is not None:
                            self.record(f"{key}_cpu_us_per_conn", path, cpu_us_per_request(r))
                        if r:
                            print(f"  rep {rep} c={conns:<3d} {path:15s} {r['rps']:9.0f} conn/s"
                                  f"  p99 {r['p99_ms']:.3f} ms" + cores_note(r, proc), flush=True)
                        # Let TIME_WAIT and the proxy's connection table settle between runs.
                        time.sleep(0.3)
        finally:
            self.stop_proxies(proxies)

    def open_idle(self, port: int, n: int, deadline: float) -> list[socket.socket]:
        """Open n connections to port and prove each reaches the holder (1-byte echo)."""
        socks: list[socket.socket] = []
        try:
            for _ in range(n):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(socks)} of {n} connections opened in time")
                s = socket.create_connection((HOST, port), timeout=5)
                socks.append(s)
            for s in socks:
                s.sendall(b"x")
            sel = selectors.DefaultSelector()
            for s in socks:
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            pending = len(socks)
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{pending} of {n} connections not echoed in time")
                for key, _ in sel.select(0.5):
                    data = key.fileobj.recv(16)
                    sel.unregister(key.fileobj)
                    pending -= 1
                    if data != b"x":
                        raise ConnectionError(f"connection closed or garbled: {data!r}")
            sel.close()
            return socks
        except BaseException:
            for s in socks:
                s.close()
            raise

    def phase_idle(self) -> None:
        n = self.args.idle_conns
        print(f"== resident memory with {n} idle connections", flush=True)
        up = free_port()
        holder = self.procs.start("holder", [sys.executable, str(Path(__file__).resolve()),
                                             "--hold", str(up)])
        wait_listening(up, holder, self.procs)
        try:
            for path in self.args.paths:
                if path == "direct":
                    continue
                started = self.start_proxy(path, "idle", up)
                if not started:
                    continue
                try:
                    self.measure_idle(path, started[0], started[1], n)
                finally:
                    self.stop_proxies({path: started})
        finally:
            self.procs.stop(holder)

    def measure_idle(self, path: str, proc: Proc, port: int, n: int) -> None:
        deadline = time.monotonic() + 60
        # Warm up: a few connections first so lazily built state (pools, first-use imports)
        # counts in the baseline, not per connection.
        for s in self.open_idle(port, 20, deadline):
            s.close()
        time.sleep(0.5)
        before = settled_rss(proc.popen.pid)
        try:
            socks = self.open_idle(port, n, deadline)
        except (OSError, TimeoutError, ConnectionError) as e:
            self.note(f"idle {path}: {e}")
            self.record("idle_rss_kib_per_conn", path, None)
            return
        try:
            after = settled_rss(proc.popen.pid)
        finally:
            for s in socks:
                s.close()
        per = (after["rss_kib"] - before["rss_kib"]) / n
        self.record("idle_rss_kib_per_conn", path, per)
        self.record("idle_rss_total_mib", path, after["rss_kib"] / 1024)
        self.idle_detail = getattr(self, "idle_detail", {})
        self.idle_detail[path] = {"before": before, "after": after, "connections": n}
        print(f"  {path:15s} RSS {before['rss_kib']} -> {after['rss_kib']} KiB "
              f"(threads {before['threads']} -> {after['threads']}, fds {before['fds']} -> "
              f"{after['fds']}): {per:.1f} KiB/conn",
              flush=True)


# --- the idle-connection holder (a child process: bench.py --hold PORT) -----------------


def hold_forever(port: int) -> None:
    """Accept everything, echo what arrives, keep connections open until the peer closes."""
    raise_nofile()
    sel = selectors.DefaultSelector()
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((HOST, port))
    lsock.listen(4096)
    lsock.setblocking(False)
    sel.register(lsock, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if sock is lsock:
                with contextlib.suppress(BlockingIOError):
                    conn, _ = lsock.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                with contextlib.suppress(OSError):
                    sock.send(data)
            else:
                sel.unregister(sock)
                sock.close()


# --- main --------------------------------------------------------------------------------


def tool_versions() -> dict:
    out = {}
    for argv in (["haproxy", "-v"], ["nginx", "-v"], ["wrk", "-v"], ["iperf3", "-v"]):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=5)
            out[argv[0]] = ((r.stdout or "") + (r.stderr or "")).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            out[argv[0]] = None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark extractedprism against the direct path and HAProxy on loopback.")
    p.add_argument("--quick", action="store_true",
                   help="one short repetition of everything (smoke test, under 90 s)")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions of each measurement; the table shows the best (default 3)")
    p.add_argument("--bulk-seconds", type=int, default=None, help="iperf3 -t (default 3)")
    p.add_argument("--wrk-seconds", type=int, default=None, help="wrk -d (default 3)")
    p.add_argument("--newconn-conns", type=int, default=64,
                   help="concurrent connections of the new-connection test (default 64; a "
                        "c=1 run is always made too)")
    p.add_argument("--idle-conns", type=int, default=2000, help="idle connections (default 2000)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma-separated subset of {','.join(PATHS + REFS)} (default "
                        f"{','.join(DEFAULT_PATHS)}); extractedprism runs --relay native, "
                        "ep-python --relay python; the reference proxies ref-c and ref-py "
                        "(scripts/bench_ref/: the same data-path shape in C and in minimal "
                        "CPython) are opt-in")
    p.add_argument("--http-upstreams", type=int, default=1,
                   help="for the keep-alive and new-connection phases, nginx listens on this "
                        "many loopback addresses (127.0.0.1 up, one port) and each proxy gets "
                        "them all (HAProxy servers, round robin; extractedprism endpoints). "
                        "Default 1; with 2 or more every new connection takes "
                        "extractedprism's silent-upstream check, as on a node with several "
                        "API servers (with one it is skipped: nowhere else to go)")
    p.add_argument("--haproxy-threads", type=int, default=os.cpu_count() or 1,
                   help="HAProxy nbthread (default: CPU count, as HAProxy itself picks)")
    p.add_argument("--ep-cmd", default=None,
                   help="command that starts extractedprism; flags are appended")
    p.add_argument("--ep-pythonpath", default=None,
                   help="PYTHONPATH for extractedprism (default: the repo; point it at a "
                        "scratch copy of the package to benchmark a prototype)")
    p.add_argument("--ep-args", default="", help="extra extractedprism flags")
    p.add_argument("--ep-max-connections", type=int, default=4096,
                   help="extractedprism --max-connections (default 4096, the flag's default)")
    p.add_argument("--ep-health-interval", default="30s",
                   help="extractedprism --health-interval (default 30s: checks stay out of the "
                        "measurement, as HAProxy runs none)")
    p.add_argument("--ep-retry", action="store_true",
                   help="try to start extractedprism again in later phases after a failure")
    p.add_argument("--py-spy", choices=PHASES[:3], default=None,
                   help="record a py-spy profile (raw collapsed stacks) of extractedprism "
                        "during this phase")
    p.add_argument("--py-spy-dir", default=str(REPO / "bench-results" / "profiles"))
    p.add_argument("--out", default=None, help="JSON path (default bench-results/bench-<ts>.json)")
    p.add_argument("--max-seconds", type=int, default=600,
                   help="watchdog: abort the whole run after this long (default 600)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (configs, logs)")
    p.add_argument("--hold", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.ep_cmd_given = a.ep_cmd is not None
    a.ep_cmd = a.ep_cmd or "{python} -m extractedprism"
    a.reps = a.reps or (1 if a.quick else 3)
    a.bulk_seconds = a.bulk_seconds or (2 if a.quick else 3)
    a.wrk_seconds = a.wrk_seconds or (2 if a.quick else 3)
    if not 1 <= a.http_upstreams <= 8:
        p.error("--http-upstreams must be 1-8")
    a.http_hosts = tuple(f"127.0.0.{i}" for i in range(1, a.http_upstreams + 1))
    a.phases = [x for x in a.phases.split(",") if x]
    a.paths = [x for x in a.paths.split(",") if x]
    for x in a.phases:
        if x not in PHASES:
            p.error(f"unknown phase {x!r}")
    for x in a.paths:
        if x not in PATHS + REFS:
            p.error(f"unknown path {x!r}")
    return a


def on_alarm(signum: int, frame: object) -> None:
    raise Watchdog("run exceeded --max-seconds")


def on_term(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    for tool in ("iperf3", "haproxy", "nginx", "wrk"):
        if shutil.which(tool) is None:
            raise HarnessError(f"{tool} not found on PATH (scripts/bench installs it)")
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="ep-bench-"))
    procs = Procs(tmp)
    bench = Bench(args, procs, tmp)
    started = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    print(f"extractedprism bench: paths={','.join(args.paths)} phases={','.join(args.phases)} "
          f"reps={args.reps} (temp dir {tmp})", flush=True)
    try:
        if "bulk" in args.phases:
            bench.phase_bulk()
        if "keepalive" in args.phases or "newconn" in args.phases:
            srv, up = bench.start_nginx()
            try:
                if "keepalive" in args.phases:
                    bench.phase_keepalive(up)
                if "newconn" in args.phases:
                    bench.phase_newconn(up)
            finally:
                procs.stop(srv)
        if "idle" in args.phases:
            bench.phase_idle()
    finally:
        procs.stop_all()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(bench.runs)
    summary = {k: v for k, v in summary.items() if k in bench.runs}
    result = {
        "timestamp": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "tools": tool_versions(),
        "settings": {k: v for k, v in vars(args).items() if k != "hold"},
        "haproxy_config": haproxy_config(0, 0, args.haproxy_threads),
        "metrics": summary,
        "same_run_ratios": rep_ratios(bench.runs),
        "idle_detail": getattr(bench, "idle_detail", {}),
        "extractedprism_error": bench.ep_error,
        "reference_errors": bench.ref_errors,
        "notes": bench.notes,
    }
    out = Path(args.out) if args.out else REPO / "bench-results" / f"bench-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(render_table(summary))
    if args.reps > 1:
        print("\nsame-run ratios to HAProxy, per repetition: median (best)")
        print(render_rep_ratios(result["same_run_ratios"]))
    print(f"\nbest of {args.reps} per cell; ±x% = (max-min)/max over the repetitions. "
          f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{result['elapsed_s']} s")
    if bench.ep_error:
        print("extractedprism could not be measured: see 'extractedprism_error' in the JSON")
    print(f"JSON: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hold is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        hold_forever(args.hold)
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.max_seconds)
    try:
        return run(args)
    except HarnessError as e:
        print(f"bench: harness error: {e}", file=sys.stderr)
        return 2
    except Watchdog as e:
        print(f"bench: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("bench: interrupted; every started process was stopped", file=sys.stderr)
        return 130
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
