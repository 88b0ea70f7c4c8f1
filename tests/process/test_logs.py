"""The proxy's stderr as a log collector sees it: every line one logfmt (or JSON) record,
through drains, failures, discovery and a thread dump; rate-limited outage lines; and a
stalled stderr that slows nothing down."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.fake_apiserver import FakeApiServer, make_slice
from tests.fakes.upstream import IdentityServer
from tests.logcheck import parse
from tests.process.proxyproc import ProxyProcess, health_ok, start_proxy
from tests.util import PYTHON, ROOT, dropped, http, reap, start_on_free_ports, wait_until


def upstreams(p: ProxyProcess) -> dict[str, dict[str, Any]]:
    status, _, body = http(p.health_address, "/upstreams")
    assert status == 200
    return {u["address"]: u for u in json.loads(body)["upstreams"]}


def connect(p: ProxyProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.bind), timeout=5)
    return s


def records(p: ProxyProcess, fmt: str) -> list[dict[str, Any]]:
    return parse(p.stderr(), fmt)


def has(recs: list[dict[str, Any]], msg: str) -> list[dict[str, Any]]:
    return [r for r in recs if r["msg"] == msg]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_every_line_parses_through_drains_failures_and_discovery(
        fmt: str, api: FakeApiServer, tmp_path: Path) -> None:
    a = IdentityServer(name="a").start()
    b = IdentityServer(name="b").start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.set_slice(make_slice("kubernetes", ["127.0.0.1"], port=b.port))
    held: list[socket.socket] = []
    try:
        p = start_proxy(tmp_path, "--endpoints", a.address, "--enable-discovery=true",
                        "--kubeconfig", str(kubeconfig), "--drain-timeout", "0.5s",
                        "--log-level", "debug", "--log-format", fmt)
    except BaseException:
        a.stop()
        b.stop()
        raise
    try:
        wait_until(lambda: b.address in upstreams(p), 20, message="b discovered")
        # Connections to both (random selection: enough tries to land on b).
        for _ in range(40):
            s = connect(p)
            held.append(s)
            assert s.recv(2) in (b"a\n", b"b\n")
            if b.accepted >= 3:
                break
        # Removed from discovery: b drains, its connections are closed after 0.5 s.
        api.delete_slice("kubernetes")
        wait_until(lambda: b.address not in upstreams(p), 20, message="b drained away")
        # a fails: probes and client dials fail, clients are turned away.
        a.stop()
        wait_until(lambda: not upstreams(p)[a.address]["healthy"], 20, message="a down")
        for _ in range(5):
            with connect(p) as s:
                assert dropped(s)
        p.proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: has(records(p, fmt), "thread dump"), 10, message="thread dump")
        assert p.stop() == 0
    finally:
        for s in held:
            s.close()
        p.stop()
        a.stop()
        b.stop()
    recs = records(p, fmt)  # every line parses, or this fails naming the line
    msgs = {r["msg"] for r in recs}
    for event in ("upstream added", "upstream draining", "upstream healthy->unhealthy",
                  "connection opened", "connection closed", "extractedprism stopped"):
        assert event in msgs, f"{event!r} not logged; got {sorted(msgs)}"
    assert any(m.startswith("kubernetes endpoints changed") or m == "endpoints updated"
               for m in msgs)
    opened = has(recs, "connection opened")
    assert all(r["thread"] == f"pipe-{r['client']}->{r['upstream']}" for r in opened)
    closed = has(recs, "connection closed")
    assert {r["closed_by"] for r in closed} & {"proxy", "client", "upstream"}
    assert all({"bytes_up", "bytes_down", "duration_seconds", "reason"} <= set(r)
               for r in closed)
    [dump] = has(recs, "thread dump")
    # The dump names the pipe threads by what they do. Whether two of them share a stack
    # here depends on timing (threads start on demand, a warm one sleeps elsewhere than a
    # parked one): the grouping itself is tests/unit/test_threaddump.py's.
    assert re.search(r"^--- \d+ threads?: pipe-", dump["dump"], re.M), dump["dump"]
    assert int(dump["threads"]) >= int(dump["stacks"]) > 0


@pytest.mark.timeout(60)
def test_an_outage_logs_the_first_failure_then_counted_summaries(tmp_path: Path) -> None:
    # Nothing listens on the endpoint's port: every client dial fails.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    p = start_proxy(tmp_path, "--endpoints", dead, "--enable-discovery=false",
                    "--health-interval", "30s", "--health-timeout", "1s")
    clients = 20
    try:
        for _ in range(clients):
            with connect(p) as s:
                assert dropped(s)

        def turned_away() -> int:
            recs = records(p, "logfmt")
            return sum(int(r.get("count", 1)) for r in recs
                       if r["msg"].startswith("no upstream available"))

        wait_until(lambda: turned_away() == clients, 10,
                   message="first line + summaries count every client")
    finally:
        p.stop()
    recs = records(p, "logfmt")
    away = [r for r in recs if r["msg"].startswith("no upstream available")]
    # Today 20 clients made 20 such lines (and 60 more about dials).
    assert away[0]["msg"] == "no upstream available; closing client" and "count" not in away[0]
    assert 2 <= len(away) <= 5
    # A summary counts at least two; a single one more is the plain line again.
    assert all((r["msg"] == "no upstream available; closing client (repeated)"
                and int(r["count"]) >= 2) or (r["msg"] == away[0]["msg"] and "count" not in r)
               for r in away[1:])
    dials = [r for r in recs if r["msg"].startswith("dial failed")]
    assert len(dials) <= 5
    assert sum(int(r.get("count", 1)) for r in dials) >= clients


def _start_with_stalled_stderr() -> tuple[IdentityServer, int, subprocess.Popen[Any],
                                             int, int]:
    """An upstream and a debug-level proxy whose stderr is a 4 KiB pipe nobody reads
    (full after a dozen lines): (upstream, read end, process, bind port, health port)."""
    up = IdentityServer(name="up").start()
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}

    def start(ports: list[int]) -> subprocess.Popen[Any]:
        return subprocess.Popen(
            [PYTHON, "-m", "extractedprism", "--endpoints", up.address,
             "--enable-discovery=false", "--bind-port", str(ports[0]),
             "--health-port", str(ports[1]), "--log-level", "debug",
             "--health-interval", "2s", "--health-timeout", "1s"],
            env=env, cwd=ROOT, stderr=w, stdout=subprocess.DEVNULL)

    proc, (bind, health) = start_on_free_ports(start, lambda ps: health_ok(ps[1]))
    os.close(w)
    return up, r, proc, bind, health


@pytest.mark.timeout(90)
def test_a_stalled_stderr_blocks_no_connection(tmp_path: Path) -> None:
    up, r, proc, bind, health = _start_with_stalled_stderr()
    out: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(r, out), name="test-stderr-drain")
    try:
        # The pipe is full long before this ends; nobody reads it until after.
        for i in range(300):
            with socket.create_connection(("127.0.0.1", bind), timeout=5) as s:
                assert s.recv(3) == b"up\n", f"connection {i}"
        assert http(("127.0.0.1", health), "/healthz", timeout=5)[0] == 200
        reader.start()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        reap(proc)
        if not reader.is_alive() and not out:
            reader.start()
        reader.join(10)
        os.close(r)
        up.stop()
    recs = parse(b"".join(out).decode(), "logfmt")
    # 600 lines fit the queue: none was lost, they waited for the reader (drops past
    # the queue's bound are tested in tests/unit/test_logsetup.py).
    assert len([r for r in recs if r["msg"] == "connection opened"]) == 300
    assert recs[-1]["msg"] == "extractedprism stopped"


def _read_all(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        into.append(chunk)


@pytest.mark.timeout(60)
def test_exit_is_not_held_up_by_a_stalled_stderr(tmp_path: Path) -> None:
    up, r, proc, bind, _ = _start_with_stalled_stderr()
    try:
        for _ in range(50):  # far more than the pipe holds
            with socket.create_connection(("127.0.0.1", bind), timeout=5) as s:
                assert s.recv(3) == b"up\n"
        # Nobody reads stderr, ever: the process still exits, cleanly, within the
        # spec's shutdown bound (the writer waits at most 1 s for the queue to drain,
        # and lines after that are written only when the pipe has room).
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 6
    finally:
        reap(proc)
        os.close(r)
        up.stop()
