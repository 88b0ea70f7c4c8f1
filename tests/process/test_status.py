"""`extractedprism status` against a running proxy (a real subprocess): the table,
--json, --watch, and each exit status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fakes.upstream import IdentityServer
from tests.process.proxyproc import ProxyProcess, start_proxy
from tests.util import PYTHON, ROOT, http, reap, run_cli, wait_until


@pytest.fixture
def up():
    server = IdentityServer(name="up").start()
    yield server
    server.stop()


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("status", *args, env=env)


def upstream_doc(p: ProxyProcess) -> dict:
    return json.loads(http(p.health_address, "/upstreams")[2])


def table(stdout: str) -> tuple[list[str], list[list[str]], str]:
    lines = stdout.rstrip("\n").splitlines()
    header, *rows, summary = lines
    return header.split(), [r.split() for r in rows], summary


def test_table_one_line_per_upstream_then_a_summary(up, tmp_path: Path):
    dead = dead_address()
    p = start_proxy(tmp_path, "--endpoints", f"{up.address},{dead}",
                    "--enable-discovery=false")
    try:
        wait_until(lambda: not {u["address"]: u for u in upstream_doc(p)["upstreams"]}[dead][
            "healthy"], 10, message="the dead upstream marked down")
        with socket.create_connection(("127.0.0.1", p.bind), timeout=5) as held:
            assert held.recv(3) == b"up\n"
            wait_until(lambda: upstream_doc(p)["connections_active"] == 1, 5)
            res = status("--health-port", str(p.health))
    finally:
        p.stop()
    assert res.returncode == 0, res.stderr
    header, rows, summary = table(res.stdout)
    assert header[:3] == ["ADDRESS", "SOURCE", "STATE"] and "CONNS" in header
    by_addr = {r[0]: r for r in rows}
    assert set(by_addr) == {up.address, dead}
    assert by_addr[up.address][2] == "healthy" and "1/1" in by_addr[up.address]
    assert by_addr[dead][2] == "unhealthy"
    # The last error, with who saw it now that /upstreams says (a check or a client dial).
    assert res.stdout.splitlines()[2 if rows[1][0] == dead else 1].endswith(
        ("connection refused (probe)", "connection refused (dial)"))
    assert summary.startswith("ready: 1/2 upstreams healthy")
    assert "1 connections" in summary


def test_json_prints_the_raw_document(up, tmp_path: Path):
    p = start_proxy(tmp_path, "--endpoints", up.address, "--enable-discovery=false")
    try:
        res = status("--json", env={"EP_HEALTH_PORT": str(p.health)})
        doc = upstream_doc(p)
    finally:
        p.stop()
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert [u["address"] for u in got["upstreams"]] == [u["address"] for u in doc["upstreams"]]
    assert set(got) == set(doc)


def test_answering_but_not_ready_exits_1(tmp_path: Path):
    dead = dead_address()
    p = start_proxy(tmp_path, "--endpoints", dead, "--enable-discovery=false")
    try:
        wait_until(lambda: http(p.health_address, "/readyz")[0] == 503, 10)
        res = status("--health-port", str(p.health))
        as_json = status("--json", "--health-port", str(p.health))
    finally:
        p.stop()
    assert res.returncode == 1, res.stdout + res.stderr
    assert table(res.stdout)[2].startswith("NOT READY: 0/1 upstreams healthy")
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["upstreams"]


def test_unreachable_exits_2_saying_where_it_looked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refuses
        res = status("--health-port", str(port))
    assert res.returncode == 2
    assert f"cannot reach the health server at http://127.0.0.1:{port}" in res.stderr
    assert res.stdout == ""


def test_bad_arguments_exit_2_naming_them():
    res = status("--health-port", "http")
    assert res.returncode == 2 and "--health-port (http)" in res.stderr
    res = status("--watch", "soon")
    assert res.returncode == 2 and "--watch (soon)" in res.stderr


def test_health_address_falls_back_to_bind_address_as_the_server_does(up, tmp_path: Path):
    p = start_proxy(tmp_path, "--endpoints", up.address, "--enable-discovery=false",
                    "--bind-address", "127.0.0.2", health_host="127.0.0.2")
    try:
        assert status("--health-port", str(p.health)).returncode == 2  # not on 127.0.0.1
        res = status(env={"EP_BIND_ADDRESS": "127.0.0.2", "EP_HEALTH_PORT": str(p.health)})
        blank = status("--bind-address", "127.0.0.2", "--health-port", str(p.health),
                       env={"EP_HEALTH_BIND_ADDRESS": ""})  # empty means unset
        explicit = status("--health-bind-address", "127.0.0.2", "--health-port",
                          str(p.health), env={"EP_BIND_ADDRESS": "127.0.0.9"})
    finally:
        p.stop()
    assert res.returncode == 0, res.stderr
    assert blank.returncode == 0, blank.stderr
    assert explicit.returncode == 0, explicit.stderr


def test_needs_no_endpoints_and_ignores_them(up, tmp_path: Path):
    p = start_proxy(tmp_path, "--endpoints", up.address, "--enable-discovery=false")
    try:
        res = status(env={"EP_HEALTH_PORT": str(p.health), "EP_ENDPOINTS": "garbage"})
    finally:
        p.stop()
    assert res.returncode == 0, res.stderr


def _sigint(disposition: signal.Handlers):
    def preexec() -> None:
        signal.signal(signal.SIGINT, disposition)
    return preexec


@pytest.mark.timeout(60)
# Started from a terminal (SIGINT at its default) and from a script's background job or
# nohup (SIGINT inherited ignored, which Python would leave ignored): Ctrl-C stops both.
@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_watch_redraws_until_interrupted(up, tmp_path: Path, inherited: signal.Handlers):
    p = start_proxy(tmp_path, "--endpoints", up.address, "--enable-discovery=false")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    # Bare seconds, as an operator types them: the header says the unit (issue 30).
    proc = subprocess.Popen([PYTHON, "-m", "extractedprism", "status", "--watch", "0.2",
                             "--health-port", str(p.health)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env, preexec_fn=_sigint(inherited))
    frames: list[str] = []
    headers: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "(every " in line:
                headers.append(line)
            if line.startswith("ready:"):
                frames.append(line)
                if len(frames) == 3:
                    break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        reap(proc)
        p.stop()
    assert len(frames) == 3
    assert all("(every 200ms; Ctrl-C stops)" in h for h in headers) and headers, headers
