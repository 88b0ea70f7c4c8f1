"""Backoff delay sequence: 1 s doubling to 30 s, up to 25% jitter, reset."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extractedprism.backoff import Backoff
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
    assert b.base == 30
    b.reset()
    assert b.base == 1
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
