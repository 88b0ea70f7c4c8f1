"""scripts/demo: upstreams in processes of their own, and a failover a newcomer can
trigger with the one command the demo prints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import IO

import pytest

from tests.util import PYTHON, ROOT, free_ports, run_cli, wait_until


def _collect(stream: IO[str], into: list[str]) -> None:
    for line in stream:
        into.append(line)


@pytest.mark.timeout(90)
def test_demo_prints_a_kill_command_and_the_status_follows_the_failover():
    bind, health = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    env["PYTHONPATH"] = str(ROOT / "scripts")  # as scripts/demo runs it
    proc = subprocess.Popen(
        [PYTHON, "-m", "epscripts.demo", "--seconds", "60", "--interval", "0.5",
         "--bind-port", str(bind), "--health-port", str(health)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env,
        start_new_session=True)  # its own group: a failed test can end its children too
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=_collect, args=(proc.stdout, lines), name="test-demo-out")
    reader.start()
    try:
        kill = wait_until(lambda: [m for line in lines
                                   if (m := re.fullmatch(r"\s+kill (\d+)\n", line))], 30,
                          message="the kill command")[0]
        victim = int(kill.group(1))
        text = "".join(lines)
        listed = re.search(rf"apiserver-0\s+(\S+)\s+pid {victim}", text)
        assert listed, text
        address = listed.group(1)
        assert victim != proc.pid
        assert f"status --health-port {health} --watch" in text
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
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the demo this test started
            proc.wait()
        reader.join(10)
        proc.stdout.close()
    assert "demo stopped" in "".join(lines)
