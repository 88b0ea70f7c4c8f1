"""Helpers for the node-lifecycle tests and scripts/bench handover: real proxy
processes on fixed ports, a client loop that opens a new connection every few ms, and
long-lived connections whose close times are recorded."""

from __future__ import annotations

import errno
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO

from tests.util import PYTHON, ROOT, http, start_on_free_ports


class Proc:
    """One ``python -m extractedprism`` process whose stderr is collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        full_env.update(env or {})
        self.args = args
        self.popen = subprocess.Popen([PYTHON, "-m", "extractedprism", *args], env=full_env,
                                      cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        assert self.popen.stderr is not None
        self._reader = threading.Thread(name="test-stderr-reader", target=self._collect,
                                        args=(self.popen.stderr,), daemon=True)
        self._reader.start()

    def _collect(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def saw(self, text: str) -> bool:
        return text in self.log

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def reap(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(5)
        if self.popen.stderr is not None:
            self.popen.stderr.close()


def proxy_args(bind: int, health: int, upstream: str, *extra: str) -> list[str]:
    return ["--bind-port", str(bind), "--health-port", str(health), "--endpoints", upstream,
            "--enable-discovery=false", "--health-interval", "2s", "--health-timeout", "1s",
            *extra]


def healthz_ok(port: int) -> bool:
    try:
        return http(("127.0.0.1", port), "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


def start_first(upstream: str, *extra: str) -> tuple[Proc, int, int]:
    """The first instance, on two fixed ports that were free (retried on a clash)."""
    made: list[Proc] = []

    def start(ports: list[int]) -> subprocess.Popen[str]:
        made.append(Proc(proxy_args(ports[0], ports[1], upstream, *extra)))
        return made[-1].popen

    popen, (bind, health) = start_on_free_ports(start, lambda ps: healthz_ok(ps[1]))
    proc = made[-1]
    for other in made[:-1]:
        other.reap()
    if popen.poll() is not None:
        proc.reap()
        raise AssertionError(f"the proxy exited with {popen.returncode}: {proc.log}")
    return proc, bind, health


@dataclass
class LoopResult:
    attempts: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    # (monotonic time, outcome) of every failed attempt, for the gap figure.
    failed_at: list[tuple[float, str]] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def gap(self) -> float:
        """Time from the first failed attempt to the last (0 when none failed)."""
        if not self.failed_at:
            return 0.0
        return self.failed_at[-1][0] - self.failed_at[0][0]


class ClientLoop:
    """A new connection every ``every`` s (bounded by ``max_attempts`` and ``max_s``):
    connect, read the upstream's greeting, close; failures counted by kind."""

    def __init__(self, port: int, greeting: bytes, every: float = 0.005,
                 max_attempts: int = 6000, max_s: float = 60.0) -> None:
        self._port = port
        self._greeting = greeting
        self._every = every
        self._max_attempts = max_attempts
        self._max_s = max_s
        self._stop = threading.Event()
        self.result = LoopResult()
        self._thread = threading.Thread(name="test-client-loop", target=self._run,
                                        daemon=True)

    def start(self) -> ClientLoop:
        self._thread.start()
        return self

    def stop(self) -> LoopResult:
        self._stop.set()
        self._thread.join(10)
        return self.result

    def _one(self) -> str:
        try:
            with socket.create_connection(("127.0.0.1", self._port), timeout=2) as s:
                s.settimeout(2)
                got = b""
                while len(got) < len(self._greeting):
                    chunk = s.recv(len(self._greeting) - len(got))
                    if not chunk:
                        return "closed before the greeting"
                    got += chunk
                return "ok" if got == self._greeting else f"unexpected {got!r}"
        except ConnectionRefusedError:
            return "refused"
        except ConnectionResetError:
            return "reset"
        except TimeoutError:
            return "timeout"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))

    def _run(self) -> None:
        end = time.monotonic() + self._max_s
        r = self.result
        while (not self._stop.is_set() and r.attempts < self._max_attempts
               and time.monotonic() < end):
            t = time.monotonic()
            outcome = self._one()
            r.attempts += 1
            if outcome == "ok":
                r.ok += 1
            else:
                r.failures[outcome] += 1
                r.failed_at.append((t, outcome))
            self._stop.wait(max(0.0, self._every - (time.monotonic() - t)))


class HeldConnections:
    """``n`` connections through the proxy, kept open; the time each one is closed by the
    proxy (EOF or reset) is recorded by one watcher thread."""

    def __init__(self, port: int, n: int, greeting: bytes) -> None:
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.settimeout(5)
            assert s.recv(len(greeting)) == greeting
            s.setblocking(False)
            self.socks.append(s)
        self.closed_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(name="test-held-watcher", target=self._watch,
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        with selectors.DefaultSelector() as sel:
            for i, s in enumerate(self.socks):
                sel.register(s, selectors.EVENT_READ, i)
            while not self._stop.is_set() and len(self.closed_at) < len(self.socks):
                for key, _ in sel.select(0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.closed_at[key.data] = time.monotonic()
                        sel.unregister(sock)

    def all_closed(self) -> bool:
        return len(self.closed_at) == len(self.socks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def max_in_any_window(times: list[float], width: float) -> int:
    """The largest number of ``times`` inside any window of ``width`` seconds."""
    ts = sorted(times)
    best = 0
    j = 0
    for i in range(len(ts)):
        while ts[i] - ts[j] > width:
            j += 1
        best = max(best, i - j + 1)
    return best
