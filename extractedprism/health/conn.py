"""The HTTP/1.x connection loop under the health server: many waiting clients, few threads.

One thread (``health-http``) owns the listener and every connection that is waiting for
a request. It reads request heads without blocking, under one selector, so a client that
trickles its request or sends nothing costs a descriptor and a small buffer, not a
thread. Only a complete request head goes to a request thread (``health-http-request``,
at most ``MAX_REQUEST_THREADS`` at once), which renders the answer through the
``respond`` callable, sends what the socket takes without blocking, and hands the
connection back: the loop writes the rest, if any, then waits for the next request. So
a client that stops reading holds a descriptor and its answer, never a request thread.
Limits, all enforced by the loop thread:

* the whole request head must arrive within ``REQUEST_TIMEOUT_S`` of the connection (or
  of the previous answer on a keep-alive connection), however slowly its bytes come;
  a client that sent part of a request then gets 408, a silent one is just closed;
* an answer must be written within ``REQUEST_TIMEOUT_S`` too, else the connection closes;
* a head is at most ``MAX_HEAD_BYTES`` (the request thread answers 414 or 431);
* at most ``MAX_CONNECTIONS`` connections are open; a new one displaces the oldest that
  is still waiting for its request, so a flood cannot lock out a well-behaved probe;
* after the last answer on a connection, the loop half-closes it and discards what the
  client still sends for up to ``LINGER_S``, so unread request bytes do not turn the
  close into a reset that destroys the answer in flight.

The request head and its parser live in head.py; the request threads and the
hand-back of their connections in answer.py (:class:`RequestThreads`, owned here).
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from extractedprism.config.endpoints import is_ip
from extractedprism.errors import FD_ERRNOS
from extractedprism.health.answer import RequestThreads
from extractedprism.health.head import (
    LINGER_S,
    MAX_HEAD_BYTES,
    REQUEST_TIMEOUT_S,
    Conn,
    take_head,
)
from extractedprism.threads import join_until

log = logging.getLogger(__name__)

MAX_REQUEST_THREADS = 64
MAX_CONNECTIONS = 512
_ACCEPT_PAUSE_S = 0.2


class ConnectionLoop:
    """Owns a listening socket, the loop thread and its request threads.

    ``respond(conn)`` runs on a request thread and returns the bytes to send and whether
    the connection may carry another request. ``timeout_answer`` is sent to a client whose
    request head is still incomplete at the deadline. Binds at construction, so a port
    clash fails before any thread starts.
    """

    def __init__(self, host: str, port: int, respond: Callable[[Conn], tuple[bytes, bool]],
                 *, timeout_answer: bytes, name: str = "health-http",
                 listener: socket.socket | None = None) -> None:
        self._timeout_answer = timeout_answer
        self._name = name
        if listener is not None:
            # Taken over from the instance this one replaces (handover.py): already
            # bound and listening, and shared with it until it stops accepting.
            self._listener = listener
        else:
            family = socket.AF_INET6 if is_ip(host) and ":" in host else socket.AF_INET
            self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            if listener is None:
                self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listener.bind((host, port))
                # A deep backlog: with the stdlib's 5, a burst of connections made the
                # kernel drop SYNs, and a probe caught behind them waited for a 1 s
                # retransmit.
                self._listener.listen(socket.SOMAXCONN)
            self._listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:
            self._listener.close()
            raise
        self._stop_accepting = threading.Event()
        host_, port_ = self._listener.getsockname()[:2]
        # Kept: the listener may be closed later (handed over, shut down).
        self._address = (str(host_), int(port_))
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        # Waiting for (the rest of) a request head, oldest deadline first.
        self._reading: collections.OrderedDict[int, Conn] = collections.OrderedDict()
        # Answer partly written, waiting for the client to read; oldest deadline first.
        self._writing: collections.OrderedDict[int, Conn] = collections.OrderedDict()
        # Answered for the last time: waiting for the client's FIN, oldest first.
        self._lingering: collections.OrderedDict[int, Conn] = collections.OrderedDict()
        self._queued: collections.deque[Conn] = collections.deque()  # head complete
        self._requests = RequestThreads(respond, name=name + "-request", wake=self._wake)
        self._accept_paused_until = 0.0
        self._full = False
        self._stop = threading.Event()
        self._stop_deadline = 0.0
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def start(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(name=self._name, target=self._serve, daemon=True)
        self._thread.start()

    @property
    def listener(self) -> socket.socket:
        """The listening socket (to offer to a successor; never to accept on)."""
        return self._listener

    def stop_accepting(self) -> None:
        """A successor accepts on the shared listener now: stop accepting, close this
        process's copy of it (the successor holds its own), keep serving the
        connections already open."""
        self._stop_accepting.set()
        if self._thread is None:
            self._listener.close()
        else:
            self._wake()

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop accepting, close idle connections, give running answers until
        ``timeout`` to finish; True when every thread is gone."""
        deadline = time.monotonic() + timeout
        self.begin_shutdown(deadline)
        return self.wait_stopped(deadline)

    def begin_shutdown(self, deadline: float) -> None:
        """Start the graceful shutdown, with answers in progress given until
        ``deadline`` (monotonic); does not wait."""
        self._stop_deadline = deadline
        self._stop.set()
        if self._thread is not None:
            self._wake()
        else:
            self._close_all()

    def wait_stopped(self, deadline: float) -> bool:
        """Wait until ``deadline`` for the loop and request threads; True when all are
        gone. Each one still running is logged once and abandoned (they are daemons)."""
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        return join_until([self._thread, *self._requests.running()], deadline)

    # -- the loop thread ------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(self._next_timeout()):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif key.data == "reading":
                        self._read(self._reading.get(key.fd))
                    elif key.data == "writing":
                        self._write(self._writing.get(key.fd))
                    else:
                        self._discard(self._lingering.get(key.fd))
                if self._stop_accepting.is_set() and self._listener.fileno() >= 0:
                    self._unlisten()
                self._take_back()
                self._expire(time.monotonic())
                self._dispatch()
            self._finish()
        except Exception:
            # Logged, not raised: the thread's end shows in /healthz probes timing out.
            log.exception("health server loop failed")
        finally:
            self._close_all()

    def _unlisten(self) -> None:
        # close(), never shutdown(): the listening socket may be shared with a
        # successor, and shutdown() would stop it accepting too.
        try:
            self._sel.unregister(self._listener)
        except (KeyError, ValueError):
            pass  # accepts were paused, or already closed
        self._accept_paused_until = 0.0
        self._listener.close()

    def _finish(self) -> None:
        """Shutdown: no new connections or requests, but answers being rendered or
        written get until the shutdown deadline to reach their clients."""
        self._unlisten()
        for conn in [*self._reading.values(), *self._lingering.values(), *self._queued]:
            self._close(conn)
        self._queued.clear()
        while self._writing or self._requests.busy:
            now = time.monotonic()
            if now >= self._stop_deadline:
                return
            for key, _ in self._sel.select(min(self._next_timeout(),
                                               self._stop_deadline - now)):
                if key.data == "writing":
                    self._write(self._writing.get(key.fd))
                elif key.data == "wake":
                    self._drain_wake()
            self._take_back()
            self._expire(time.monotonic())

    def _next_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [now + 1.0]
        for waiting in (self._reading, self._writing, self._lingering):
            if waiting:
                deadlines.append(next(iter(waiting.values())).deadline)
        if self._accept_paused_until > 0:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - now)

    def _open_count(self) -> int:
        return (len(self._reading) + len(self._writing) + len(self._lingering)
                + len(self._queued) + self._requests.busy)

    def _accept(self) -> None:
        for _ in range(64):  # then serve the connections already open, then accept more
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in FD_ERRNOS:
                    # The connection stays in the backlog, so the selector would report
                    # it again at once: pause accepting instead of spinning a CPU.
                    if not self._accept_paused_until:
                        log.warning("health server accept failed; pausing accepts until "
                                    "descriptors free up error=%r", exc.strerror)
                    self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                    self._sel.unregister(self._listener)
                elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("health server accept failed error=%r", exc.strerror)
                return
            if self._accept_paused_until < 0:
                self._accept_paused_until = 0.0
                log.info("health server accepts again")
            self._admit(Conn(sock, str(addr[0])))

    def _admit(self, conn: Conn) -> None:
        if self._open_count() >= MAX_CONNECTIONS:
            oldest = self._lingering or self._writing or self._reading
            if not oldest:
                conn.sock.close()  # every slot is answering a complete request
                return
            self._close(next(iter(oldest.values())))
            if not self._full:
                self._full = True
                log.warning("health server connection limit reached; dropping the oldest "
                            "waiting connections max_connections=%d", MAX_CONNECTIONS)
        elif self._full and self._open_count() < MAX_CONNECTIONS // 2:
            self._full = False
            log.info("health server connections below the limit again")
        conn.sock.setblocking(False)
        self._await_request(conn)

    def _await_request(self, conn: Conn) -> None:
        conn.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        if take_head(conn):
            self._queued.append(conn)
            return
        self._reading[conn.sock.fileno()] = conn
        self._sel.register(conn.sock, selectors.EVENT_READ, "reading")

    def _read(self, conn: Conn | None) -> None:
        if conn is None:
            return
        try:
            data = conn.sock.recv(min(16384, MAX_HEAD_BYTES + 1 - len(conn.buf)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("health client gone client=%s error=%r", conn.client, exc.strerror)
            self._close(conn)
            return
        if not data:
            conn.eof = True
            if not conn.buf.strip():
                self._close(conn)
                return
        conn.buf += data
        if take_head(conn):
            del self._reading[conn.sock.fileno()]
            self._sel.unregister(conn.sock)
            self._queued.append(conn)

    def _expire(self, now: float) -> None:
        for waiting in (self._reading, self._writing, self._lingering):
            while waiting and (conn := next(iter(waiting.values()))).deadline <= now:
                if waiting is self._reading and conn.buf.strip():
                    log.debug("health request timed out client=%s received=%d", conn.client,
                              len(conn.buf))
                    try:
                        conn.sock.send(self._timeout_answer)  # best effort: never blocks
                    except OSError:
                        pass
                    self._linger(conn)
                else:
                    if waiting is self._writing:
                        log.debug("health answer not delivered within %gs client=%s "
                                  "unsent=%d", REQUEST_TIMEOUT_S, conn.client,
                                  len(conn.out))
                    self._close(conn)
        if 0 < self._accept_paused_until <= now:
            self._accept_paused_until = -1.0  # resumed; logged once accept succeeds
            self._sel.register(self._listener, selectors.EVENT_READ, "listener")

    def _dispatch(self) -> None:
        while self._queued and self._requests.busy < MAX_REQUEST_THREADS:
            conn = self._queued.popleft()
            if not self._requests.start(conn):
                log.warning("could not start a health request thread; closing client=%s",
                            conn.client)
                self._close(conn)
                return

    # -- the loop thread: answers handed back ------------------------------------------

    def _take_back(self) -> None:
        for conn, outcome in self._requests.take_back():
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

    # -- connections and wake-ups ----------------------------------------------------

    def _forget(self, conn: Conn) -> None:
        fd = conn.sock.fileno()
        if (self._reading.pop(fd, None) is not None or self._writing.pop(fd, None)
                or self._lingering.pop(fd, None)):
            self._sel.unregister(conn.sock)

    def _close(self, conn: Conn) -> None:
        self._forget(conn)
        conn.sock.close()

    def _wake(self) -> None:
        # Any thread: request threads, stop_accepting(), begin_shutdown().
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already awake (buffer full) or shut down

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _close_all(self) -> None:
        returned = self._requests.close()
        for conn in [*self._reading.values(), *self._writing.values(),
                     *self._lingering.values(), *self._queued, *returned]:
            conn.sock.close()
        self._reading.clear()
        self._writing.clear()
        self._lingering.clear()
        self._queued.clear()
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
