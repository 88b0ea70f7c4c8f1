"""Reaper: sockets kept off a client's path until they finish, all on one thread.

A client connection sometimes starts two attempts and uses one: a hedged dial
(dialer.py) or a hedged first answer (first_answer.py). The other attempt is not
abandoned, since its outcome is the news about its upstream (a dial that never
connects, an upstream that never answers). It is parked here instead of holding the
pipe thread: one thread per kind waits on every parked socket in one ``poll`` until it
is ready or its deadline passes, then tells the item (``finish``), which records the
outcome and closes the socket. The thread exits after ``IDLE_S`` with nothing parked, so
a proxy at rest has exactly the threads it started with; the next park starts another.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Protocol

from extractedprism.threads import join_until

log = logging.getLogger(__name__)

IDLE_S = 2.0  # the thread exits after this long with nothing parked


class Parked(Protocol):
    """A socket waiting off the client's path."""

    sock: socket.socket | None
    deadline: float  # time.monotonic(): finish(False) then
    events: int  # what it waits for (poll events)

    def finish(self, ready: bool) -> None:
        """Ready (an event) or not (the deadline passed): record, close, release."""

    def drop(self) -> None:
        """Shutdown: close and release, recording nothing."""


class Reaper:
    """Parked sockets, run to their end on one thread named ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._new: list[Parked] = []
        self._cancelled: list[Parked] = []  # cancel(): dropped by the loop
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopped = False

    def adopt(self, item: Parked) -> None:
        """Park ``item``. Never raises: where the thread or its wake-up pipe cannot be
        had (out of descriptors, of threads), the item is dropped (closed, released, its
        outcome not recorded), so a failure to park costs the client nothing."""
        with self._lock:
            if self._stopped:
                self._drop(item)
                return
            if self._thread is None and not self._start_locked():
                self._drop(item)
                return
            self._new.append(item)
            self._poke_locked()

    def cancel(self, item: Parked) -> None:
        """Drop ``item`` (closed, released, its outcome not recorded) if it is still
        parked: its client needs the slot (first_answer's hedge: at most two attempts
        per client in flight). Nothing if it has finished already."""
        with self._lock:
            if item in self._new:
                self._new.remove(item)
            elif self._thread is not None:
                self._cancelled.append(item)
                self._poke_locked()
                return
            else:
                return
        self._drop(item)

    def _start_locked(self) -> bool:
        """Start the thread (and its wake-up pipe); False when either cannot be had."""
        try:
            wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot park a socket off the client's path; closing it "
                        "reaper=%s error=%r", self._name, exc.strerror)
            return False
        thread = threading.Thread(name=self._name, target=self._loop, daemon=True)
        self._wake_r, self._wake_w = wake
        self._thread = thread
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread"
            self._thread = None
            self._wake_r = self._wake_w = -1
            os.close(wake[0])
            os.close(wake[1])
            log.warning("cannot park a socket off the client's path; closing it "
                        "reaper=%s error=%r", self._name, str(exc))
            return False
        return True

    @staticmethod
    def _drop(item: Parked) -> None:
        try:
            item.drop()
        except Exception:  # closing must never reach the client's path
            log.exception("dropping a parked socket failed")

    def _poke_locked(self) -> None:
        # Under the lock: the loop closes the pipe under it too, so this never writes
        # to a closed (or reused) descriptor.
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # full: the loop wakes anyway

    def stop(self, deadline: float) -> bool:
        """Stop (parked sockets are dropped, not recorded) and wait for the thread until
        ``deadline`` (``time.monotonic()``), the shutdown's one deadline."""
        with self._lock:
            self._stopped = True
            t = self._thread
            self._poke_locked()
        return join_until([t] if t is not None else [], deadline)

    def _loop(self) -> None:
        with self._lock:
            wake_r, wake_w = self._wake_r, self._wake_w  # this thread's; closed at its end
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        items: dict[int, Parked] = {}
        try:
            while True:
                with self._lock:
                    stopped = self._stopped
                    new, self._new = self._new, []
                    cancelled, self._cancelled = self._cancelled, []
                for item in cancelled:
                    fd = next((f for f, i in items.items() if i is item), None)
                    if fd is not None:
                        del items[fd]
                        poller.unregister(fd)
                        self._drop(item)
                for item in new:
                    try:
                        assert item.sock is not None
                        fd = item.sock.fileno()
                        poller.register(fd, item.events)
                    except Exception:  # one bad item must not end the reaper
                        log.exception("parking a socket failed")
                        self._drop(item)
                        continue
                    items[fd] = item
                if stopped:
                    return
                now = time.monotonic()
                wake = min((i.deadline for i in items.values()), default=now + IDLE_S)
                events = poller.poll(max(0, (wake - now) * 1000 + 1))
                for fd, _ in events:
                    if fd == wake_r:
                        try:
                            os.read(wake_r, 512)
                        except BlockingIOError:
                            pass
                        continue
                    poller.unregister(fd)
                    self._finish(items.pop(fd), True)
                now = time.monotonic()
                for fd, item in list(items.items()):
                    if now >= item.deadline:
                        del items[fd]
                        poller.unregister(fd)
                        self._finish(item, False)
                if not items and not events:
                    with self._lock:
                        if not self._new:
                            self._thread = None
                            self._wake_r = self._wake_w = -1
                            return
        except Exception:
            # A bug must not leave the reaper marked running with nobody to run it: the
            # sockets it held are dropped below, and the next one parked starts afresh.
            log.exception("reaper failed reaper=%s", self._name)
        finally:
            for item in items.values():  # shutdown (or a failure): not counted
                self._drop(item)
            with self._lock:
                if self._stopped:
                    for item in self._new:
                        self._drop(item)
                    self._new = []
                if self._wake_r == wake_r:
                    self._wake_r = self._wake_w = -1
                os.close(wake_r)
                os.close(wake_w)
                if self._thread is threading.current_thread():
                    self._thread = None
                    # Parked while this thread failed: a fresh thread takes them.
                    if self._new and not (not self._stopped and self._start_locked()):
                        for item in self._new:
                            self._drop(item)
                        self._new = []
                    self._poke_locked()

    @staticmethod
    def _finish(item: Parked, ready: bool) -> None:
        try:
            item.finish(ready)
        except Exception:  # recording must never end the reaper
            log.exception("finishing a parked socket failed")
            Reaper._drop(item)
