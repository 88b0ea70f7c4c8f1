"""Backoff delay sequence: 1 s doubling to 30 s, up to 25% jitter, reset."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extractedprism.discovery.backoff import Backoff, Ended, WatchMemory, next_step
from tests.util import FixedRandom

pytestmark = pytest.mark.timeout(30)


def test_sequence_without_jitter_doubles_to_cap() -> None:
    b = Backoff(FixedRandom(0.0))
    assert [b.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_full_jitter_adds_a_quarter() -> None:
    b = Backoff(FixedRandom(1.0))
    assert [b.next_delay() for _ in range(7)] == [1.25, 2.5, 5, 10, 20, 37.5, 37.5]


def test_reset_starts_from_one_second() -> None:
    b = Backoff(FixedRandom(0.5))
    for _ in range(5):
        b.next_delay()
    assert b.next_delay() == pytest.approx(30 * 1.125)
    b.reset()
    assert b.next_delay() == pytest.approx(1.125)
    assert b.next_delay() == pytest.approx(2.25)


@given(seed=st.integers(min_value=0, max_value=2**32), n=st.integers(min_value=1, max_value=20))
def test_every_delay_within_base_and_quarter_jitter(seed: int, n: int) -> None:
    b = Backoff(random.Random(seed))
    base = 1.0
    for _ in range(n):
        d = b.next_delay()
        assert base <= d <= base * 1.25
        base = min(base * 2, 30.0)


# --- the watch loop's decision, from a table quoting the spec ---------------------

FRESH = WatchMemory()
WATCHING = WatchMemory(listed=True)  # listed, a plain watch
AFTER_LONG = WatchMemory(listed=True, after_long=True)
LIST, WATCH = True, False
LONG, SHORT = 30.0, 29.9


@pytest.mark.parametrize("spec,memory,ended,open_for,expected", [
    ("Lists EndpointSlice resources on startup, then establishes a Watch",
     FRESH, Ended.LISTED, 0, (WATCH, False, False, WATCHING)),
    ("A failed list waits for the backoff and retries",
     FRESH, Ended.LIST_FAILED, 0, (LIST, True, False, FRESH)),
    ("A watch that stayed open for at least 30s and then closed without an error is "
     "re-opened immediately", WATCHING, Ended.CLEAN, LONG, (WATCH, False, False, AFTER_LONG)),
    ("Reconnects with exponential backoff (a shorter watch that closed)",
     WATCHING, Ended.CLEAN, SHORT, (WATCH, True, False, WATCHING)),
    ("... and a re-watch right after a long one that closes soon waits too",
     AFTER_LONG, Ended.CLEAN, SHORT, (WATCH, True, False, WATCHING)),
    ("Reconnects with exponential backoff on Watch errors",
     WATCHING, Ended.ERROR, SHORT, (WATCH, True, False, WATCHING)),
    ("Any other error after such a watch, except 410 Gone, starts the backoff from 1s "
     "again (the error ends a watch open >= 30s)",
     WATCHING, Ended.ERROR, LONG, (WATCH, True, True, WATCHING)),
    ("Any other error after such a watch ... (the error hits the re-watch)",
     AFTER_LONG, Ended.ERROR, 0, (WATCH, True, True, WATCHING)),
    ("On 410 Gone (etcd compaction), performs a full re-list",
     WATCHING, Ended.GONE, SHORT, (LIST, False, False, WATCHING)),
    ("410 ending a watch open >= 30s: re-list, and the next watch starts at once",
     WATCHING, Ended.GONE, LONG, (LIST, False, False, AFTER_LONG)),
    ("410 hitting the re-watch right after such a watch closed without an error",
     AFTER_LONG, Ended.GONE, 0, (LIST, False, False, AFTER_LONG)),
    ("After a successful re-list, the next watch starts at once if the 410 ended a watch "
     "that was open for at least 30s, or hit the re-watch right after such a watch",
     AFTER_LONG, Ended.LISTED, 0, (WATCH, False, False, WATCHING)),
    ("Otherwise it waits for the backoff",
     WATCHING, Ended.LISTED, 0, (WATCH, True, False, WATCHING)),
    ("A failed re-list waits and retries, remembering why it re-lists",
     AFTER_LONG, Ended.LIST_FAILED, 0, (LIST, True, False, AFTER_LONG)),
    ("410 Gone does not reset the backoff",
     AFTER_LONG, Ended.GONE, LONG, (LIST, False, False, AFTER_LONG)),
])
def test_next_step(spec, memory, ended, open_for, expected):
    step, memory_after = next_step(memory, ended, open_for)
    assert (step.list, step.wait, step.reset, memory_after) == expected, spec
