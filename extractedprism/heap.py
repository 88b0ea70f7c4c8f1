"""Giving freed heap back to the kernel: glibc's ``malloc_trim``, called after the
events that leave much of it free.

CPython returns freed objects to pymalloc and glibc, which keep the pages for reuse, so
resident memory stays at its high-water mark though the memory is free: after the
start-up (reading every module's code allocates and frees buffers), and after a burst of
connections (each pipe thread's frames, buffers and glibc arena). This process runs on
every node for months; :func:`trim` hands those pages back (about 1 MiB after the
start, as much again after a burst; docs/performance.md, "Footprint"). It walks every
arena, a few milliseconds, so it is called once per such event, never per connection.
Without glibc (musl) it does nothing. ``ctypes`` is imported on the first call.
"""

from __future__ import annotations

from collections.abc import Callable

_malloc_trim: Callable[[int], int] | None = None
_missing = False


def trim() -> bool:
    """Release free heap pages to the kernel; False where the C library cannot."""
    global _malloc_trim, _missing
    if _missing:
        return False
    if _malloc_trim is None:
        import ctypes

        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _missing = True
            return False
    _malloc_trim(0)
    return True
