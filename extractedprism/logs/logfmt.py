"""Log records -> one logfmt or JSON line each (pure: no I/O, no threads).

# design
A line has ``ts`` (RFC 3339, milliseconds, offset), ``level`` (the spec's words: debug,
info, warn, error, dpanic, panic, fatal), ``logger``, ``msg``, the event's fields, then
``thread`` (the real thread name: ``pipe-<client>-><upstream>`` for a connection) and,
for a record with an exception, ``stacktrace``. logfmt values follow go-logfmt's rule:
quoted when they hold a space, ``=``, ``"``, a control character or nothing at all, with
``\\`` ``"`` newline, CR and tab escaped (``\\n``...), other control characters as
``\\u00XX``, so a traceback or a thread dump is one line.

Fields come from two places, so the call sites keep the house style
(``log.info("upstream unhealthy upstream=%s reason=%r", addr, why)``) and need no edit:

- ``extra={...}``: every attribute a record has beyond the standard ones is a field,
  with its native JSON type.
- The message template: each whitespace-separated ``key=<value template>`` token of the
  *template* (``record.msg``, constant in the source) becomes a field whose value is that
  token formatted with the arguments it consumes; the rest of the template is ``msg``.
  The template is parsed, never the formatted text, so a value holding spaces, ``=`` or
  quotes cannot split a field, and ``%r`` of a string gives the string itself (the
  quoting is logfmt's job now, not repr's). A template whose conversions do not match
  its arguments (or that uses ``%(name)s`` or ``*``) is formatted whole into ``msg``.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

DPANIC = 45
FATAL = 55

# Record attributes that are not fields (the standard ones plus what formatters add).
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}
# Keys the line itself uses; a template field of the same name gets a ``field_`` prefix.
RESERVED = ("ts", "level", "logger", "msg", "thread", "stacktrace")

_SPEC = re.compile(r"%(?P<named>\([^)]*\))?[#0+ -]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?"
                   r"(?P<conv>[diouxXeEfFgGcrsa%])")
_FIELD = re.compile(r"(?<!\S)(?P<key>[A-Za-z_][A-Za-z0-9_.]*)=(?P<val>\S*)")
# Besides ASCII controls, NEL and the Unicode line/paragraph separators are escaped: a
# reader splitting on every line break (Python's splitlines) still sees one record.
_NEEDS_QUOTE = re.compile('[\\x00-\\x20="\\x7f\\x85\\u2028\\u2029]')
_TO_ESCAPE = re.compile('[\\x00-\\x1f"\\\\\\x7f\\x85\\u2028\\u2029]')
_JSON_BREAKS = re.compile("[\\x85\\u2028\\u2029]")
_NAMED_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([;,:.])")


def level_name(levelno: int) -> str:
    """Python level number -> the spec's level word (WARNING is warn, CRITICAL panic)."""
    if levelno <= logging.DEBUG:
        return "debug"
    if levelno <= logging.INFO:
        return "info"
    if levelno <= logging.WARNING:
        return "warn"
    if levelno <= logging.ERROR:
        return "error"
    if levelno <= DPANIC:
        return "dpanic"
    if levelno <= logging.CRITICAL:
        return "panic"
    return "fatal"


_second_cache: tuple[int, str, str] = (-1, "", "")  # second, date and time, offset


def rfc3339(created: float) -> str:
    """``2026-12-01T18:25:55.148+00:00``: local time with its offset, milliseconds.

    The date, time and offset are worked out once per second (records come in bursts);
    the cache is one tuple, replaced whole, so threads never see half of an update.
    """
    global _second_cache
    second, ms = divmod(int(created * 1000), 1000)
    cached = _second_cache
    if cached[0] != second:
        text = datetime.datetime.fromtimestamp(second).astimezone().isoformat()
        cached = _second_cache = (second, text[:19], text[19:])
    return f"{cached[1]}.{ms:03d}{cached[2]}"


def quote(text: str) -> str:
    """A logfmt value token for ``text`` (go-logfmt's quoting rule)."""
    if text and not _NEEDS_QUOTE.search(text):
        return text
    return '"' + _TO_ESCAPE.sub(_escape, text) + '"'


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED_ESCAPES.get(char) or f"\\u{ord(char):04x}"


@functools.lru_cache(maxsize=1024)
def _key(text: str) -> str:
    """Keys never need quoting: anything outside [A-Za-z0-9_.-] becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", text) or "_"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- the message template ---------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _parse_template(template: str, with_args: bool) -> tuple[tuple[str, str, int], ...] | None:
    """Template -> parts (kind, text, conversions consumed); kind "t" (text) or a field key.

    None when the template cannot be split safely (named or starred conversions).
    """
    if with_args and ("%(" in template or "*" in "".join(
            m.group() for m in _SPEC.finditer(template))):
        return None
    parts: list[tuple[str, str, int]] = []
    pos = 0

    def count(text: str) -> int:
        if not with_args:
            return 0
        return sum(1 for m in _SPEC.finditer(text) if m.group("conv") != "%")

    for m in _FIELD.finditer(template):
        if m.start() > pos:
            chunk = template[pos:m.start()]
            parts.append(("t", chunk, count(chunk)))
        key, val = m.group("key"), m.group("val")
        stripped = val.rstrip(";,")
        parts.append((key, stripped, count(stripped)))
        if stripped != val:
            parts.append(("t", val[len(stripped):], 0))
        pos = m.end()
    if pos < len(template):
        chunk = template[pos:]
        parts.append(("t", chunk, count(chunk)))
    return tuple(parts)


def _format_value(template: str, args: tuple[Any, ...]) -> Any:
    """A field's value template with its arguments; a lone ``%s``/``%d`` keeps the type."""
    if template in ("%s", "%d", "%r", "%i"):
        arg = args[0]
        if isinstance(arg, (bool, int, float)):
            return arg
        if isinstance(arg, str) and template in ("%s", "%r"):
            return arg
    it = iter(args)

    def one(m: re.Match[str]) -> str:
        spec = m.group()
        if m.group("conv") == "%":
            return "%"
        arg = next(it)
        if m.group("conv") == "r" and isinstance(arg, str):
            spec = spec[:-1] + "s"  # the string itself: quoting is logfmt's job
        return spec % (arg,)

    return _SPEC.sub(one, template)


def message(record: logging.LogRecord) -> str:
    """``record.getMessage()``, or the template and its arguments when they do not fit
    (logging would otherwise print its own "--- Logging error ---" block to stderr)."""
    try:
        return message(record)
    except Exception:
        return f"{record.msg} (log arguments do not fit: {record.args!r})"


def structure(record: logging.LogRecord) -> tuple[str, list[tuple[str, Any]]]:
    """(msg, fields) of a record: fields from the template's key=value tokens, then extras."""
    fields: list[tuple[str, Any]] = []
    msg = _template_fields(record, fields)
    for name, value in vars(record).items():
        if name not in _STANDARD and not name.startswith("_"):
            fields.append((name, value))
    return msg, fields


def _template_fields(record: logging.LogRecord, fields: list[tuple[str, Any]]) -> str:
    template, args = record.msg, record.args
    if not isinstance(template, str) or isinstance(args, dict):
        return message(record)
    args = tuple(args or ())
    parts = _parse_template(template, bool(args))
    if parts is None or sum(n for _, _, n in parts) != len(args):
        return message(record)
    out: list[str] = []
    found: list[tuple[str, Any]] = []
    i = 0
    try:
        for kind, text, n in parts:
            mine = args[i:i + n]
            i += n
            if kind == "t":
                out.append(text % mine if args else text)
            else:
                value = _format_value(text, mine) if n else (text % () if args else text)
                found.append((f"field_{kind}" if kind in RESERVED else kind, value))
    except (TypeError, ValueError, StopIteration):
        return message(record)
    fields.extend(found)
    msg = " ".join("".join(out).split())
    return _SPACE_BEFORE_PUNCT.sub(r"\1", msg)


# --- whole lines ----------------------------------------------------------------------


def items(record: logging.LogRecord, stacktrace: str = "") -> Iterator[tuple[str, Any]]:
    """Every key of the line, in order."""
    msg, fields = structure(record)
    yield "ts", rfc3339(record.created)
    yield "level", level_name(record.levelno)
    yield "logger", record.name
    yield "msg", msg
    seen = set(RESERVED)
    for key, value in fields:
        key = _key(key)
        if key in seen:
            key = f"field_{key}"
        seen.add(key)
        yield key, value
    yield "thread", record.threadName
    if stacktrace:
        yield "stacktrace", stacktrace


def logfmt_line(pairs: Iterator[tuple[str, Any]]) -> str:
    return " ".join(f"{key}={quote(_text(value))}" for key, value in pairs)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) \
            else str(value)
    return str(value)


def json_line(pairs: Iterator[tuple[str, Any]]) -> str:
    text = json.dumps({key: _jsonable(value) for key, value in pairs}, ensure_ascii=False)
    return _JSON_BREAKS.sub(_escape, text)


class LineFormatter(logging.Formatter):
    """``logging.Formatter`` for one format ("logfmt" or "json")."""

    def __init__(self, fmt: str = "logfmt") -> None:
        super().__init__()
        if fmt not in ("logfmt", "json"):
            raise ValueError(f"unknown log format {fmt!r}")
        self._render = logfmt_line if fmt == "logfmt" else json_line

    def format(self, record: logging.LogRecord) -> str:
        stack = ""
        if record.exc_info:
            stack = self.formatException(record.exc_info)
        elif record.exc_text:
            stack = record.exc_text
        if record.stack_info:
            stack = (stack + "\n" if stack else "") + record.stack_info
        return self._render(items(record, stack.rstrip("\n")))
