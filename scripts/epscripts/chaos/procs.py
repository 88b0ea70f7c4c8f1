"""The run's processes: the upstreams (scripts/chaos-local's child), the proxy and the
/upstreams sampler."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import logfmtkv

from epscripts.chaos.bounds import POLL
from epscripts.chaos.load import mono
from epscripts.common import ROOT, child_env, python_module, stop_process


def _reader_thread(name: str, stream: Any, on_line: Callable[[str], None]) -> threading.Thread:
    t = threading.Thread(target=_read_lines, args=(stream, on_line), name=name, daemon=True)
    t.start()
    return t


def _read_lines(stream: Any, on_line: Callable[[str], None]) -> None:
    for raw in stream:  # ends at EOF, when the process exits
        on_line(raw.rstrip("\n"))


class UpstreamProc:
    """One epscripts.chaos.upstream process."""

    def __init__(self, name: str, host: str, port: int, ca_cert: Path, ca_key: Path,
                 netns: str | None = None) -> None:
        self.name, self.host, self.port = name, host, port
        self.ca_cert, self.ca_key, self.netns = ca_cert, ca_key, netns
        self.proc: subprocess.Popen[str] | None = None
        self.readyz: list[tuple[float, int]] = []
        self._listening = threading.Event()
        self._lock = threading.Lock()
        self.stopped = False  # SIGSTOPped by us

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._listening.clear()
        cmd = python_module("epscripts.chaos.upstream", "--host", self.host,
                            "--port", str(self.port), "--name", self.name,
                            "--ca-cert", str(self.ca_cert), "--ca-key", str(self.ca_key))
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]  # ip execs python: same pid
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, env=child_env())
        _reader_thread(f"out-{self.name}", self.proc.stdout, self._on_line)

    def _on_line(self, line: str) -> None:
        parts = line.split()
        if parts[:1] == ["LISTENING"]:
            self._listening.set()
        elif parts[:1] == ["READYZ"] and len(parts) == 3:
            with self._lock:
                self.readyz.append((float(parts[1]), int(parts[2])))

    def wait_listening(self, timeout: float) -> bool:
        return self._listening.wait(timeout)

    def readyz_after(self, t: float, status: int) -> list[float]:
        with self._lock:
            return [at for at, st in self.readyz if at >= t and st == status]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill9(self) -> tuple[float, float]:
        """SIGKILL and reap: returns (time of the signal, time after which no socket of
        it is left)."""
        assert self.proc is not None
        t_sig = mono()
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return t_sig, mono()

    def terminate(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        if self.stopped:
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGCONT)
            self.stopped = False
        stop_process(p, 5.0, kill_timeout=5.0)


_SKIP_KEYS = ("ts", "level", "logger", "msg", "thread", "stacktrace")


def _parse_log_line(line: str) -> tuple[float, str] | None:
    """A logfmt log line -> (wall time, "msg key=value ..."), the event as it reads in
    the source's template, which the patterns below search."""
    try:
        rec = logfmtkv.parse(line)
        wall = datetime.datetime.fromisoformat(str(rec["ts"])).timestamp()
    except (KeyError, ValueError, logfmtkv.LogfmtError):
        return None
    fields = " ".join(f"{k}={v}" for k, v in rec.items() if k not in _SKIP_KEYS)
    return wall, f"{rec.get('msg', '')} {fields}".strip()


class ProxyProc:
    """extractedprism as a subprocess; its log lines are kept with their own timestamps."""

    def __init__(self, cmd: list[str], log_path: Path, health_port: int) -> None:
        self.cmd = cmd
        self.health_port = health_port
        self.log_path = log_path
        self.events: list[tuple[float, str]] = []  # (monotonic time of the log line, msg)
        self._lock = threading.Lock()
        self._offset = time.time() - mono()  # wall - monotonic
        self._log = log_path.open("w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        self._reader = _reader_thread("proxy-log", self.proc.stderr, self._on_line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _on_line(self, line: str) -> None:
        self._log.write(line + "\n")
        parsed = _parse_log_line(line)
        if parsed is None:
            return
        wall, event = parsed
        with self._lock:
            self.events.append((wall - self._offset, event))

    def first_event(self, after: float, pattern: str) -> float | None:
        rx = re.compile(pattern)
        with self._lock:
            for at, msg in self.events:
                # log timestamps are truncated to the millisecond
                if at >= after - 0.001 and rx.search(msg):
                    return at
        return None

    def get(self, path: str, timeout: float = 2.0) -> bytes:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()

    def upstreams(self) -> dict[str, dict[str, Any]]:
        doc = json.loads(self.get("/upstreams"))
        return {u["address"]: u for u in doc["upstreams"]}

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.get("/metrics").decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def stats(self) -> dict[str, int]:
        """threads, fds (sockets, kernel pipes, other) and RSS from /proc/<pid>."""
        st: dict[str, int] = {"threads": 0, "rss_kib": 0, "fds": 0, "sockets": 0, "pipes": 0}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    st["threads"] = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    st["rss_kib"] = int(line.split()[1])
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                    st["fds"] += 1
                    st["sockets"] += target.startswith("socket:")
                    st["pipes"] += target.startswith("pipe:")
        except OSError:
            pass
        return st

    def stop(self) -> None:
        stop_process(self.proc, 15.0, kill_timeout=5.0)
        self._reader.join(5)
        self._log.close()


class Monitor(threading.Thread):
    """Samples /upstreams every POLL seconds (bounded by its stop event)."""

    def __init__(self, proxy: ProxyProc) -> None:
        super().__init__(name="monitor", daemon=True)
        self.proxy = proxy
        self.samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(POLL):
            with contextlib.suppress(OSError, ValueError):
                s = self.proxy.upstreams()
                with self.lock:
                    self.samples.append((mono(), s))

    def last_new_connection(self, addr: str, t0: float, t1: float) -> float | None:
        """Upper bound of the time of the last connection attached to ``addr`` in
        [t0, t1], from the total_connections counter; None if there was none."""
        with self.lock:
            samples = [(t, s.get(addr, {}).get("total_connections")) for t, s in self.samples]
        last = None
        prev = None
        for t, total in samples:
            if t < t0:
                prev = total
                continue
            if t > t1 + POLL:
                break
            if total is not None and prev is not None and total > prev:
                last = t
            if total is not None:
                prev = total
        return last
