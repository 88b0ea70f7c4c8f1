"""The request threads of the health server's connection loop (``health-http-request``).

:class:`RequestThreads` owns the threads that answer complete request heads and the
hand-back of their connections to the loop thread (``health-http``): a request thread
renders the answer through ``respond``, sends what the socket takes without blocking,
queues the connection with its outcome and wakes the loop, which takes it back
(:meth:`RequestThreads.take_back`) and writes the rest, waits for the next request or
lingers. The loop owns the selector, the deadlines and the connection tables
(:class:`extractedprism.health.conn.ConnectionLoop`); this object only the state the
two kinds of thread share, under its own lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from extractedprism.health.head import Conn

log = logging.getLogger(__name__)

# What a request thread did with its connection: answer partly sent ("write": the loop
# writes the rest), answer sent in full ("sent"), or nothing more to do ("close").
Outcome = Literal["write", "sent", "close"]


class RequestThreads:
    """The running request threads and the connections they hand back.

    ``busy`` (threads started and not yet taken back) is the loop thread's alone; the
    hand-back list, the thread set and ``closed`` are shared, under ``_lock``.
    """

    def __init__(self, respond: Callable[[Conn], tuple[bytes, bool]], *, name: str,
                 wake: Callable[[], None]) -> None:
        self._respond = respond
        self._name = name
        self._wake = wake  # wakes the loop thread; never blocks
        self.busy = 0
        self._lock = threading.Lock()  # guards _returned, _closed, _workers
        self._returned: list[tuple[Conn, Outcome]] = []
        self._workers: set[threading.Thread] = set()
        self._closed = False

    def start(self, conn: Conn) -> bool:
        """Answer ``conn`` on a new request thread (loop thread); False when no thread
        could be started, and the connection is the caller's again."""
        t = threading.Thread(name=self._name, target=self._answer, args=(conn,),
                             daemon=True)
        with self._lock:
            self._workers.add(t)
        self.busy += 1
        try:
            t.start()
        except RuntimeError:
            with self._lock:
                self._workers.discard(t)
            self.busy -= 1
            return False
        return True

    def take_back(self) -> list[tuple[Conn, Outcome]]:
        """The connections handed back since the last call (loop thread)."""
        with self._lock:
            returned, self._returned = self._returned, []
        self.busy -= len(returned)
        return returned

    def close(self) -> list[Conn]:
        """From now on a request thread closes its connection itself when done; returns
        the connections handed back but not taken, for the caller to close."""
        with self._lock:
            self._closed = True
            returned, self._returned = self._returned, []
        return [conn for conn, _ in returned]

    def running(self) -> list[threading.Thread]:
        with self._lock:
            return list(self._workers)

    def _answer(self, conn: Conn) -> None:
        outcome: Outcome = "close"
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
