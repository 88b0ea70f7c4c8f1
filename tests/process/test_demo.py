"""scripts/demo: upstreams in processes of their own, a failover a newcomer triggers with
the one command the demo prints, the admin socket used through the printed commands, a
stopped upstream brought back by its printed command, and nothing left behind."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO

import pytest

from tests.util import PYTHON, ROOT, free_ports, run_cli, wait_until


def _collect(stream: IO[str], into: list[str]) -> None:
    for line in stream:
        into.append(line)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def printed(lines: list[str], pattern: str) -> re.Match[str]:
    text = "".join(lines)
    found = re.search(pattern, text, re.M)
    assert found, f"{pattern!r} not in the demo's output:\n{text}"
    return found


def run_printed(command: str) -> subprocess.CompletedProcess[str]:
    """A command line as the demo printed it, run as a newcomer would paste it."""
    return subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=20)


def row_state(health: int, address: str) -> str:
    status = run_cli("status", "--health-port", str(health))
    row = next(line for line in status.stdout.splitlines() if line.startswith(address))
    return row.split()[2]


@pytest.mark.timeout(150)
def test_demo_failover_admin_restart_and_cleanup():
    bind, health = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    env["PYTHONPATH"] = f"{ROOT / 'scripts'}{os.pathsep}{ROOT}"  # as scripts/demo runs it
    proc = subprocess.Popen(
        [PYTHON, "-m", "epscripts.demo", "--seconds", "120", "--interval", "0.5",
         "--bind-port", str(bind), "--health-port", str(health)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env,
        start_new_session=True)  # its own group: a failed test can end its children too
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=_collect, args=(proc.stdout, lines), name="test-demo-out")
    reader.start()
    pids: set[int] = set()
    try:
        wait_until(lambda: any("Ctrl-C stops everything" in line for line in lines), 60,
                   message="the demo's commands")
        # It said what it did, and made a request through the proxy itself.
        printed(lines, r"^demo: making a throwaway CA")
        printed(lines, r"^demo: apiserver-\d answered through 127\.0\.0\.1:\d+ in \d+ ms")
        tmp = Path(printed(lines, r"removes (\S+)\.$").group(1))
        assert (tmp / "ca.key").exists() and (tmp / "admin.sock").exists()
        victim = int(printed(lines, r"^\s+kill (\d+)$").group(1))
        address = printed(lines, rf"apiserver-0\s+(\S+)\s+pid {victim}$").group(1)
        pids |= {int(p) for p in re.findall(r"pid (\d+)$", "".join(lines), re.M)}
        assert victim != proc.pid and len(pids) == 3
        assert f"status --health-port {health} --watch 2s" in "".join(lines)

        # The admin socket, through the printed commands.
        listing = run_printed(printed(lines, r"^\s+(\S+ admin --socket \S+ list)$").group(1))
        assert listing.returncode == 0, listing.stderr
        assert len(listing.stdout.splitlines()) == 4  # header + 3 upstreams
        drain = printed(lines, r"^\s+(\S+ admin --socket \S+ drain (\S+))$")
        drained = drain.group(2)
        res = run_printed(drain.group(1))
        assert res.returncode == 0, res.stderr
        assert row_state(health, drained) == "admin-drain"
        res = run_printed(printed(lines, r"^\s+(\S+ admin --socket \S+ undrain \S+)$").group(1))
        assert res.returncode == 0, res.stderr
        wait_until(lambda: row_state(health, drained) != "admin-drain", 10, message="undrained")

        # Failover: the printed kill.
        wait_until(lambda: any(f"{address} healthy" in line for line in lines), 30,
                   message="the victim healthy first")
        os.kill(victim, signal.SIGTERM)  # what the newcomer does (a child of our demo)
        # readyz mode: the upstream is first unready (closing-unready), then unhealthy.
        gone = re.compile(rf"{re.escape(address)} (?!healthy )\S+ ")
        wait_until(lambda: any(gone.search(line) for line in lines), 30,
                   message="the status line shows the failover")
        status = run_cli("status", "--health-port", str(health))
        assert status.returncode == 0, status.stderr  # two upstreams still serve
        row = next(line for line in status.stdout.splitlines() if line.startswith(address))
        assert row.split()[2] in ("closing-unready", "unhealthy"), row
        assert row.split()[3] == "no" and "connection refused" in row

        # Back: the printed restart command, then the same address is healthy again.
        demo_pid = int(printed(lines, r"^\s+kill -USR1 (\d+)$").group(1))
        assert demo_pid == proc.pid
        n = len(lines)
        os.kill(demo_pid, signal.SIGUSR1)
        again = wait_until(lambda: [m for line in lines[n:] if (m := re.search(
            rf"apiserver-0 started again on {re.escape(address)}, pid (\d+)", line))], 20,
            message="the upstream started again")[0]
        pids.add(int(again.group(1)))
        n = len(lines)
        wait_until(lambda: any(f"{address} healthy" in line for line in lines[n:]), 30,
                   message="the same address healthy again")

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the demo this test started
            proc.wait()
        reader.join(10)
        proc.stdout.close()
    assert f"demo stopped; removed {tmp}" in "".join(lines)
    assert not tmp.exists(), "the demo CA's private key was left behind"
    assert [p for p in pids if alive(p)] == []


@pytest.mark.timeout(60)
def test_a_demo_killed_outright_takes_its_children_with_it():
    bind, health = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    env["PYTHONPATH"] = f"{ROOT / 'scripts'}{os.pathsep}{ROOT}"
    proc = subprocess.Popen(
        [PYTHON, "-m", "epscripts.demo", "--seconds", "50", "--bind-port", str(bind),
         "--health-port", str(health)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env,
        start_new_session=True)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=_collect, args=(proc.stdout, lines), name="test-demo-out")
    reader.start()
    try:
        wait_until(lambda: any("Ctrl-C stops everything" in line for line in lines), 40,
                   message="the demo running")
        pids = {int(p) for p in re.findall(r"pid (\d+)$", "".join(lines), re.M)}
        pids.add(int(printed(lines, r"^\s+proxy: .*\(extractedprism, pid (\d+)\)$").group(1)))
        assert len(pids) == 4
        proc.kill()  # no chance to clean up: the children must still go
        proc.wait()
        wait_until(lambda: not [p for p in pids if alive(p)], 20,
                   message="the upstreams and the proxy gone with the demo")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
        proc.stdout.close()
