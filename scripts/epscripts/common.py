"""What every script shares: where the tree is, free ports, deadline polling, and starting
and stopping children (alone or as the process group they lead).

Standard library only: scripts/controlplane runs this with the system python3. The
scripts are bounded everywhere, so every wait here takes a timeout and says whether the
condition came true instead of waiting for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
ROOT = SCRIPTS.parent
LOOPBACK = "127.0.0.1"


# --- ports ---------------------------------------------------------------------------------


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel just handed out on ``host`` (free now; a race is possible later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(preferred: int, host: str = LOOPBACK) -> int:
    """``preferred`` when it is free (a port people can remember), else any free one."""
    if preferred and port_free(preferred, host):
        return preferred
    return free_port(host)


def connects(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout``."""
    try:
        socket.create_connection((host, port), timeout).close()
    except OSError:
        return False
    return True


# --- polling waits -------------------------------------------------------------------------


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; whether it came true."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def wait_port(host: str, port: int, timeout: float, interval: float = 0.1,
              connect_timeout: float = 0.2,
              alive: Callable[[], bool] | None = None) -> bool:
    """Poll until host:port accepts a connection; False at the deadline or as soon as
    ``alive`` says the process that should listen there has gone (no point waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        if connects(host, port, connect_timeout):
            return True
        time.sleep(interval)
    return False


# --- children ------------------------------------------------------------------------------


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs ``module`` of this package with this interpreter (see child_env)."""
    return [sys.executable, "-m", module, *args]


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with scripts/ and the repository first on
    PYTHONPATH, so a child started with python_module finds epscripts and tests.fakes
    whatever its working directory."""
    env = dict(os.environ if base is None else base)
    parts = [str(SCRIPTS), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def start_group(argv: list[str], **popen: object) -> subprocess.Popen:
    """Start ``argv`` as the leader of a session of its own, so stop_process(group=True)
    reaches everything it starts."""
    return subprocess.Popen(argv, start_new_session=True, **popen)  # type: ignore[call-overload]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group ``proc`` leads (started by start_group); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_process(proc: subprocess.Popen, timeout: float, kill_timeout: float | None = None,
                 group: bool = False) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL and wait up to ``kill_timeout``
    (None: until it is reaped). With ``group`` both signals go to the process group it
    leads, so helpers it started do not outlive it."""
    if proc.poll() is not None:
        return
    if group:
        signal_group(proc, signal.SIGTERM)
    else:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        if group:
            signal_group(proc, signal.SIGKILL)
        else:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(kill_timeout)
