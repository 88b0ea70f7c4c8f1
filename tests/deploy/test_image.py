"""The OCI image scripts/image builds, built and run for real (buildah, no container engine).

The build is cached under ~/.cache/extractedprism/image, keyed on every input from this
tree (scripts/image, pyproject.toml, README.md, the package's sources): a second run of
the suite reuses it. The entrypoint runs with `buildah run --isolation chroot` as uid 65534,
with the chart's default environment, the chart's host directories and service-account CA
mounted where the pod has them, and /opt, /usr, /etc and /tmp mounted read-only (the pod's
readOnlyRootFilesystem): it must serve /healthz and /readyz, proxy a connection and exit 0
on SIGTERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from extractedprism.config.flags import parse_duration
from extractedprism.config.table import FLAG_BY_NAME
from tests.deploy.helpers import CONTAINERFILE, container, containerfile_stages, env_of, render
from tests.fakes.upstream import FakeUpstream
from tests.util import ROOT, free_ports, http_status, wait_until

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
BUILD_TIMEOUT = 900.0
pytestmark = [
    # The first test builds the image (unless cached): its fixture counts against its timeout.
    pytest.mark.timeout(BUILD_TIMEOUT + 180),
    pytest.mark.skipif(shutil.which("buildah") is None,
                       reason="buildah not installed (Debian: apt-get install -y buildah)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="buildah mount and chroot need root"),
]


def _inputs() -> list[Path]:
    files = [ROOT / "scripts" / "image", ROOT / "pyproject.toml", ROOT / "README.md"]
    files += sorted(p for p in (ROOT / "extractedprism").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
    files += [ROOT / f for f in ("setup.py", "setup.cfg", "MANIFEST.in") if (ROOT / f).exists()]
    return files


def _cache_key() -> str:
    digest = hashlib.sha256()
    for path in _inputs():
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


@pytest.fixture(scope="module")
def image_archive() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    archive = cache / "extractedprism" / "image" / f"{_cache_key()}.oci.tar"
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([str(ROOT / "scripts" / "image"), "--output", str(archive)],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        assert proc.returncode == 0, f"scripts/image failed:\n{proc.stdout}\n{proc.stderr}"
        for old in archive.parent.glob("*.oci.tar"):  # one cached build is enough
            if old != archive:
                old.unlink()
    return archive


class Buildah:
    def __init__(self, base: Path) -> None:
        self.cmd = ["buildah", "--root", str(base / "storage"), "--runroot", str(base / "run"),
                    "--storage-driver", "vfs"]

    def __call__(self, *args: str, timeout: float = 300.0) -> str:
        proc = subprocess.run([*self.cmd, *args], capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"buildah {args[0]} failed:\n{proc.stderr}"
        return proc.stdout.strip()


@pytest.fixture(scope="module")
def working(image_archive: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Buildah, str, Path]]:
    """A container from the archive, in private storage: (buildah, container, rootfs)."""
    base = tmp_path_factory.mktemp("buildah")
    b = Buildah(base)
    ctr = b("from", "--quiet", f"oci-archive:{image_archive}")
    try:
        yield b, ctr, Path(b("mount", ctr))
    finally:
        b("rm", ctr)
        shutil.rmtree(base, ignore_errors=True)


def _containerfile_final() -> list[str]:
    return containerfile_stages(CONTAINERFILE.read_text())[-1]


def _containerfile(name: str) -> list[str]:
    return [i[len(name) + 1:] for i in _containerfile_final() if i.upper().startswith(name + " ")]


# --- the image as built -------------------------------------------------------------------


def test_config_matches_the_containerfile(working) -> None:
    b, ctr, _ = working
    config = json.loads(b("inspect", "--type", "container", ctr))["OCIv1"]["config"]
    assert config["Entrypoint"] == json.loads(_containerfile("ENTRYPOINT")[0])
    assert config["User"] == _containerfile("USER")[0] == "65534:65534"
    import shlex

    want_env = dict(item.split("=", 1) for line in _containerfile("ENV")
                    for item in shlex.split(line))
    got_env = dict(e.split("=", 1) for e in config["Env"])
    assert got_env == want_env
    assert set(config["ExposedPorts"]) == {"7445/tcp", "7446/tcp"}
    assert config["Labels"]["org.opencontainers.image.version"] == __import__(
        "extractedprism").__version__


def test_no_shell_no_package_manager_root_owned(working) -> None:
    _, _, rootfs = working
    usr_bin = sorted(p.name for p in (rootfs / "usr" / "bin").iterdir())
    assert usr_bin == ["python3", "python3.11"]
    assert sorted(p.name for p in (rootfs / "usr" / "sbin").iterdir()) == []
    for name in ("sh", "bash", "dash", "busybox", "dpkg", "apt", "apt-get", "pip", "pip3"):
        assert not list(rootfs.glob(f"**/bin/{name}")), name
    assert not (rootfs / "var" / "lib" / "dpkg").exists()
    site = rootfs / "opt/venv/lib/python3.11/site-packages"
    assert not (site / "pip").exists() and not (site / "setuptools").exists()
    for path in rootfs.rglob("*"):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or path.parts[len(rootfs.parts)] in ("proc", "sys", "dev",
                                                                         "run"):
            continue
        assert st.st_uid == 0 and st.st_gid == 0, path
        if path != rootfs / "tmp":
            assert not st.st_mode & 0o022, f"{path} is writable by others"


def test_same_layout_as_the_containerfile(working) -> None:
    _, _, rootfs = working
    entrypoint = json.loads(_containerfile("ENTRYPOINT")[0])[0]
    assert (rootfs / entrypoint.lstrip("/")).is_file()
    assert (rootfs / entrypoint.lstrip("/")).read_text().startswith("#!/opt/venv/bin/python\n")
    # The venv's interpreter is Debian's, at the path the distroless runtime has it.
    python = rootfs / "opt/venv/bin/python"
    target = os.readlink(python)
    while not target.startswith("/"):
        target = os.readlink(python.parent / target)
    assert target == "/usr/bin/python3.11"
    assert (rootfs / "usr/bin/python3.11").is_file()
    assert (rootfs / "opt/venv/pyvenv.cfg").read_text().startswith("home = /usr/bin\n")
    pkg = rootfs / "opt/venv/lib/python3.11/site-packages/extractedprism"
    assert (pkg / "cli.py").is_file()
    assert list((pkg / "__pycache__").glob("cli.cpython-311.pyc"))
    for c_source in (ROOT / "extractedprism").glob("*.c"):  # the compiled extension ships
        assert list(pkg.glob(f"{c_source.stem}.cpython-311-*.so")), c_source.name


# --- the entrypoint, run -------------------------------------------------------------------


def _descendants(pid: int) -> list[tuple[int, str]]:
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")]
        ppid = int(stat_line[stat_line.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        names[int(entry.name)] = name
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, names[child]))
            todo.append(child)
    return out


@contextlib.contextmanager
def _read_only(rootfs: Path) -> Iterator[None]:
    """The pod's readOnlyRootFilesystem: the image's directories, bind-mounted read-only.
    (The root directory and /run stay writable for root only: buildah puts its mount points
    there; uid 65534 cannot write either.)"""
    done: list[Path] = []
    # The files buildah bind-mounts over, as a container runtime provides them.
    for name in ("hostname", "hosts", "resolv.conf"):
        (rootfs / "etc" / name).touch()
    try:
        for name in ("opt", "usr", "etc", "tmp"):
            target = rootfs / name
            subprocess.run(["mount", "--bind", str(target), str(target)], check=True, timeout=30)
            done.append(target)
            subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], check=True,
                           timeout=30)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", str(target)], check=True, timeout=30)


def _https_get_through(port: int, ca_file: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="kubernetes.default.svc") as tls:
        tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: kubernetes.default.svc\r\n"
                    b"Connection: close\r\n\r\n")
        head = tls.recv(64)
    return int(head.split()[1])


@pytest.mark.timeout(BUILD_TIMEOUT + 180)
def test_entrypoint_serves_proxies_and_stops_cleanly_on_a_read_only_root(working, tmp_path
                                                                        ) -> None:
    b, ctr, rootfs = working
    upstream = FakeUpstream(name="apiserver").start()
    # The pod's volumes: the service-account CA, and the two host directories the init
    # container hands to uid 65534.
    sa = tmp_path / "sa"
    sa.mkdir()
    upstream.ca.cert_pem.write_to_path(str(sa / "ca.crt"))
    handover, state, admin = tmp_path / "handover", tmp_path / "state", tmp_path / "admin"
    for d in (handover, state, admin):
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
    try:
        with _read_only(rootfs):
            for _attempt in range(3):  # a port taken between picking and binding: retry
                bind_port, health_port = free_ports(2)
                docs, _ = render({"endpoints": [upstream.address], "bindPort": bind_port,
                                  "healthPort": health_port})
                chart_env = env_of(container(docs))
                assert chart_env["EP_HEALTH_CHECK"] == "readyz"
                assert chart_env["EP_HEALTH_CHECK_CA_FILE"] == f"{SA_DIR}/ca.crt"
                args = [*b.cmd, "run", "--isolation", "chroot", "--user", "65534:65534",
                        "-v", f"{sa}:{SA_DIR}:ro",
                        "-v", f"{handover}:{Path(chart_env['EP_HANDOVER_SOCKET']).parent}",
                        "-v", f"{state}:{Path(chart_env['EP_STATE_FILE']).parent}",
                        "-v", f"{admin}:{Path(chart_env['EP_ADMIN_SOCKET']).parent}"]
                for name, value in sorted(chart_env.items()):
                    args += ["-e", f"{name}={value}"]
                proc = subprocess.Popen([*args, ctr, "/opt/venv/bin/extractedprism"],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                try:
                    wait_until(lambda p=proc, hp=health_port: p.poll() is not None
                               or http_status(hp, "/healthz") == 200, timeout=60,
                               message="/healthz 200 or exit")
                    if proc.poll() == 1:
                        proc.communicate(timeout=30)
                        continue
                    wait_until(lambda p=proc, hp=health_port: p.poll() is not None
                               or http_status(hp, "/readyz") == 200, timeout=60,
                               message="/readyz 200: the readyz check passes with the SA CA")
                    # What NOTES.txt tells operators to run with `kubectl exec`: a second
                    # process in the same container, with the pod's environment.
                    for tool in (["status"], ["admin", "list"]):
                        out = subprocess.run([*args, ctr, "/opt/venv/bin/extractedprism",
                                              *tool], capture_output=True, text=True,
                                             timeout=60)
                        assert out.returncode == 0, (tool, out.stdout, out.stderr)
                        assert upstream.address in out.stdout, (tool, out.stdout)
                    _run_checks(proc, bind_port, health_port, sa / "ca.crt", handover,
                                parse_duration(chart_env["EP_SHUTDOWN_DRAIN_TIMEOUT"]))
                finally:
                    _stop(proc)
                break
    finally:
        upstream.stop()
    assert not any((rootfs / "tmp").iterdir())


def _run_checks(proc: subprocess.Popen[str], bind_port: int, health_port: int,
                ca_file: Path, handover: Path, drain: float) -> None:
    assert proc.poll() is None, f"exited early:\n{proc.communicate(timeout=30)[0]}"
    wait_until(lambda: http_status(health_port, "/readyz") == 200, timeout=60,
               message="/readyz 200: the readyz check passes with the SA CA")
    assert _https_get_through(bind_port, ca_file) == 200, "a proxied TLS request"
    if "handover-socket" in FLAG_BY_NAME:
        sock = handover / "handover.sock"
        wait_until(sock.exists, timeout=30, message="the handover socket on the host dir")
        assert stat.S_ISSOCK(sock.stat().st_mode)
    (pid, _), = [(p, n) for p, n in _descendants(proc.pid) if n == "extractedprism"]
    os.kill(pid, signal.SIGTERM)  # buildah does not forward signals
    # The chart's shutdown drain holds it for the window; the shutdown takes 10 s more.
    out, _ = proc.communicate(timeout=drain + 30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    if (ROOT / "extractedprism" / "datapath" / "_relay.c").exists():
        # --relay auto (the chart's default) picked the compiled extension the image carries.
        assert "relay=native" in out, out


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        for pid, name in _descendants(proc.pid):
            if name == "extractedprism":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.timeout(BUILD_TIMEOUT + 180)
def test_the_charts_init_container_hands_the_host_dirs_over_with_only_chown(working, tmp_path
                                                                           ) -> None:
    b, ctr, rootfs = working
    docs, _ = render({"endpoints": ["127.0.0.1:6443"]})
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    mounts = [m["mountPath"] for m in init["volumeMounts"]]
    volumes = []
    for i, path in enumerate(mounts):
        host = tmp_path / f"host-dir-{i}"
        host.mkdir(mode=0o755)  # as the kubelet creates a DirectoryOrCreate hostPath
        volumes += ["-v", f"{host}:{path}"]
    # Every capability but CAP_CHOWN dropped, one by one: this buildah's `--cap-drop ALL`
    # also drops what --cap-add adds.
    others = ["CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
              "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT",
              "CAP_SETFCAP", "CAP_NET_RAW", "CAP_AUDIT_WRITE", "CAP_MKNOD"]
    with _read_only(rootfs):
        # The first pod on the node, then the surge pod of a rollout (directories handed over).
        for _pod in ("first", "surge"):
            proc = subprocess.run([*b.cmd, "run", "--isolation", "chroot", "--user", "0:0",
                                   "--cap-drop", ",".join(others), *volumes, ctr,
                                   "/opt/venv/bin/python", "-c",
                                   "print(open('/proc/self/status').read()"
                                   ".split('CapEff:')[1].split()[0])"],
                                  capture_output=True, text=True, timeout=60)
            assert proc.stdout.strip() == "0000000000000001", proc.stdout  # CAP_CHOWN alone
            proc = subprocess.run([*b.cmd, "run", "--isolation", "chroot", "--user", "0:0",
                                   "--cap-drop", ",".join(others), *volumes, ctr,
                                   *init["command"]], capture_output=True, text=True,
                                  timeout=60)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            for i in range(len(mounts)):
                st = (tmp_path / f"host-dir-{i}").stat()
                assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (65534, 65534, 0o700)
