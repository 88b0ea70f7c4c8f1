"""A Python without ``_ctypes`` (built without libffi) still runs the proxy's command
line (issue 29, item 10): heap.py, the only user of ctypes, does nothing there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from extractedprism import __version__

# Makes ``import ctypes`` (and ``_ctypes``) fail as on such a Python.
SITECUSTOMIZE = '''
import sys


class _NoCtypes:
    def find_spec(self, name, path=None, target=None):
        if name in ("ctypes", "_ctypes") or name.startswith("ctypes."):
            raise ImportError(f"No module named {name!r} (test: built without libffi)")
        return None


sys.meta_path.insert(0, _NoCtypes())
for _name in [n for n in sys.modules if n == "ctypes" or n.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[_name]
'''


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=env, timeout=30)


@pytest.mark.timeout(60)
def test_the_hook_really_hides_ctypes(tmp_path: Path) -> None:
    res = _run(tmp_path, "-c", "import ctypes")
    assert res.returncode != 0 and "built without libffi" in res.stderr


@pytest.mark.timeout(60)
def test_version_and_heap_without_ctypes(tmp_path: Path) -> None:
    res = _run(tmp_path, "-m", "extractedprism", "--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"extractedprism {__version__}"
    res = _run(tmp_path, "-c", "from extractedprism import heap; "
               "print(heap.limit_arenas(), heap.trim())")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
