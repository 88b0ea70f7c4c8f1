"""Text -> value for flag strings: Go-style durations and booleans (pure).

Owns the spellings an operator may type (``20s``, ``1m30s``, ``500ms``, bare seconds;
``true``/``false``/``1``/``0``...) and the reverse rendering that error messages echo.
:mod:`extractedprism.config` converts every flag through these; nothing here knows a
flag's name.
"""

from __future__ import annotations

import math
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
MAX_DURATION_S = 1e9  # about 31 years, far below threading.TIMEOUT_MAX
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go-style duration (``20s``, ``500ms``, ``1m30s``, ``-1s``) or bare seconds -> seconds."""
    raw = text.strip()
    if not raw:
        raise ValueError("empty duration")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = _go_duration(raw, text)
    # nan passes every comparison (--health-interval=nan spun the ticker at full CPU)
    # and a wait longer than threading.TIMEOUT_MAX raises instead of waiting.
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a finite duration")
    if abs(seconds) > MAX_DURATION_S:
        raise ValueError(f"{text!r} is too long (at most {format_duration(MAX_DURATION_S)})")
    return seconds


def _go_duration(raw: str, text: str) -> float:
    sign = 1.0
    body = raw
    if body[0] in "+-":
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    pos, total = 0, 0.0
    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if not m:
            raise ValueError(f"{text!r} is not a duration (examples: 20s, 500ms, 1m30s)")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos == 0:
        raise ValueError(f"{text!r} is not a duration (examples: 20s, 500ms, 1m30s)")
    return sign * total


def format_duration(seconds: float) -> str:
    """Seconds -> Go-style text, so messages echo what an operator would have typed."""
    if seconds == 0:
        return "0s"
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 1:
        ms = s * 1000
        return f"{sign}{ms:g}ms"
    hours, rem = divmod(s, 3600)
    minutes, secs = divmod(rem, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if secs or not out:
        out += f"{round(secs, 6):g}s"
    return sign + out


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "y", "on", "t"):
        return True
    if value in ("false", "0", "no", "n", "off", "f"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0, yes/no)")


