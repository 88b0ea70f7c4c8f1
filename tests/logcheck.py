"""Checks that log output is what log tools can read: every line logfmt (parsed with a
real logfmt parser, strictly) or JSON, with the keys every line must carry."""

from __future__ import annotations

import json
import re
from typing import Any

import logfmtkv

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d\d:\d\d)$")
LEVELS = ("debug", "info", "warn", "error", "dpanic", "panic", "fatal")
FIRST_KEYS = ["ts", "level", "logger", "msg"]


def _check(record: dict[str, Any], line: str) -> dict[str, Any]:
    assert list(record)[:4] == FIRST_KEYS, f"keys out of order: {line!r}"
    assert TS.match(str(record["ts"])), f"ts is not RFC 3339 with ms and offset: {line!r}"
    assert record["level"] in LEVELS, f"level word: {line!r}"
    assert record.get("thread"), f"no thread: {line!r}"
    return record


def parse_logfmt(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a dict; fails on the first line that is not logfmt."""
    out = []
    for line in text.splitlines():
        try:
            record = logfmtkv.parse(line, strict=True)
        except logfmtkv.LogfmtError as exc:
            raise AssertionError(f"not logfmt ({exc}): {line!r}") from None
        out.append(_check(record, line))
    return out


def parse_json(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise AssertionError(f"not JSON ({exc}): {line!r}") from None
        assert isinstance(record, dict), line
        out.append(_check(record, line))
    return out


def parse(text: str, fmt: str) -> list[dict[str, Any]]:
    return parse_logfmt(text) if fmt == "logfmt" else parse_json(text)
