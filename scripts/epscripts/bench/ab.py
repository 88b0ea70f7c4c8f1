"""Paired A/B of extractedprism variants against HAProxy, for changes too small for
scripts/bench to resolve on a shared machine (docs/performance.md, fifth session).

Every variant runs at once beside one HAProxy and one nginx; each repetition runs wrk
against every variant back to back, so a burst of load from elsewhere hits all of them
alike, and the figure reported is the median over repetitions of each variant's ratio to
HAProxy in the same repetition. Bounded: --reps x variants x connection counts runs of
--seconds each; only 127.0.0.1; every child is killed by process group at the end.

    scripts/bench ab --variant new=. --variant old=/tmp/old \\
        [--variant off=.:--gil-cpu=off] [--conns 1,64] [--reps 6] [--keepalive]

A variant is NAME=PYTHONPATH[:EXTRA FLAGS] (an EP_NAME=VALUE among them is set in its
environment instead); PYTHONPATH holds an extractedprism package
(a checkout, or a scratch copy with its built extension).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from epscripts.bench.config import BODY_SIZE, HOST
from epscripts.bench.parse import cpu_seconds, parse_wrk
from epscripts.bench.services import nginx_config
from epscripts.common import free_port, signal_group, start_group, wait_port


def voluntary_switches(pid: int) -> int:
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        with contextlib.suppress(OSError, AttributeError):
            text = Path(status).read_text()
            total += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
    return total


def migrations(pid: int) -> int:
    """CPU migrations of every live thread of ``pid`` (se.nr_migrations): where pinning,
    spreading and the kernel's wake-up placement move the proxy's threads."""
    total = 0
    for sched in glob.glob(f"/proc/{pid}/task/*/sched"):
        with contextlib.suppress(OSError, AttributeError):
            text = Path(sched).read_text()
            total += int(re.search(r"^se\.nr_migrations\s+:\s+(\d+)", text, re.M).group(1))
    return total


def cpu_idle() -> list[tuple[int, int]]:
    """(idle, total) jiffies per CPU, from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = [int(x) for x in line.split()[1:]]
            out.append((f[3] + f[4], sum(f[:8])))
    return out


def start(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None
          ) -> subprocess.Popen[bytes]:
    return start_group(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME=PYTHONPATH[:FLAGS]")
    p.add_argument("--conns", default="1,64")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--seconds", type=int, default=2)
    p.add_argument("--keepalive", action="store_true", help="keep-alive, not Connection: close")
    p.add_argument("--upstreams", type=int, default=1,
                   help="nginx on this many loopback addresses, each proxy given them all "
                        "(2+: extractedprism's silent-upstream check runs, see bench/phases.py)")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds of quiet before each run (11+: the pool has retired the last "
                        "burst's pipe threads, so each run starts them cold, as the full "
                        "bench's phases do; docs/performance.md, issue 39)")
    args = p.parse_args(argv)
    os.environ["PATH"] += ":/usr/sbin:/sbin"  # haproxy and nginx, as scripts/bench does
    if (not 1 <= args.reps <= 50 or not 1 <= args.seconds <= 30 or not 1 <= args.upstreams <= 8
            or not 0 <= args.pause <= 60):
        raise SystemExit("--reps must be 1-50, --seconds 1-30, --upstreams 1-8 and --pause 0-60")
    hosts = tuple(f"127.0.0.{i}" for i in range(1, args.upstreams + 1))
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    (tmp / "www").mkdir()
    (tmp / "www" / "index.html").write_bytes(b"x" * BODY_SIZE)
    up = free_port()
    (tmp / "nginx.conf").write_text(nginx_config(tmp, up, hosts))
    procs = [start(["nginx", "-p", str(tmp), "-c", str(tmp / "nginx.conf"),
                    "-e", str(tmp / "nginx-error.log")])]
    variants: list[tuple[str, int, int]] = []  # name, pid, port
    try:
        port = free_port()
        (tmp / "haproxy.cfg").write_text(
            f"global\n nbthread {os.cpu_count() or 1}\n maxconn 8000\ndefaults\n mode tcp\n"
            " timeout connect 10s\n timeout client 10m\n timeout server 10m\n"
            f"listen l\n bind {HOST}:{port}\n"
            + "".join(f" server s{i} {h}:{up}\n" for i, h in enumerate(hosts)))
        procs.append(start(["haproxy", "-f", str(tmp / "haproxy.cfg")]))
        variants.append(("haproxy", procs[-1].pid, port))
        for spec in args.variant:
            name, _, rest = spec.partition("=")
            path, _, extra = rest.partition(":")
            port, hport = free_port(), free_port()
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
            flags = shlex.split(extra)
            env.update(f.split("=", 1) for f in flags if f.startswith("EP_") and "=" in f)
            flags = [f for f in flags if not (f.startswith("EP_") and "=" in f)]
            procs.append(start([sys.executable, "-m", "extractedprism", "--endpoints",
                                ",".join(f"{h}:{up}" for h in hosts), "--bind-address", HOST,
                                "--bind-port", str(port),
                                "--health-port", str(hport), "--enable-discovery=false",
                                "--health-interval", "30s", "--log-level", "warn",
                                *flags], env=env, cwd=str(tmp)))
            variants.append((name, procs[-1].pid, port))
        deadline = time.monotonic() + 20
        for _, _, port in variants:
            if not wait_port(HOST, port, max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"nothing listens on {HOST}:{port}")
        rows: dict[tuple[str, int],
                   list[tuple[int, float, float, float, float, list[float], float]]] = {}
        conns = [int(c) for c in args.conns.split(",")]
        for rep in range(args.reps):
            for c in conns:
                for name, pid, port in variants:
                    time.sleep(args.pause)
                    cpu0, cs0, mig0 = cpu_seconds(pid), voluntary_switches(pid), migrations(pid)
                    idle0 = cpu_idle()
                    argv = ["wrk", "-t1", "-c", str(c), "-d", f"{args.seconds}s", "--latency"]
                    if not args.keepalive:
                        argv += ["-H", "Connection: close"]
                    out = subprocess.run([*argv, f"http://{HOST}:{port}/"], capture_output=True,
                                         text=True, timeout=args.seconds + 20).stdout
                    w = parse_wrk(out)
                    n = max(1, w.get("requests", 1))
                    idle = [(i1 - i0) / max(1, t1 - t0)
                            for (i0, t0), (i1, t1) in zip(idle0, cpu_idle(), strict=True)]
                    rows.setdefault((name, c), []).append(
                        (rep, w["rps"], w["p99_ms"], 1e6 * (cpu_seconds(pid) - cpu0) / n,
                         (voluntary_switches(pid) - cs0) / n, idle,
                         (migrations(pid) - mig0) / n))
        for c in conns:
            ha = {r[0]: r[1] for r in rows[("haproxy", c)]}
            for name, _, _ in variants:
                got = rows[(name, c)]
                ratios = [r[1] / ha[r[0]] for r in got]
                print(f"c={c:<3d} {name:12s} {statistics.median(r[1] for r in got):8.0f}/s "
                      f"ratio {statistics.median(ratios):4.2f} "
                      f"({' '.join(f'{x:.2f}' for x in ratios)}) "
                      f"p99 {statistics.median(r[2] for r in got):6.2f} ms "
                      f"cpu {statistics.median(r[3] for r in got):6.1f} us "
                      f"cs {statistics.median(r[4] for r in got):5.2f} "
                      f"mig {statistics.median(r[6] for r in got):5.2f} "
                      f"p99s ({' '.join(f'{r[2]:.1f}' for r in got)}) idle "
                      + "/".join(f"{100 * statistics.median(r[5][i] for r in got):.0f}%"
                                 for i in range(len(got[0][5]))), flush=True)
    finally:
        for proc in reversed(procs):  # the proxies before their upstream
            signal_group(proc, signal.SIGTERM)
            if proc is not procs[0]:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
    return 0
