"""heap.trim: glibc's malloc_trim hands freed heap back; without it, a quiet no-op."""

from __future__ import annotations

import ctypes

import pytest

from extractedprism import heap


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", None)
    monkeypatch.setattr(heap, "_missing", False)


def test_trim_gives_freed_heap_back() -> None:
    # 64 MiB in blocks glibc serves from its heap (below the mmap threshold), the last
    # one kept so the heap's top cannot simply shrink: only a trim returns the rest.
    blocks = [bytearray(60 * 1024) for _ in range(1100)]
    keep = blocks[-1]
    del blocks
    before = _rss_kib()
    assert heap.trim()
    after = _rss_kib()
    assert before - after > 16 * 1024, (before, after)
    assert keep


def test_without_malloc_trim_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(_name: object) -> object:
        raise OSError("no C library here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert heap.trim() is False
    assert heap.trim() is False  # looked up once


def test_limit_arenas_sets_glibc_arena_max(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(heap, "_libc", Libc)
    assert heap.limit_arenas() is True
    assert calls == [(-8, heap.ARENAS)]  # M_ARENA_MAX
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.limit_arenas() is False
