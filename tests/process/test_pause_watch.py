"""epscripts.fleet.observe.PauseWatch: a measuring process that is stopped as a whole (what
a paused or snapshotted VM does to every process) reports the stop, and one that runs on
reports nothing. The stop is a real SIGSTOP of a real child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from epscripts.fleet import compare_doc  # noqa: E402
from epscripts.fleet.observe import PAUSE_MIN_S  # noqa: E402

STOPPED_S = PAUSE_MIN_S + 1.0

CHILD = """
import json, sys, time
from epscripts.fleet.observe import PauseWatch
w = PauseWatch(max_s=60).start()
print("ready", flush=True)
sys.stdin.readline()  # the parent says when it is done with us
w.stop()
print(json.dumps(w.pauses), flush=True)
"""

pytestmark = pytest.mark.timeout(60)


def _child() -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _pauses(proc: subprocess.Popen[str]) -> list[list[float]]:
    out, _ = proc.communicate("done\n", timeout=20)
    return json.loads(out.strip().splitlines()[-1])


def test_a_stopped_process_reports_the_stop() -> None:
    proc = _child()
    try:
        time.sleep(0.5)  # a few ticks first
        t0 = time.time()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(STOPPED_S)
        os.kill(proc.pid, signal.SIGCONT)
        pauses = _pauses(proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    assert len(pauses) == 1, pauses
    began, seconds = pauses[0]
    assert STOPPED_S - 0.5 <= seconds <= STOPPED_S + 2.0, pauses
    assert abs(began - t0) <= 1.0, (began, t0)


def test_a_running_process_reports_nothing() -> None:
    proc = _child()
    time.sleep(PAUSE_MIN_S + 0.5)
    assert _pauses(proc) == []


def test_the_row_says_the_machine_stopped() -> None:
    assert compare_doc._pauses({"host_pauses": [[46.9, 18.4]]}).startswith(
        "THE MACHINE STOPPED 18.4 s at +46.9 s")
    assert compare_doc._pauses({"host_pauses": []}) == ""
    assert compare_doc._pauses({}) == ""  # results written before the field existed
