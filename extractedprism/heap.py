"""Keeping the C heap small: glibc's arenas limited, and freed heap given back to the
kernel (``malloc_trim``) after the events that leave much of it free.

CPython returns freed objects to pymalloc and glibc, which keep the pages for reuse, so
resident memory stays at its high-water mark though the memory is free: after the
start-up (reading every module's code allocates and frees buffers), and after a burst of
connections (each pipe thread's frames, buffers and glibc arena). This process runs on
every node for months; :func:`trim` hands those pages back (about 1 MiB after the
start, as much again after a burst; docs/performance.md, "Footprint"). It walks every
arena, a few milliseconds, so it is called once per such event, never per connection.
Without glibc (musl), or in a Python without ``ctypes``, it does nothing. ``ctypes`` is
imported on the first call.

glibc gives each thread that allocates an arena of its own, up to 8 per CPU; each keeps
its own free and fragmented pages, and a pipe thread allocates little (the GIL
serialises its Python anyway). :func:`limit_arenas` (before any thread starts) caps them
at :data:`ARENAS`: measured, a churn of 200,000 connections grows the proxy by half as
much (docs/performance.md, "Footprint").
"""

from __future__ import annotations

from collections.abc import Callable

ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h

_malloc_trim: Callable[[int], int] | None = None
_missing = False


def _libc() -> object | None:
    try:
        import ctypes  # a Python built without _ctypes (libffi) has none: nothing to do
    except ImportError:
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas (call before starting threads); False without glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_ARENA_MAX, arenas))


def trim() -> bool:
    """Release free heap pages to the kernel; False where the C library cannot."""
    global _malloc_trim, _missing
    if _missing:
        return False
    if _malloc_trim is None:
        _malloc_trim = getattr(_libc(), "malloc_trim", None)
        if _malloc_trim is None:
            _missing = True
            return False
    _malloc_trim(0)
    return True
