"""Rate limit of per-client failures: the first line, then at most one summary a second."""

from __future__ import annotations

import logging

import pytest

from extractedprism.logs.connlog import RateLimited


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, object]]]:
    out = []
    for r in caplog.records:
        if r.name == "extractedprism.test.rate":
            out.append((r.getMessage(), {k: getattr(r, k) for k in ("upstream", "count")
                                         if hasattr(r, k)}))
    return out


def test_first_logged_then_one_summary_per_interval(clock, caplog):
    caplog.set_level(logging.INFO)
    limit = RateLimited(logging.getLogger("extractedprism.test.rate"), logging.INFO,
                        "dial failed", clock=clock)
    for _ in range(20):  # 20 clients within a few ms
        limit("a", upstream="a")
        clock.now += 0.001
    assert lines(caplog) == [("dial failed", {"upstream": "a"})]
    clock.now += 1.0
    limit("a", upstream="a")  # the 21st, a second later: one summary for 20
    assert lines(caplog)[1:] == [("dial failed (repeated)", {"upstream": "a", "count": 20})]
    limit("a", upstream="a")
    limit.flush()  # within the interval: nothing yet
    assert len(lines(caplog)) == 2
    clock.now += 1.0
    limit.flush()  # the writer's tick reports the rest
    # One occurrence is its own line, not "(repeated) count=1" (issue 30).
    assert lines(caplog)[2:] == [("dial failed", {"upstream": "a"})]
    limit.flush()
    assert len(lines(caplog)) == 3


def test_each_key_has_its_own_first_line(clock, caplog):
    caplog.set_level(logging.INFO)
    limit = RateLimited(logging.getLogger("extractedprism.test.rate"), logging.INFO,
                        "dial failed", clock=clock)
    limit("a", upstream="a")
    limit("b", upstream="b")
    limit("a", upstream="a")
    assert [m for m, _ in lines(caplog)] == ["dial failed", "dial failed"]


def test_a_quiet_key_starts_a_new_episode(clock, caplog):
    caplog.set_level(logging.INFO)
    limit = RateLimited(logging.getLogger("extractedprism.test.rate"), logging.INFO,
                        "no upstream available", clock=clock, reset_after=10.0)
    limit()
    clock.now += 11.0
    limit.flush()
    limit()
    assert [m for m, _ in lines(caplog)] == ["no upstream available"] * 2


def test_disabled_level_costs_nothing(clock, caplog):
    caplog.set_level(logging.WARNING)
    calls = []

    def counting_clock() -> float:
        calls.append(1)
        return clock()

    limit = RateLimited(logging.getLogger("extractedprism.test.rate"), logging.INFO,
                        "dial failed", clock=counting_clock)
    limit("a", upstream="a")
    assert not calls and not lines(caplog)
