"""Run three API-server-like TLS upstreams, each in its own process, and extractedprism
in front of them (readyz checks, admin socket on); then let you break and mend them.

Says what it does as it does it, makes one request through the proxy itself, then prints
the commands to try in another terminal: a curl through the proxy, `extractedprism status
--watch`, the admin socket (list, drain, undrain), the one command that kills an upstream
and the one that starts stopped upstreams again on their addresses. A status line follows
every few seconds until Ctrl-C, which stops everything and removes the temporary directory
(the demo CA, its private key, the admin socket).
Options: --seconds N stops by itself after N seconds (used by the test suite);
--bind-port/--health-port choose the ports (default 7445/7446 when free, else any).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trustme

from epscripts.common import ROOT, child_env, pick_port, python_module, stop_process
from epscripts.demo import die_with_parent
from extractedprism.ops.status import conns_text, state_word

UPSTREAMS = 3
SERVER_NAME = "kubernetes.default.svc"  # the name the demo CA signs for the upstreams
READY_WITHIN_S = 30.0


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def status_line(health: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/upstreams", timeout=2) as r:
            doc = json.load(r)
    except OSError as exc:
        return f"status unavailable: {exc}"
    parts = [f"{u['address']} {state_word(u)} conns={conns_text(u)}"
             for u in doc["upstreams"]]
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def start_upstream(name: str, ca_cert: Path, ca_key: Path, port: int = 0
                   ) -> tuple[subprocess.Popen[str], str]:
    """One upstream process; returns it and its address once it listens."""
    proc = subprocess.Popen(
        python_module("epscripts.demo.upstream", "--name", name, "--port", str(port),
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


def first_request(bind: int, ca_file: Path, deadline: float) -> tuple[str, float] | None:
    """GET /whoami through the proxy, as the printed curl does: (answering upstream,
    seconds it took), or None if no answer came before ``deadline``."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", bind), timeout=3) as raw, \
                    ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
                tls.sendall(b"GET /whoami HTTP/1.1\r\nHost: " + SERVER_NAME.encode()
                            + b"\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := tls.recv(65536):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 200"):
                return body.decode(errors="replace").strip(), time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.2)
    return None


def cli_command(*args: str) -> str:
    """How to run `extractedprism ARGS` from a shell: the entry point next to this
    interpreter (the demo's .venv), else the module."""
    exe = Path(sys.executable).parent / "extractedprism"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "extractedprism"]
    return shlex.join([*argv, *args])


def main() -> int:
    ap = argparse.ArgumentParser(prog="scripts/demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0, help="stop after N seconds (0: never)")
    ap.add_argument("--interval", type=float, default=5.0, help="status line every N seconds")
    ap.add_argument("--bind-port", type=int, default=7445, help="proxy port (0: any free)")
    ap.add_argument("--health-port", type=int, default=7446, help="health port (0: any free)")
    args = ap.parse_args()

    started = time.monotonic()
    stop = False
    restart = False

    def on_signal(_s: int, _f: object) -> None:
        nonlocal stop
        stop = True

    def on_restart(_s: int, _f: object) -> None:
        nonlocal restart
        restart = True

    # Installed first: a Ctrl-C while it starts still removes what was made.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGUSR1, on_restart)

    tmp = Path(tempfile.mkdtemp(prefix="extractedprism-demo-"))
    ups: list[list] = []  # [name, process, address]
    proxy: subprocess.Popen[str] | None = None
    rc = 0
    try:
        say(f"making a throwaway CA for the upstreams in {tmp} (removed when the demo stops)")
        # One CA for all three, so one --health-check-ca-file verifies them all.
        ca = trustme.CA()
        ca_file, ca_key = tmp / "ca.pem", tmp / "ca.key"
        ca.cert_pem.write_to_path(str(ca_file))
        ca.private_key_pem.write_to_path(str(ca_key))
        os.chmod(ca_key, 0o600)
        say(f"starting {UPSTREAMS} TLS upstreams that answer like API servers, one process each")
        for i in range(UPSTREAMS):
            name = f"apiserver-{i}"
            proc, address = start_upstream(name, ca_file, ca_key)
            ups.append([name, proc, address])
            print(f"    {name}  {address}  pid {proc.pid}", flush=True)
        bind, health = pick_port(args.bind_port), pick_port(args.health_port)
        endpoints = ",".join(address for _, _, address in ups)
        admin_socket = tmp / "admin.sock"
        cmd = [sys.executable, "-m", "extractedprism", "--endpoints", endpoints,
               "--bind-port", str(bind), "--health-port", str(health),
               "--enable-discovery=false", "--health-interval", "2s",
               "--health-timeout", "1s", "--health-check", "readyz",
               "--health-check-ca-file", str(ca_file), "--drain-timeout", "5s",
               "--admin-socket", str(admin_socket)]
        say(f"starting extractedprism on 127.0.0.1:{bind} (health :{health}, readyz checks "
            "every 2s, admin socket on); its log follows on stderr:")
        print("    " + shlex.join(["extractedprism", *cmd[3:]]), flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        # The proxy logs to stderr; its stdout is not the demo's, so nothing holds the
        # demo's stdout open after the demo is gone.
        proxy = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
        say("sending one request through the proxy (what the curl below does)")
        answer = first_request(bind, ca_file, time.monotonic() + READY_WITHIN_S)
        if answer is None:
            say(f"no answer through the proxy within {READY_WITHIN_S:.0f}s; see its log above")
            return 1
        who, took = answer
        say(f"{who} answered through 127.0.0.1:{bind} in {took * 1000:.0f} ms, "
            f"{time.monotonic() - started:.1f}s after the demo started")
        victim_name, victim, victim_addr = ups[0]
        drained = ups[1][2]
        sock = str(admin_socket)
        listing = "\n".join(f"    {name}  {address}  pid {proc.pid}"
                            for name, proc, address in ups)
        print(f"""
extractedprism demo is running
  upstreams, one process each (TLS; answer /readyz, /version, /whoami, /watch):
{listing}
  proxy:   127.0.0.1:{bind} (extractedprism, pid {proxy.pid})
  health:  http://127.0.0.1:{health}/{{healthz,readyz,metrics,upstreams}}
  admin socket: {sock}

  try, in another terminal:
    curl --cacert {ca_file} --resolve {SERVER_NAME}:{bind}:127.0.0.1 \\
         https://{SERVER_NAME}:{bind}/whoami
    {cli_command("status", "--health-port", str(health), "--watch", "2s")}
    {cli_command("admin", "--socket", sock, "list")}
  failover: kill {victim_name} ({victim_addr}) and watch the status line react:
    kill {victim.pid}
  bring stopped upstreams back on their addresses:
    kill -USR1 {os.getpid()}
  drain {ups[1][0]} (no new connections, open ones stay), then put it back:
    {cli_command("admin", "--socket", sock, "drain", drained)}
    {cli_command("admin", "--socket", sock, "undrain", drained)}
  Ctrl-C stops everything and removes {tmp}.
""", flush=True)
        t0 = time.monotonic()
        next_status = t0
        gone: set[str] = set()
        while not stop:
            if proxy.poll() is not None:
                print(f"extractedprism exited with status {proxy.returncode}", flush=True)
                rc = 1
                break
            for up in ups:
                name, proc, address = up
                if proc.poll() is not None and name not in gone:
                    gone.add(name)
                    say(f"{name} ({address}) exited; watch its state change "
                        f"(kill -USR1 {os.getpid()} brings it back)")
            if restart:
                restart = False
                for up in ups:
                    name, proc, address = up
                    if proc.poll() is None:
                        continue
                    port = int(address.rsplit(":", 1)[1])
                    up[1], _ = start_upstream(name, ca_file, ca_key, port)
                    gone.discard(name)
                    say(f"{name} started again on {address}, pid {up[1].pid} "
                        f"(kill {up[1].pid} stops it again)")
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
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"demo stopped; removed {tmp}", flush=True)
    return rc
