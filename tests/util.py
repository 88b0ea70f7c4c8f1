"""Small helpers shared by the tests: polling instead of sleeping, free ports, subprocesses."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def wait_until(pred: Callable[[], T], timeout: float = 10.0, interval: float = 0.02,
               message: str = "") -> T:
    """Poll ``pred`` until it returns a truthy value; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: T = pred()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or pred}")
        time.sleep(interval)
        last = pred()
    return last


def first_checks_recorded(servers: Iterable[Any]) -> bool:
    """Every fake upstream in ``servers`` has taken two connections from an App's health
    checks. The ticker never overlaps two checks of one upstream and records a result
    before the next check of it starts, so the first results are in the registry. (A new
    upstream counts as healthy before its first check: waiting for "healthy" waits for
    nothing.)"""
    return all(s.accepted >= 2 for s in servers)


def read_head(sock: socket.socket) -> bytes | None:
    """An HTTP request or answer head (through the blank line, with whatever followed it
    in the same read), or None when the peer closes first."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        head += chunk
    return head


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; another process may take it before it is bound
    again (see start_on_free_ports). Never use it as a port that must stay closed."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_on_free_ports(start: Callable[[list[int]], subprocess.Popen[Any]],
                        ready: Callable[[list[int]], bool], n: int = 2, attempts: int = 3,
                        timeout: float = 15.0) -> tuple[subprocess.Popen[Any], list[int]]:
    """Start a process that must listen on ``n`` fixed ports, and wait until ``ready``.

    The ports were free a moment before the process binds them; another process (a
    connection of a test running in parallel takes its local port from the same range)
    may take one in between, and the proxy then exits with status 1 ("cannot start").
    That is retried on fresh ports. Any other early exit is returned to the caller, who
    reports it; so is the last attempt's.
    """
    for attempt in range(attempts):
        ports = free_ports(n)
        proc = start(ports)
        try:
            wait_until(lambda p=proc, ps=ports: p.poll() is not None or ready(ps), timeout,
                       message=f"process on ports {ports} ready or exited")
        except AssertionError:
            reap(proc)  # neither ready nor exited: leave nothing running behind the test
            raise
        if proc.poll() is None or proc.returncode != 1 or attempt == attempts - 1:
            return proc, ports
        reap(proc)
    raise AssertionError("unreachable")


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` if it still runs, wait for it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 20.0
            ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m extractedprism`` to completion (for validation tests)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    full_env.update(env or {})
    return subprocess.run([PYTHON, "-m", "extractedprism", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)


def http(address: tuple[str, int], path: str, method: str = "GET",
         timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request to the health server: (status, headers, body)."""
    import http.client

    conn = http.client.HTTPConnection(address[0], address[1], timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def http_status(port: int, path: str) -> int:
    """The status of a GET of ``path`` on 127.0.0.1:``port``; 0 while nothing answers."""
    try:
        return http(("127.0.0.1", port), path, timeout=2)[0]
    except OSError:
        return 0


class FixedRandom(random.Random):
    """A random source whose random() always returns ``value`` (exact jitter in tests)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


# --- reading product state the way its readers do: through snapshot() -------------


def live_connections(registry: Any) -> tuple[Any, ...]:
    """Every live proxied connection (``ConnView``) of a Registry."""
    return registry.snapshot(connections=True).connections  # type: ignore[no-any-return]


def connection_count(registry: Any) -> int:
    """How many proxied connections a Registry tracks right now."""
    return registry.snapshot().connections_active  # type: ignore[no-any-return]


def sample(metrics: Any, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The current value of one sample of a Metrics' registry (None: no such series)."""
    return metrics.registry.get_sample_value(name, labels or {})  # type: ignore[no-any-return]


# --- clients through an App's proxy -------------------------------------------------


def connect(app: Any, timeout: float = 5.0) -> socket.socket:
    """A client connection to an App's proxy listener."""
    return socket.create_connection(app.proxy_address, timeout=timeout)


def read_line(sock: socket.socket) -> str:
    """One line from ``sock`` (an IdentityServer's name), byte by byte so nothing after
    it is consumed."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def dropped(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The proxy closed ``sock`` without a byte (EOF or a reset): a client turned away."""
    sock.settimeout(timeout)
    try:
        return sock.recv(10) == b""
    except ConnectionResetError:
        return True


def send_and_read_to_eof(sock: socket.socket, data: bytes, *, half_close: bool) -> bytes:
    """Send ``data`` (then shut the write side if ``half_close``) and read until the peer
    closes."""
    sock.sendall(data)
    if half_close:
        sock.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def whoami(app: Any) -> str:
    """The name of the IdentityServer a new connection through ``app`` lands on."""
    with connect(app) as s:
        return read_line(s)
