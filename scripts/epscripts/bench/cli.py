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
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from epscripts.bench.config import DEFAULT_PATHS, PATHS, PHASES, REFS, HarnessError, Watchdog
from epscripts.bench.phases import Bench
from epscripts.bench.report import render_rep_ratios, render_table, rep_ratios, summarize
from epscripts.bench.services import Procs, haproxy_config, hold_forever, raise_nofile
from epscripts.common import ROOT


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
        prog="scripts/bench",
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
    p.add_argument("--py-spy-dir", default=str(ROOT / "bench-results" / "profiles"))
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
    out = Path(args.out) if args.out else ROOT / "bench-results" / f"bench-{stamp}.json"
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
