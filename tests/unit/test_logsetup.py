"""Logging set-up: zap-style thresholds, the writer thread that never lets a caller
block on stderr, and the capture of everything else written to stderr."""

from __future__ import annotations

import io
import logging
import subprocess
import textwrap
import threading

import pytest

from extractedprism.logs import setup as logsetup
from extractedprism.logs.setup import LEVELS, setup_logging, shutdown_logging
from tests.logcheck import parse, parse_logfmt
from tests.util import PYTHON, ROOT, wait_until


@pytest.fixture(autouse=True)
def restore_root():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    noisy = {n: logging.getLogger(n).level for n in ("urllib3", "kubernetes")}
    yield
    shutdown_logging()
    root.handlers[:], root.level = handlers, level
    for name, lvl in noisy.items():
        logging.getLogger(name).setLevel(lvl)


@pytest.mark.parametrize("level,shown,hidden", [
    ("debug", "debug", None),
    ("info", "info", "debug"),
    ("warn", "warning", "info"),
    ("error", "error", "warning"),
    ("dpanic", "critical", "error"),
    ("panic", "critical", "error"),
    ("fatal", None, "critical"),
])
def test_threshold(level, shown, hidden):
    out = io.StringIO()
    setup_logging(level, stream=out)
    log = logging.getLogger("extractedprism.test")
    if shown:
        getattr(log, shown)("shown upstream=%s", "10.0.0.1:6443")
    if hidden:
        getattr(log, hidden)("hidden")
    records = parse_logfmt(out.getvalue())
    assert [(r["msg"], r.get("upstream")) for r in records] == (
        [("shown", "10.0.0.1:6443")] if shown else [])
    if shown:
        assert records[0]["thread"] == "MainThread"


def test_every_spec_level_is_known():
    assert list(LEVELS) == ["debug", "info", "warn", "error", "dpanic", "panic", "fatal"]
    assert LEVELS["debug"] < LEVELS["info"] < LEVELS["warn"] < LEVELS["error"] \
        < LEVELS["dpanic"] < LEVELS["panic"] < LEVELS["fatal"]


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_background_writer_writes_every_line_in_order(fmt):
    out = io.StringIO()
    setup_logging("info", stream=out, fmt=fmt, background=True)
    log = logging.getLogger("extractedprism.test")
    for i in range(50):
        log.info("line n=%d", i)
    shutdown_logging()
    records = parse(out.getvalue(), fmt)
    assert [str(r["n"]) for r in records] == [str(i) for i in range(50)]


class StalledStream(io.StringIO):
    """A stderr whose reader stopped: every write blocks until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.blocked = threading.Event()

    def write(self, text: str) -> int:
        self.blocked.set()
        self.release.wait(30)
        return super().write(text)


def test_a_stalled_stream_never_blocks_the_caller_and_drops_are_counted(monkeypatch):
    monkeypatch.setattr(logsetup, "QUEUE_LINES", 100)
    stream = StalledStream()
    setup_logging("info", stream=stream, background=True)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logsetup.QueueingHandler)
    handler.maxsize = 100
    log = logging.getLogger("extractedprism.test")
    log.info("first")
    wait_until(stream.blocked.is_set, 10, message="the writer blocked on the stream")
    done = threading.Event()
    total = 2000

    def flood() -> None:
        for i in range(total):
            log.info("flood n=%d", i)
        done.set()

    t = threading.Thread(target=flood, name="test-log-flood")
    t.start()
    # With a handler that writes in the caller's thread this never finishes.
    wait_until(done.is_set, 30, message="2000 log calls while stderr is stalled")
    t.join()
    dropped = logsetup.dropped_total()
    assert dropped >= total - 100 - 2
    stream.release.set()
    shutdown_logging()
    records = parse_logfmt(stream.getvalue())
    floods = [r for r in records if r["msg"] == "flood"]
    [report] = [r for r in records if r["msg"].startswith("log lines dropped")]
    assert int(report["count"]) == dropped
    assert len(floods) + dropped == total


CAPTURE_SCRIPT = textwrap.dedent("""
    import logging, sys, threading, warnings
    from extractedprism.logs.setup import setup_logging
    setup_logging("debug", fmt=sys.argv[1], background=True, capture=True)
    warnings.warn("a library warning")
    print("a stray line\\nand another", file=sys.stderr)
    def crash():
        raise RuntimeError("thread boom")
    t = threading.Thread(target=crash, name="crasher")
    t.start(); t.join()
    raise ValueError("main boom")
""")


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_everything_on_stderr_after_setup_is_a_record(fmt):
    res = subprocess.run([PYTHON, "-c", CAPTURE_SCRIPT, fmt], capture_output=True, text=True,
                         cwd=ROOT, timeout=30)
    assert res.returncode == 1
    records = parse(res.stderr, fmt)
    by_msg = {r["msg"]: r for r in records}
    assert any("a library warning" in r["msg"] for r in records)
    assert by_msg["a stray line"]["logger"] == "stderr"
    assert "and another" in by_msg
    crashed = by_msg["thread crashed"]
    assert crashed["thread"] == "crasher" and "RuntimeError: thread boom" in crashed[
        "stacktrace"]
    fatal = by_msg["uncaught exception"]
    assert fatal["level"] == "fatal" and "ValueError: main boom" in fatal["stacktrace"]


def test_a_stream_on_a_descriptor_above_1024_is_written_and_times_out_when_full():
    """select() refuses a descriptor >= 1024; a stderr there must still be written to,
    and a full one must still give up after the timeout instead of raising."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2048")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    r, w = os.pipe()
    high_r, high_w = os.dup2(r, 1500), os.dup2(w, 1501)
    os.close(r)
    os.close(w)
    try:
        with open(high_w, "w", closefd=False) as stream:
            assert logsetup.write_out(stream, "hello\n", 1.0)
            assert os.read(high_r, 100) == b"hello\n"
            os.set_blocking(high_w, False)
            while True:  # fill the pipe
                try:
                    os.write(high_w, b"x" * 65536)
                except BlockingIOError:
                    break
            assert not logsetup.write_out(stream, "dropped\n", 0.05)
    finally:
        os.close(high_r)
        os.close(high_w)
