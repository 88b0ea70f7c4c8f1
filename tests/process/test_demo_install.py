"""scripts/demo's first run, as a newcomer sees it: a fresh copy of the repository, a new
.venv, the install of only what the demo runs, then the demo's own --help. The screen holds
the demo's own lines and nothing that reads as a failure (issue 38: pip's resolver printed
three ERROR lines about the Kubernetes client the demo deliberately leaves out).

Installs from the package index like the README's first command does (pip's cache makes a
second run quick).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.util import ROOT

SKIP = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", ".venv", "build")


@pytest.mark.timeout(400)
def test_first_run_prints_no_error(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, repo / name)
    for tree in ("extractedprism", "scripts/epscripts", "tests/fakes"):
        shutil.copytree(ROOT / tree, repo / tree, ignore=SKIP)
    shutil.copy2(ROOT / "scripts" / "demo", repo / "scripts" / "demo")
    (repo / "tests" / "__init__.py").touch()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EP_", "VIRTUAL_ENV", "PYTHON", "PIP_"))}
    done = subprocess.run([str(repo / "scripts" / "demo"), "--help"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=380)
    screen = done.stdout + done.stderr
    assert done.returncode == 0, screen
    before_help = screen.split("usage: scripts/demo")[0].splitlines()
    assert before_help, screen
    assert all(line.startswith("demo: ") for line in before_help), (
        "the first screen has lines that are not the demo's own:\n" + screen)
    assert "demo: installed in" in screen
    assert not [line for line in screen.splitlines() if "ERROR" in line or "WARNING" in line]
