"""Run three API-server-like TLS upstreams and extractedprism in front of them.

Prints how to reach the proxy and a one-line status every few seconds until Ctrl-C.
Options: --seconds N stops by itself after N seconds (used by the test suite).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trustme  # noqa: E402

from tests.fakes.upstream import FakeUpstream  # noqa: E402


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(preferred: int) -> int:
    if port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_line(health: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/upstreams", timeout=2) as r:
            doc = json.load(r)
    except OSError as exc:
        return f"status unavailable: {exc}"
    parts = []
    for u in doc["upstreams"]:
        state = "up" if u["healthy"] else "DOWN"
        if u.get("readiness") not in (None, "n/a"):
            state += f"/{u['readiness']}"
        parts.append(f"{u['address']} {state} conns={u['active_connections']}"
                     f" total={u['total_connections']}")
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=0, help="stop after N seconds (0: never)")
    ap.add_argument("--interval", type=float, default=5.0, help="status line every N seconds")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="extractedprism-demo-"))
    # One CA for all three, so one --health-check-ca-file verifies them all.
    ca = trustme.CA()
    ca_file = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ups = [FakeUpstream(name=f"apiserver-{i}", ca=ca).start() for i in range(3)]
    bind, health = pick_port(7445), pick_port(7446)
    endpoints = ",".join(u.address for u in ups)
    cmd = [sys.executable, "-m", "extractedprism", "--endpoints", endpoints,
           "--bind-port", str(bind), "--health-port", str(health),
           "--enable-discovery=false", "--health-interval", "2s", "--health-timeout", "1s",
           "--health-check", "readyz", "--health-check-ca-file", str(ca_file),
           "--drain-timeout", "5s"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    proxy = subprocess.Popen(cmd, env=env)
    print(f"""
extractedprism demo
  upstreams (TLS, answer /readyz, /version, /whoami, /watch): {endpoints}
  proxy:   127.0.0.1:{bind}     health: http://127.0.0.1:{health}/{{healthz,readyz,metrics,upstreams}}
  try:
    curl --cacert {ca_file} --resolve kubernetes.default.svc:{bind}:127.0.0.1 \\
         https://kubernetes.default.svc:{bind}/whoami
    curl http://127.0.0.1:{health}/upstreams
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
    rc = 0
    try:
        while not stop:
            if proxy.poll() is not None:
                print(f"extractedprism exited with status {proxy.returncode}", flush=True)
                rc = 1
                break
            if args.seconds and time.monotonic() - t0 >= args.seconds:
                break
            if time.monotonic() >= next_status:
                print(status_line(health), flush=True)
                next_status += args.interval
            time.sleep(0.1)
    finally:
        if proxy.poll() is None:
            proxy.send_signal(signal.SIGTERM)
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
                proxy.wait()
        for u in ups:
            u.stop()
    print("demo stopped", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
