"""The answering half of the health server's connection loop.

Owns what happens to a connection once its request head is complete: ``_answer`` runs
on a request thread (``health-http-request``), renders the answer through ``respond``
and sends what the socket takes without blocking; the loop thread (``health-http``)
then takes the connection back (``_take_back``), writes the rest (``_write``), and
either waits for the next request or half-closes and lingers (``_linger``,
``_discard``).

Mixed into :class:`extractedprism.health.conn.ConnectionLoop`, which sets the state in
``__init__`` and owns the selector, the deadlines and the connection tables.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from extractedprism.health.head import LINGER_S, REQUEST_TIMEOUT_S, Conn

# The connection loop's logger: these lines have always come from extractedprism.health.conn.
log = logging.getLogger("extractedprism.health.conn")


class AnswerStates:
    """Request threads, and the write and linger states of the loop thread."""

    # Set by ConnectionLoop.__init__.
    _respond: Callable[[Conn], tuple[bytes, bool]]
    _sel: selectors.BaseSelector
    _writing: collections.OrderedDict[int, Conn]
    _lingering: collections.OrderedDict[int, Conn]
    _busy: int
    _stop: threading.Event
    _lock: threading.Lock
    _returned: list[tuple[Conn, str]]
    _workers: set[threading.Thread]
    _closed: bool
    _wake_w: socket.socket

    # -- loop thread: answers ----------------------------------------------------

    def _take_back(self) -> None:
        with self._lock:
            returned, self._returned = self._returned, []
        for conn, outcome in returned:
            self._busy -= 1
            if outcome == "write":
                # The write deadline counts from the answer, as the request deadline did.
                conn.deadline = time.monotonic() + REQUEST_TIMEOUT_S
                self._writing[conn.sock.fileno()] = conn
                self._sel.register(conn.sock, selectors.EVENT_WRITE, "writing")
            elif outcome == "sent":
                self._answered(conn)
            else:
                self._close(conn)

    def _answered(self, conn: Conn) -> None:
        if self._stop.is_set():
            self._close(conn)  # shutting down: no next request, and no lingering either
        elif conn.keep:
            conn.head, conn.oversized = b"", False
            self._await_request(conn)
        else:
            self._linger(conn)

    def _write(self, conn: Conn | None) -> None:
        if conn is None:
            return
        try:
            conn.out = conn.out[conn.sock.send(conn.out):]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("health answer not delivered client=%s error=%r", conn.client, exc)
            self._close(conn)
            return
        if not conn.out:
            self._forget(conn)
            self._answered(conn)

    def _linger(self, conn: Conn) -> None:
        # Closing with unread request bytes in the kernel would send a RST, and the
        # client could lose the answer still in flight; so half-close and read until the
        # client closes too, for a little while.
        self._forget(conn)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.deadline = time.monotonic() + LINGER_S
        self._lingering[conn.sock.fileno()] = conn
        self._sel.register(conn.sock, selectors.EVENT_READ, "linger")

    def _discard(self, conn: Conn | None) -> None:
        if conn is None:
            return
        try:
            if conn.sock.recv(65536):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close(conn)

    # -- request threads -------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already awake (buffer full) or shut down

    def _answer(self, conn: Conn) -> None:
        outcome = "close"
        try:
            data, conn.keep = self._respond(conn)
            if data:
                # Never block here: a client that does not read would hold this thread
                # for the whole write deadline, and enough of them would starve probes.
                out = memoryview(data)
                try:
                    while out:
                        out = out[conn.sock.send(out):]
                except (BlockingIOError, InterruptedError):
                    pass
                conn.out = out
                outcome = "write" if out else "sent"
        except OSError as exc:
            # The client reset, closed or stopped reading: nothing to answer any more.
            log.debug("health answer not delivered client=%s error=%r", conn.client, exc)
        except Exception:
            log.exception("health request failed client=%s", conn.client)
        finally:
            with self._lock:
                self._workers.discard(threading.current_thread())
                if self._closed:
                    conn.sock.close()
                else:
                    self._returned.append((conn, outcome))
            self._wake()
