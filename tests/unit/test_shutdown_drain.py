"""The shutdown drain's schedule (pure) and its loop with an injected clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extractedprism.datapath.shutdown_drain import close_offsets, spread_close
from tests.process.lifecycle import max_in_any_window


@given(n=st.integers(4, 2000), window=st.floats(0.1, 3600))
def test_never_more_than_a_quarter_in_any_tenth(n: int, window: float):
    offsets = close_offsets(n, window)
    assert len(offsets) == n
    assert all(0 < t < window for t in offsets)
    assert offsets == sorted(offsets)
    assert max_in_any_window(offsets, window / 10) <= n / 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.now += s


class Conn:
    def __init__(self, clock: FakeClock, fail: bool = False) -> None:
        self.clock = clock
        self.fail = fail
        self.closed_at: float | None = None

    def close(self) -> None:
        self.closed_at = self.clock.now
        if self.fail:
            raise OSError("already gone")


def test_spread_close_follows_the_schedule_and_survives_a_failing_close():
    clock = FakeClock()
    conns = [Conn(clock, fail=(i == 3)) for i in range(10)]
    assert spread_close(conns, 10.0, clock=clock, sleep=clock.sleep) == 10
    assert [round(c.closed_at - 100.0, 6) for c in conns] == [i + 0.5 for i in range(10)]


def test_nothing_to_close_returns_at_once():
    clock = FakeClock()
    assert spread_close([], 30.0, clock=clock, sleep=clock.sleep) == 0
    assert clock.now == 100.0
