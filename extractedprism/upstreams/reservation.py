"""Reservation: a picked upstream counted as a dial in flight, until attach or release.

Least-conn counts dials in flight, so concurrent picks see each other. The count is a
value the pipe thread holds (issue 12 item 11): ``Picks.reserve()`` and
``Picks.reserve_endpoint()`` (panic mode) make one, ``Connections.attach()`` ends it, and
as a context manager it is released on every other path, an exception's included.
"""

from __future__ import annotations

import threading
from typing import Protocol

from extractedprism.config.endpoints import Endpoint


class Counted(Protocol):
    """What a reservation needs of the registry's record (its in-flight dial count)."""

    endpoint: Endpoint
    dialing: int


class Reservation:
    """Releasing twice, or after attach, does nothing."""

    __slots__ = ("_lock", "_rec", "address", "alone", "dial_seconds", "endpoint", "first",
                 "panic", "rivals", "sent", "stalled")

    def __init__(self, lock: threading.RLock, rec: Counted, address: str, *,
                 panic: bool = False, alone: bool = False) -> None:
        self._lock = lock  # the registry's
        self.panic = panic  # chosen by panic mode, not by selection
        # No other upstream (not excluded) was pickable when this one was reserved: a
        # connection it fails to serve has nowhere else to go.
        self.alone = alone
        self.dial_seconds: float | None = None  # the successful dial's duration (attach)
        # The client's first bytes, when the dial itself took them and sent ``sent`` of
        # them on (Dialer.connect's take_first_from); None: not taken.
        self.first: bytes | None = None
        self.sent = 0
        self.stalled = False  # this dial has stalled (Picks.stall_dial)
        # The dials this one won against, left to run on off the client's path (the
        # Dialer's reaper): while one is in flight the client has two attempts out, so
        # the first answer's hedge cancels it before it dials (datapath.first_answer).
        self.rivals: tuple[object, ...] = ()
        self._rec: Counted | None = rec  # the record counted, even if replaced since
        self.address = address
        self.endpoint = rec.endpoint

    @property
    def held(self) -> bool:
        """Still counted: neither attached nor released."""
        return self._rec is not None

    def take_locked(self) -> None:
        """End the reservation; the caller holds the registry lock."""
        rec, self._rec = self._rec, None
        if rec is not None and rec.dialing > 0:
            rec.dialing -= 1

    def release(self) -> None:
        if self._rec is not None:
            with self._lock:
                self.take_locked()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
