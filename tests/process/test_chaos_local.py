"""The short local chaos run (scripts/chaos-local --short) passes: every PASS/FAIL line of
issue 7's criteria passed, so the script exits 0. It runs real upstream processes, a fake
API server and the proxy on loopback (plus a network namespace when the machine allows
it); its report is printed on failure."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_short_chaos_run_passes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    res = subprocess.run([str(ROOT / "scripts" / "chaos-local"), "--short"], cwd=ROOT,
                         capture_output=True, text=True, timeout=230, env=env)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert "RESULT: PASS" in res.stdout, report
    assert "FAIL " not in res.stdout, report
