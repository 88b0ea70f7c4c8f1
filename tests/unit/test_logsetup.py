"""The spec's zap-style log levels map onto Python logging thresholds."""

from __future__ import annotations

import io
import logging

import pytest

from extractedprism.logsetup import LEVELS, setup_logging


@pytest.fixture(autouse=True)
def restore_root():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    noisy = {n: logging.getLogger(n).level for n in ("urllib3", "kubernetes")}
    yield
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
    text = out.getvalue()
    assert ("shown upstream=10.0.0.1:6443" in text) == bool(shown)
    assert "hidden" not in text
    if shown:
        assert "level=" in text and "thread=MainThread" in text


def test_every_spec_level_is_known():
    assert list(LEVELS) == ["debug", "info", "warn", "error", "dpanic", "panic", "fatal"]
    assert LEVELS["debug"] < LEVELS["info"] < LEVELS["warn"] < LEVELS["error"] \
        < LEVELS["dpanic"] < LEVELS["panic"] < LEVELS["fatal"]
