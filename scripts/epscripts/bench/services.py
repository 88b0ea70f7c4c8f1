"""The benchmark's children: process bookkeeping, HAProxy and nginx configs, and the
idle-connection holder (a child process: scripts/bench --hold PORT)."""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from epscripts.bench.config import HOST, NOFILE_WANTED, HarnessError
from epscripts.common import start_group, stop_process, wait_port


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

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Procs:
    """Every child the harness starts; each in its own session so it can be killed as a group."""

    tmp: Path
    live: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict | None = None,
              cwd: Path | None = None, batch: bool = False) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as fh:
            popen = start_group(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=env,
                                cwd=cwd, preexec_fn=child_setup_batch if batch else raise_nofile)
        proc = Proc(name, popen, log)
        self.live.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 5.0) -> None:
        if proc in self.live:
            self.live.remove(proc)
        # The group: a proxy's helpers (py-spy's target, nginx workers) go with it.
        stop_process(proc.popen, timeout, kill_timeout=2.0, group=True)

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


def wait_listening(port: int, proc: Proc, procs: Procs, timeout: float = 15.0) -> None:
    if wait_port(HOST, port, timeout, interval=0.05, connect_timeout=0.5, alive=proc.alive):
        return
    if not proc.alive():
        raise HarnessError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                           f"{procs.log_tail(proc)}")
    raise HarnessError(f"{proc.name} not listening on {port} after {timeout}s")


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
