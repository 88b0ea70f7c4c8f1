"""Run three API-server-like TLS upstreams, each in its own process, and extractedprism
in front of them; then show a failover.

Prints how to reach the proxy, the one command that kills one upstream, and a status
line every few seconds until Ctrl-C: kill the upstream and watch the line (and
``extractedprism status --watch`` in another terminal) move the traffic.
Options: --seconds N stops by itself after N seconds (used by the test suite);
--bind-port/--health-port choose the ports (default 7445/7446 when free, else any).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trustme

from epscripts.common import ROOT, child_env, pick_port, python_module, stop_process
from extractedprism.ops.status import conns_text, state_word

UPSTREAMS = 3


def status_line(health: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/upstreams", timeout=2) as r:
            doc = json.load(r)
    except OSError as exc:
        return f"status unavailable: {exc}"
    parts = [f"{u['address']} {state_word(u)} conns={conns_text(u)}"
             for u in doc["upstreams"]]
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def start_upstream(name: str, ca_cert: Path, ca_key: Path) -> tuple[subprocess.Popen[str], str]:
    """One upstream process; returns it and its address once it listens."""
    proc = subprocess.Popen(
        python_module("epscripts.demo.upstream", "--name", name,
                      "--ca-cert", str(ca_cert), "--ca-key", str(ca_key)),
        stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        proc.wait()
        raise SystemExit(f"demo upstream {name} did not start: {line!r}")
    proc.stdout.close()
    return proc, line.split()[1]


def main() -> int:
    ap = argparse.ArgumentParser(prog="scripts/demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0, help="stop after N seconds (0: never)")
    ap.add_argument("--interval", type=float, default=5.0, help="status line every N seconds")
    ap.add_argument("--bind-port", type=int, default=7445, help="proxy port (0: any free)")
    ap.add_argument("--health-port", type=int, default=7446, help="health port (0: any free)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="extractedprism-demo-"))
    # One CA for all three, so one --health-check-ca-file verifies them all.
    ca = trustme.CA()
    ca_file, ca_key = tmp / "ca.pem", tmp / "ca.key"
    ca.cert_pem.write_to_path(str(ca_file))
    ca.private_key_pem.write_to_path(str(ca_key))
    os.chmod(ca_key, 0o600)
    ups: list[tuple[str, subprocess.Popen[str], str]] = []
    proxy: subprocess.Popen[str] | None = None
    rc = 0
    try:
        for i in range(UPSTREAMS):
            name = f"apiserver-{i}"
            proc, address = start_upstream(name, ca_file, ca_key)
            ups.append((name, proc, address))
        bind, health = pick_port(args.bind_port), pick_port(args.health_port)
        endpoints = ",".join(address for _, _, address in ups)
        cmd = [sys.executable, "-m", "extractedprism", "--endpoints", endpoints,
               "--bind-port", str(bind), "--health-port", str(health),
               "--enable-discovery=false", "--health-interval", "2s",
               "--health-timeout", "1s", "--health-check", "readyz",
               "--health-check-ca-file", str(ca_file), "--drain-timeout", "5s"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        # The proxy logs to stderr; its stdout is not the demo's, so nothing holds the
        # demo's stdout open after the demo is gone.
        proxy = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        victim_name, victim, victim_addr = ups[0]
        status_cmd = shlex.join([str(ROOT / ".venv" / "bin" / "extractedprism"), "status",
                                 "--health-port", str(health), "--watch"])
        listing = "\n".join(f"    {name}  {address}  pid {proc.pid}"
                            for name, proc, address in ups)
        print(f"""
extractedprism demo
  upstreams, one process each (TLS; answer /readyz, /version, /whoami, /watch):
{listing}
  proxy:   127.0.0.1:{bind}     health: http://127.0.0.1:{health}/{{healthz,readyz,metrics,upstreams}}
  try:
    curl --cacert {ca_file} --resolve kubernetes.default.svc:{bind}:127.0.0.1 \\
         https://kubernetes.default.svc:{bind}/whoami
    {status_cmd}
  failover: kill {victim_name} ({victim_addr}) and watch the status line react:
    kill {victim.pid}
  Ctrl-C to stop.
""", flush=True)
        stop = False

        def on_signal(_s: int, _f: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        t0 = time.monotonic()
        next_status = t0 + 1.0
        gone: set[str] = set()
        while not stop:
            if proxy.poll() is not None:
                print(f"extractedprism exited with status {proxy.returncode}", flush=True)
                rc = 1
                break
            for name, proc, address in ups:
                if proc.poll() is not None and name not in gone:
                    gone.add(name)
                    print(f"{time.strftime('%H:%M:%S')} {name} ({address}) exited; "
                          "watch its state change", flush=True)
            if args.seconds and time.monotonic() - t0 >= args.seconds:
                break
            if time.monotonic() >= next_status:
                print(status_line(health), flush=True)
                next_status += args.interval
            time.sleep(0.1)
    finally:
        if proxy is not None:
            stop_process(proxy, 10.0)
        for _, proc, _ in ups:
            stop_process(proc, 10.0)
    print("demo stopped", flush=True)
    return rc
