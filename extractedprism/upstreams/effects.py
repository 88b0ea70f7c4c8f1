"""Side effects of a registry change (pure data until :meth:`Effects.run`).

The registry never closes a socket, logs or calls its listener while holding its
lock: each method collects those effects in an :class:`Effects` under the lock and
runs them after releasing it, so a stalled log handler (a full stderr pipe) or a slow
close never stalls a pick. :class:`Change` is the one notice its listener (the
ticker) gets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from extractedprism.upstreams.state import Transition


class Closable(Protocol):
    client: str

    def close(self) -> None: ...


class Finishable(Closable, Protocol):
    def finish(self) -> None: ...


@dataclass(frozen=True)
class Change:
    """What the registry tells its one listener (the ticker) after releasing the lock."""

    # "endpoints" (list changed) | "health" (a dial flipped it) | "probe-now" |
    # "recheck" (a failed dial left it one failure short of exclusion: confirm soon) |
    # "stall-check" (a stall made it suspect: check it now, counted as a stall check)
    what: str
    address: str = ""


class Effects:
    """Side effects collected under the lock, run after it is released."""

    __slots__ = ("changes", "close", "finish", "logs")

    def __init__(self) -> None:
        self.close: list[Closable] = []
        # Closed with a FIN both ways and no reset (a rebalance close: the client sees a
        # clean EOF and reconnects).
        self.finish: list[Finishable] = []
        self.logs: list[tuple[int, str, tuple[object, ...]]] = []
        self.changes: list[Change] = []

    def log(self, level: int, msg: str, *args: object) -> None:
        self.logs.append((level, msg, args))

    def transitions(self, addr: str, transitions: Iterable[Transition]) -> None:
        for t in transitions:
            if t.kind == "check":
                self.log(t.level, "upstream check failed upstream=%s reason=%r", addr, t.reason)
            else:
                self.log(t.level, "upstream %s->%s upstream=%s reason=%r", t.before, t.after,
                         addr, t.reason)

    def run(self, log: logging.Logger, on_change: Callable[[Change], None] | None) -> None:
        """Close, log, notify: called with the lock released."""
        for conn in self.close:
            try:
                conn.close()
            except Exception:  # a close must never take a caller down
                log.exception("closing connection failed client=%s", conn.client)
        for done in self.finish:
            try:
                done.finish()
            except Exception:
                log.exception("closing connection failed client=%s", done.client)
        for level, msg, args in self.logs:
            log.log(level, msg, *args)
        if on_change is not None:
            for change in self.changes:
                on_change(change)
