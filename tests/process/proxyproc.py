"""Run the proxy as a real subprocess with its stderr in a file (never a pipe that could
fill), on free ports, and read what it logged."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.util import PYTHON, ROOT, http, start_on_free_ports


class ProxyProcess:
    def __init__(self, proc: subprocess.Popen[Any], bind: int, health: int,
                 log_path: Path, health_host: str = "127.0.0.1") -> None:
        self.proc = proc
        self.health_host = health_host
        self.bind = bind
        self.health = health
        self.log_path = log_path

    @property
    def health_address(self) -> tuple[str, int]:
        return (self.health_host, self.health)

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def health_ok(port: int, host: str = "127.0.0.1") -> bool:
    try:
        return http((host, port), "/healthz", timeout=1)[0] == 200
    except OSError:
        return False


def start_proxy(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                stderr: Any = None, health_host: str = "127.0.0.1") -> ProxyProcess:
    """The proxy with ``args`` (after fast default timings); stderr to a file unless
    ``stderr`` is given."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    full_env.update(env or {})
    log_path = tmp_path / "proxy.stderr"
    files: list[Any] = []

    def start(ports: list[int]) -> subprocess.Popen[Any]:
        bind, health = ports
        for f in files:
            f.close()
        out = stderr if stderr is not None else open(log_path, "w")  # noqa: SIM115
        if stderr is None:
            files.append(out)
        return subprocess.Popen(
            [PYTHON, "-m", "extractedprism", "--bind-port", str(bind),
             "--health-port", str(health), "--health-interval", "2s",
             "--health-timeout", "1s", "--answer-hedge-delay", "500ms",
             "--liveness-interval", "1s",
             "--liveness-threshold", "5s", *args],
            env=full_env, cwd=ROOT, stderr=out, stdout=subprocess.DEVNULL)

    try:
        proc, (bind, health) = start_on_free_ports(start, lambda ps: health_ok(ps[1], health_host))
    finally:
        for f in files:
            f.close()
    if proc.poll() is not None:
        text = log_path.read_text() if log_path.exists() else ""
        raise AssertionError(f"the proxy exited with {proc.returncode}: {text}")
    return ProxyProcess(proc, bind, health, log_path, health_host)
