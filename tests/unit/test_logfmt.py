"""Log lines: fields from message templates and extras, logfmt quoting, JSON."""

from __future__ import annotations

import json
import logging
import sys

import logfmtkv
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extractedprism.logs.logfmt import LineFormatter, level_name, quote, structure
from tests.logcheck import parse_json, parse_logfmt


def record(msg: object, *args: object, level: int = logging.INFO, exc_info: object = None,
           **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("extractedprism.test", level, __file__, 1, msg, args or None,
                            exc_info)  # type: ignore[arg-type]
    rec.__dict__.update(extra)
    return rec


def line(rec: logging.LogRecord, fmt: str = "logfmt") -> str:
    return LineFormatter(fmt).format(rec)


@pytest.mark.parametrize("template,args,msg,fields", [
    # The house style: the event, then key=value; %r of a string is the string itself.
    ("upstream %s->%s upstream=%s reason=%r", ("healthy", "unhealthy", "10.0.0.1:6443",
                                               "dial: connection refused"),
     "upstream healthy->unhealthy",
     [("upstream", "10.0.0.1:6443"), ("reason", "dial: connection refused")]),
    # A value template with a unit suffix or two conversions.
    ("watch backoff delay=%.3fs reason=%r", (0.5, "x"), "watch backoff",
     [("delay", "0.500s"), ("reason", "x")]),
    ("started listen=%s:%d", ("127.0.0.1", 7445), "started",
     [("listen", "127.0.0.1:7445")]),
    # Punctuation after a field stays in the message.
    ("endpointslice ignored slice=%s; keeping its last endpoints=%s", ("k", "a,b"),
     "endpointslice ignored; keeping its last", [("slice", "k"), ("endpoints", "a,b")]),
    # A literal value, and a key the line itself uses.
    ("thread outlived deadline thread=watcher timeout=%s", (5,), "thread outlived deadline",
     [("field_thread", "watcher"), ("timeout", 5)]),
    # No arguments: % is text.
    ("100% sure", (), "100% sure", []),
    # Arguments that do not fit the template: formatted whole, nothing lost.
    ("a=%s b=%s", (1,), "a=%s b=%s (log arguments do not fit: (1,))", []),
])
def test_template_fields(template, args, msg, fields):
    got_msg, got_fields = structure(record(template, *args))
    assert got_msg == msg
    assert got_fields == fields


def test_values_with_spaces_quotes_and_equals_stay_one_field():
    nasty = 'a "quoted" = value\nwith a newline\tand \\ backslash'
    text = line(record("probe failed upstream=%s reason=%r", "10.0.0.1:6443", nasty))
    [parsed] = parse_logfmt(text)
    assert parsed["reason"] == nasty
    assert parsed["upstream"] == "10.0.0.1:6443"
    assert "\n" not in text


def test_extra_fields_keep_their_types_in_json():
    rec = record("connection closed", client="127.0.0.1:5000", bytes_up=12,
                 duration_seconds=0.25, ok=True)
    [parsed] = parse_json(line(rec, "json"))
    assert parsed["bytes_up"] == 12 and parsed["duration_seconds"] == 0.25
    assert parsed["ok"] is True and parsed["client"] == "127.0.0.1:5000"
    [as_logfmt] = parse_logfmt(line(rec))
    assert as_logfmt["bytes_up"] == "12" and as_logfmt["ok"] == "true"


def test_key_order_and_required_keys():
    [parsed] = parse_logfmt(line(record("x upstream=%s", "a")))
    assert list(parsed) == ["ts", "level", "logger", "msg", "upstream", "thread"]
    assert parsed["logger"] == "extractedprism.test"
    assert parsed["thread"] == "MainThread"


def test_exception_is_one_line_with_the_stacktrace():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("probe crashed upstream=%s", "a", level=logging.ERROR,
                     exc_info=sys.exc_info())
    text = line(rec)
    assert "\n" not in text
    [parsed] = parse_logfmt(text)
    assert parsed["level"] == "error"
    assert parsed["stacktrace"].startswith("Traceback (most recent call last):")
    assert "ValueError: boom" in parsed["stacktrace"]
    [as_json] = parse_json(line(rec, "json"))
    assert "ValueError: boom" in as_json["stacktrace"]


@pytest.mark.parametrize("levelno,word", [
    (logging.DEBUG, "debug"), (logging.INFO, "info"), (logging.WARNING, "warn"),
    (logging.ERROR, "error"), (45, "dpanic"), (logging.CRITICAL, "panic"), (55, "fatal"),
])
def test_level_words(levelno, word):
    assert level_name(levelno) == word
    [parsed] = parse_logfmt(line(record("x", level=levelno)))
    assert parsed["level"] == word


@given(st.text())
def test_any_value_round_trips_through_a_strict_logfmt_parser(text):
    parsed = logfmtkv.parse(f"k={quote(text)}", strict=True)
    # go-logfmt reads a bare key (no '=') as true, and "k=" as the empty string.
    assert parsed["k"] == text


@given(st.text(), st.text())
def test_any_message_and_field_make_one_valid_line(msg, value):
    rec = record(msg, field=value)
    [parsed] = parse_logfmt(line(rec))
    assert parsed["field"] == value
    [as_json] = parse_json(line(rec, "json"))
    assert as_json["field"] == value


def test_json_is_one_object_per_line():
    text = line(record("a\nb upstream=%s", "x"), "json")
    assert "\n" not in text
    assert json.loads(text)["upstream"] == "x"


@given(st.floats(min_value=0, max_value=4e9))
def test_timestamp_matches_datetimes_own_rfc3339(created):
    import datetime

    from extractedprism.logs.logfmt import rfc3339

    whole_ms = int(created * 1000) / 1000
    expected = datetime.datetime.fromtimestamp(int(created * 1000) // 1000).astimezone()
    want = expected.isoformat()[:19] + f".{int(created * 1000) % 1000:03d}" + \
        expected.isoformat()[19:]
    assert rfc3339(created) == want
    assert datetime.datetime.fromisoformat(rfc3339(created)).timestamp() == \
        pytest.approx(whole_ms, abs=0.0011)
