"""The benchmark's fixed names: paths, phases, the reference proxies, and its two errors."""

from __future__ import annotations

from epscripts.common import SCRIPTS

HOST = "127.0.0.1"
PATHS = ("direct", "haproxy", "extractedprism")
# Opt-in reference proxies with extractedprism's data-path shape (scripts/bench_ref/): in C,
# and in the least CPython that expresses it. They tell what the shape costs on this
# machine and what CPython adds, in the same run (docs/performance.md).
# "ep-python" is extractedprism itself with --relay python (the pure-Python fallback),
# beside "extractedprism" (--relay native), so both relays get a column in every run.
REFS = ("ep-python", "ref-c", "ref-py")
DEFAULT_PATHS = (*PATHS, "ep-python")
REF_DIR = SCRIPTS / "bench_ref"
PROXIES = ("haproxy", "extractedprism")
PHASES = ("bulk", "keepalive", "newconn", "idle")
BODY_SIZE = 128  # bytes of the static body nginx serves: a "small request/response"
NOFILE_WANTED = 65536


class HarnessError(Exception):
    """The harness itself could not run (exit status 2)."""


class Watchdog(Exception):
    """The whole run exceeded --max-seconds."""
