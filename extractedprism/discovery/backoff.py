"""The EndpointSlice watcher's reconnect rule (pure): delays and decisions.

Owns the spec's reconnect rule in two parts, both checked from tables:

* :class:`Backoff`: the delay sequence. The delay starts at 1 s, doubles up to 30 s,
  and each delay gets up to 25% random jitter on top
  (``delay * (1 + rng.random() * 0.25)``), with an injected random source.
* :func:`next_step`: *when* to wait, reset or skip a wait, and whether to re-list: from
  how the last step ended and how long the watch was open. :mod:`extractedprism.watch`
  only executes its answer.

Runs on whichever thread calls it (the watcher thread); it holds no lock and is not
shared between threads.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

INITIAL_DELAY = 1.0
MAX_DELAY = 30.0
FACTOR = 2.0
JITTER = 0.25


class Backoff:
    """1 s -> doubling -> 30 s cap, each delay plus up to 25% jitter."""

    def __init__(
        self,
        rng: random.Random | None = None,
        *,
        initial: float = INITIAL_DELAY,
        maximum: float = MAX_DELAY,
        factor: float = FACTOR,
        jitter: float = JITTER,
    ) -> None:
        self._rng = rng if rng is not None else random.Random()
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self._base = initial

    def next_delay(self) -> float:
        """Return the next delay (base plus jitter) and advance the base."""
        base = self._base
        self._base = min(self._base * self.factor, self.maximum)
        return base * (1.0 + self._rng.random() * self.jitter)

    def reset(self) -> None:
        """Start again from the initial delay."""
        self._base = self.initial


# --- what the watch loop does next (pure) ------------------------------------------

LONG_WATCH_S = 30.0  # "a watch that stayed open for at least 30s"


class Ended(enum.Enum):
    """How the watch loop's last step ended."""

    LISTED = "listed"  # a list or re-list succeeded
    LIST_FAILED = "list failed"
    CLEAN = "clean"  # the watch stream ended without an error (also a dropped connection)
    GONE = "gone"  # 410 Gone, as an ERROR event or an HTTP status
    ERROR = "error"  # a failed Watch call or an ERROR event other than 410


@dataclass(frozen=True)
class WatchMemory:
    """What the next decision needs to remember of the steps before."""

    listed: bool = False  # the first list succeeded
    # The next watch is the re-watch right after a long watch closed without an error,
    # or (after a 410) the re-list follows a long watch or such a re-watch.
    after_long: bool = False


@dataclass(frozen=True)
class Next:
    list: bool  # True: (re-)list next; False: watch next
    wait: bool  # wait for the backoff's next delay first
    reset: bool  # restart the backoff from 1 s before that
    reason: str  # for the log line
    after_long: bool  # the step ended after a long watch (log context)


def next_step(memory: WatchMemory, ended: Ended, open_for: float = 0.0
              ) -> tuple[Next, WatchMemory]:
    """The spec's reconnect rule: the last step's outcome (and, for a watch, how long it
    was open) -> what to do next and what to remember. ``open_for`` is measured from the
    Watch call."""
    long_ = ended in (Ended.CLEAN, Ended.GONE, Ended.ERROR) and open_for >= LONG_WATCH_S
    if ended is Ended.LIST_FAILED:
        # A failed list waits for the backoff and retries.
        return Next(True, True, False, "list failed", memory.after_long), memory
    if ended is Ended.LISTED:
        if not memory.listed:
            return Next(False, False, False, "listed", False), WatchMemory(listed=True)
        # "After a successful re-list, the next watch starts at once if the 410 ended a
        # watch that was open for at least 30s, or hit the re-watch right after such a
        # watch closed without an error. Otherwise it waits for the backoff."
        wait = not memory.after_long
        return (Next(False, wait, False, "re-list after 410", memory.after_long),
                WatchMemory(listed=True))
    if ended is Ended.GONE:
        # "On 410 Gone (etcd compaction), performs a full re-list to rebuild the cache."
        after = memory.after_long or long_
        return Next(True, False, False, "410 Gone", after), WatchMemory(True, after)
    if ended is Ended.ERROR:
        # "Any other error after such a watch, except 410 Gone, starts the backoff from
        # 1s again."
        after = memory.after_long or long_
        return Next(False, True, after, "watch failed", after), WatchMemory(True, False)
    # CLEAN: "A watch that stayed open for at least 30s and then closed without an error
    # is re-opened immediately."
    if long_:
        return Next(False, False, False, "long watch ended", True), WatchMemory(True, True)
    return Next(False, True, False, "short watch ended", False), WatchMemory(True, False)
