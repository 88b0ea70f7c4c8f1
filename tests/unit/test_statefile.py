"""State file format, atomic write and the reader's verdicts (real files in tmp_path)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from pathlib import Path

import pytest

from extractedprism.config.endpoints import Endpoint
from extractedprism.discovery import statefile
from tests.util import wait_until

EPS = [Endpoint("10.0.0.1", 6443), Endpoint("cp2.example.com", 6443), Endpoint("fd00::1", 6443)]
WHEN = datetime.datetime(2026, 12, 1, 20, 0, 5, tzinfo=datetime.UTC)


def test_round_trip_and_format(tmp_path: Path):
    path = tmp_path / "state.json"
    statefile.write(str(path), EPS, now=lambda: WHEN)
    doc = json.loads(path.read_text())
    assert doc == {"version": 1, "endpoints": ["10.0.0.1:6443", "cp2.example.com:6443",
                                               "[fd00::1]:6443"],
                   "written": "2026-12-01T20:00:05Z"}
    assert statefile.read(str(path)) == EPS
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left


def test_write_replaces_by_rename(tmp_path: Path):
    # Atomic: the new content arrives as a new inode renamed over the old one, so a
    # reader holding the old file never sees half of the new one.
    path = tmp_path / "state.json"
    statefile.write(str(path), EPS[:1])
    with open(path, "rb") as old:
        inode = os.fstat(old.fileno()).st_ino
        statefile.write(str(path), EPS)
        assert statefile.decode(old.read()) == EPS[:1]
    assert path.stat().st_ino != inode
    assert statefile.read(str(path)) == EPS


def test_missing_file_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    assert statefile.read(str(tmp_path / "none.json")) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("content,reason", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"version": 2, "endpoints": ["10.0.0.1:6443"], "written": "2026-01-01T00:00:00Z"}',
     "version is 2"),
    (b'{"version": 1, "endpoints": [], "written": "2026-01-01T00:00:00Z"}',
     "'endpoints' is not a non-empty list"),
    (b'{"version": 1, "endpoints": ["10.0.0.1"], "written": "2026-01-01T00:00:00Z"}',
     "endpoint '10.0.0.1'"),
    (b'{"version": 1, "endpoints": ["10.0.0.1:6443"], "written": "yesterday"}',
     "not an RFC 3339 time"),
    (b'{"apiVersion": "v1", "kind": "ConfigMap"}', "version is None"),
    (b"\xff\xfe", "not JSON"),
])
def test_corrupt_or_foreign_is_one_warning_naming_path_and_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    caplog.set_level(logging.INFO)
    assert statefile.read(str(path)) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and reason in warnings[0], warnings[0]


def test_a_directory_or_unreadable_file_is_ignored(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    assert statefile.read(str(tmp_path)) is None
    unreadable = tmp_path / "state.json"
    statefile.write(str(unreadable), EPS)
    unreadable.chmod(0)
    try:
        result = statefile.read(str(unreadable))
    finally:
        unreadable.chmod(0o644)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "is a directory" in warnings[0] and str(tmp_path) in warnings[0]
    if os.geteuid() != 0:  # root reads a mode-0 file
        assert result is None and "unreadable" in warnings[1]


def test_writer_writes_changes_only_off_the_caller_thread(tmp_path: Path):
    path = tmp_path / "state.json"
    stop = threading.Event()
    w = statefile.StateWriter(str(path), stop)
    w.start(current=EPS[:1])
    try:
        w.save(EPS[:1])  # what the file held at start: not written again
        w.save([])  # an empty list is never written
        w.save(EPS)
        wait_until(lambda: w.writes == 1, 5, message="one write")
        assert statefile.read(str(path)) == EPS
        w.save(EPS)  # unchanged
        w.save(EPS[1:])
        wait_until(lambda: w.writes == 2, 5, message="second write")
        assert statefile.read(str(path)) == EPS[1:]
    finally:
        stop.set()
        assert w.join(5)


def test_writer_failure_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "missing-dir" / "state.json"
    stop = threading.Event()
    w = statefile.StateWriter(str(path), stop)
    caplog.set_level(logging.WARNING)
    w.start()
    try:
        w.save(EPS)
        wait_until(lambda: any("state file not written" in r.getMessage()
                               for r in caplog.records), 5, message="a warning")
        w.save(EPS[:1])
        w.save(EPS[1:])
    finally:
        stop.set()
        assert w.join(5)
    assert sum("state file not written" in r.getMessage() for r in caplog.records) == 1


# -- issue 22 item 9: the temporary file in a directory another user may write ----------


def _plant(at: Path, target: Path) -> None:
    at.symlink_to(target)


def test_a_symlink_at_the_old_predictable_name_is_not_followed(tmp_path: Path):
    path = tmp_path / "state.json"
    target = tmp_path / "victim"
    target.write_bytes(b"precious\n")
    # The name the writer used before (pid-based, known to every local user).
    planted = tmp_path / f".state.json.{os.getpid()}.tmp"
    _plant(planted, target)
    statefile.write(str(path), EPS)
    assert target.read_bytes() == b"precious\n"
    assert not path.is_symlink() and statefile.decode(path.read_bytes()) == EPS
    assert planted.is_symlink()  # someone else's: left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [planted.name, "state.json", "victim"])


def test_a_symlink_at_the_random_name_is_skipped(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    # A guessed (or raced) random name: the writer draws the planted name first.
    path = tmp_path / "state.json"
    target = tmp_path / "victim"
    target.write_bytes(b"precious\n")
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(statefile, "_random_suffix", lambda: next(names))
    _plant(tmp_path / ".state.json.guessed.tmp", target)
    statefile.write(str(path), EPS)
    assert target.read_bytes() == b"precious\n"
    assert not path.is_symlink() and statefile.decode(path.read_bytes()) == EPS
    assert not (tmp_path / ".state.json.fresh.tmp").exists()  # renamed into place


def test_every_name_taken_fails_the_write_and_touches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "state.json"
    path.write_bytes(b"old\n")
    target = tmp_path / "victim"
    target.write_bytes(b"precious\n")
    monkeypatch.setattr(statefile, "_random_suffix", lambda: "guessed")
    _plant(tmp_path / ".state.json.guessed.tmp", target)
    with pytest.raises(OSError, match="no free temporary name"):
        statefile.write(str(path), EPS)
    assert target.read_bytes() == b"precious\n" and path.read_bytes() == b"old\n"


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path):
    path = tmp_path / "state.json"
    path.mkdir()  # the rename over a directory fails
    with pytest.raises(OSError):
        statefile.write(str(path), EPS)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_writer_thread_runs_only_while_there_is_something_to_write(tmp_path: Path):
    def writers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "state-file-writer")

    path = tmp_path / "state.json"
    stop = threading.Event()
    w = statefile.StateWriter(str(path), stop)
    w.start()
    try:
        assert writers() == 0  # nothing to write: no thread
        w.save(EPS)
        wait_until(lambda: w.writes == 1 and writers() == 0, 5,
                   message="written, and the writer gone")
        w.save(EPS[1:])  # a later change starts a writer again
        wait_until(lambda: w.writes == 2 and writers() == 0, 5,
                   message="written again, and the writer gone")
        assert statefile.read(str(path)) == EPS[1:]
    finally:
        stop.set()
        assert w.join(5)
    w.save(EPS)  # after the stop: never written
    assert writers() == 0 and w.writes == 2
