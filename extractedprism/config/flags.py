"""The flag table's machinery (pure): flags, their converters and checks, rules.

Owns how one row of :data:`extractedprism.config.table.FLAGS` turns an operator's string
into a checked value: a :class:`Flag` names its kind (a converter in :data:`KINDS`:
Go-style durations, booleans, ports, endpoint lists, paths, choices) and its
:class:`Check` rows; a :class:`Rule` ties several flags together. config.py holds the
tables and ``validate()``; nothing here knows a particular flag.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extractedprism.config.endpoints import Endpoint, is_valid_host, parse_endpoint_list
from extractedprism.errors import one_line

# --- text -> value: durations and booleans ------------------------------------

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


# --- checks: one value, one rule ----------------------------------------------


@dataclass(frozen=True)
class Check:
    """A rule for one flag's converted value; ``text`` is the message after the flag."""

    ok: Callable[[Any], bool]
    text: str


def _at_least(lo: float, text: str) -> Check:
    return Check(lambda v: v >= lo, text)


PORT = Check(lambda v: 1 <= v <= 65535, "must be in the range 1-65535")
AT_LEAST_1S = _at_least(1.0, "must be at least 1s")
NOT_NEGATIVE = _at_least(0.0, "must not be negative")
AT_LEAST_1 = _at_least(1, "must be at least 1")
HOST = Check(is_valid_host, "must be a valid IP address or RFC 1123 hostname")
NOT_EMPTY = Check(bool, "must not be empty")


# --- kinds: string -> value ----------------------------------------------------


def _to_int(flag: Flag, value: str) -> int:
    text = value.strip()
    if not text.lstrip("-").isdigit():
        raise ValueError(f"{value!r} is not a whole number")
    return int(text)


def _to_choice(flag: Flag, value: str) -> str:
    # Exact, as the spec lists them: "DEBUG" or " info" are typos worth reporting.
    if value not in flag.choices:
        raise ValueError(f"must be one of {', '.join(flag.choices)}")
    return value


def _to_endpoints(flag: Flag, value: str) -> tuple[Endpoint, ...]:
    endpoints, problems = parse_endpoint_list(value)
    if problems:
        raise ValueError("; ".join(problems))
    return tuple(endpoints)


def _to_path(flag: Flag, value: str) -> str:
    # A NUL byte ends a path for the kernel: no file has such a name, and os.stat() and
    # open() raise ValueError instead of an OSError that would name the file. A command
    # line or the environment cannot carry one (execve's strings end at it), but a
    # configuration built in-process can.
    if "\0" in value:
        raise ValueError("the path contains a NUL byte")
    # A path of spaces is as unset as an empty one (a template's blank value, say).
    return value if value.strip() else ""


KINDS: dict[str, Callable[[Flag, str], object]] = {
    "str": lambda flag, value: value.strip(),
    "int": _to_int,
    "duration": lambda flag, value: parse_duration(value),
    "bool": lambda flag, value: parse_bool(value),
    "choice": _to_choice,
    "endpoints": _to_endpoints,
    "path": _to_path,
}


# --- flags and rules ------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One row of the flag table: option, EP_ variable, default, help and checks."""

    name: str  # without leading dashes
    kind: str  # a key of KINDS
    default: str | None
    help: str
    choices: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    # Unset (or blank) takes the converted value of this other flag, unchecked again.
    same_as: str = ""
    # Unset (or blank) is this error instead of a default.
    required: str = ""
    # The --help section it is listed in: a key of table.GROUPS.
    group: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"flag {self.name}: unknown kind {self.kind!r}")

    @property
    def option(self) -> str:
        return "--" + self.name

    @property
    def env(self) -> str:
        return "EP_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def rules(self) -> tuple[str, ...]:
        """The checks in words, for --help and docs."""
        return tuple(c.text for c in self.checks)


# ``Rule.message(values, show)``: ``values`` holds every converted value by dest,
# ``show(dest)`` renders "--flag (raw value)"; return the problem, or None.
Message = Callable[[Mapping[str, Any], Callable[[str], str]], "str | None"]


@dataclass(frozen=True)
class Rule:
    """A rule over several flags, checked when all of ``fields`` converted."""

    fields: tuple[str, ...]  # dests
    text: str  # the rule as the spec words it
    message: Message


def show_value(flag: Flag, raw: str, name: str = "") -> str:
    """How a message names a setting: ``--flag (value)``, or ``--flag`` for a blank one;
    ``name`` instead of the option when the value came from elsewhere (``EP_FLAG``)."""
    name = name or flag.option
    return f"{name} ({one_line(raw)})" if raw.strip() else name
