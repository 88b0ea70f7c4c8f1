"""The native relay's build: warning-free C, and the fallback when it cannot load."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from extractedprism.datapath import native
from extractedprism.datapath.relay import RelayUnavailable, resolve
from tests.util import PYTHON, ROOT, free_ports

SOURCE = ROOT / "extractedprism" / "datapath" / "_relay.c"


def test_extension_compiles_without_warnings(tmp_path: Path) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    res = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
         f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o",
         str(tmp_path / "_relay.so")],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_installed_package_carries_the_native_relay() -> None:
    # `pip install .` built it here (a compiler is present): auto means native.
    assert native.ERROR == ""
    assert resolve("auto").name == "native"
    assert resolve("native").name == "native"
    assert resolve("python").name == "python"


def test_without_the_extension_auto_falls_back_and_native_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(native, "EXTENSION", None)
    monkeypatch.setattr(native, "ERROR", "No module named 'extractedprism.datapath._relay'")
    assert resolve("auto").name == "python"
    with pytest.raises(RelayUnavailable, match="cannot be loaded: No module named"):
        resolve("native")


def _copy_without_extension(tmp_path: Path) -> Path:
    dst = tmp_path / "extractedprism"
    dst.mkdir()
    shutil.rmtree(dst)
    shutil.copytree(ROOT / "extractedprism", dst,
                    ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    # As if built without a compiler: the import fails. (Leaving the module out is not
    # enough here: the editable install's finder would still find the built one.)
    (dst / "datapath" / "_relay.py").write_text(
        'raise ImportError("built without a C compiler")\n')
    return tmp_path


def _run_copy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    root = _copy_without_extension(tmp_path)
    return subprocess.run([PYTHON, "-m", "extractedprism", *args], capture_output=True,
                          text=True, timeout=30, cwd=root, env={"PYTHONPATH": str(root)})


def test_relay_native_without_a_loadable_extension_exits_2_saying_why(tmp_path: Path) -> None:
    bind, health = free_ports(2)
    res = _run_copy(tmp_path, "--endpoints", "127.0.0.1:1", "--enable-discovery=false",
                    "--bind-port", str(bind), "--health-port", str(health), "--relay", "native")
    assert res.returncode == 2, res.stderr
    assert "--relay (native)" in res.stderr
    assert "cannot be loaded: built without a C compiler" in res.stderr
    assert "Traceback" not in res.stderr


def test_relay_auto_without_the_extension_starts_with_the_python_relay(tmp_path: Path
                                                                       ) -> None:
    bind, health = free_ports(2)
    root = _copy_without_extension(tmp_path)
    proc = subprocess.Popen(
        [PYTHON, "-m", "extractedprism", "--endpoints", "127.0.0.1:1",
         "--enable-discovery=false", "--bind-port", str(bind), "--health-port", str(health)],
        cwd=root, env={"PYTHONPATH": str(root)}, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the start line says which relay runs
            if "extractedprism started" in line or "cannot start" in line:
                break
        assert "relay=python" in line, line
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_bad_relay_value_exits_2() -> None:
    from tests.util import run_cli

    res = run_cli("--endpoints", "127.0.0.1:1", "--relay", "fast")
    assert res.returncode == 2
    assert "--relay (fast) is invalid: must be one of auto, native, python" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cc", ["/bin/false", None])
def test_wheel_builds_with_and_without_a_working_compiler(tmp_path: Path, cc: str | None
                                                          ) -> None:
    """`pip install .` must not fail where the extension cannot be compiled (it is
    optional), and must carry it where it can."""
    import os
    import zipfile

    env = dict(os.environ)
    if cc is not None:
        env["CC"] = cc
    elif shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    # A clean copy of the sources: the repo's build/ and in-place module must not count.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "extractedprism", src / "extractedprism",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    res = subprocess.run([PYTHON, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", str(src), "-w", str(tmp_path)],
                         capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    has_ext = any(n.startswith("extractedprism/datapath/_relay") and n.endswith(".so")
                  for n in names)
    assert has_ext == (cc is None), names
