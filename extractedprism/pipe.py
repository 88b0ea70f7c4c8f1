"""Pipe: the two-way byte copy for one client/upstream pair, run by one pipe thread.

# design
One thread serves both directions of a connection: both sockets are non-blocking and
the thread sleeps in ``poll`` (GIL released) until either side can move. Compared with
a thread per direction this halves the threads (memory, GIL hand-offs) and cannot
deadlock when both peers write at once, because no direction ever blocks the other.

Bytes move with ``os.splice`` through a kernel pipe where available (no copy through
Python objects), else with ``recv_into``/``send`` on a small reused buffer. A splice
failure that is not about the peer (EINVAL on an odd socket type, no spare fds for the
pipe) switches the connection to the buffer path; the bytes already in the kernel
pipe are flushed first, so nothing is lost or reordered.

Half-close: EOF from one side is passed on with ``shutdown(SHUT_WR)`` once everything
read before it was written; the other direction keeps flowing. A reset or error on
either side ends both (the surviving peer gets a reset too, via SO_LINGER 0).
:meth:`Pipe.close` may be called from any thread (drain, readiness, shutdown): it shuts
both sockets down, which wakes the poll; only the pipe thread closes file descriptors.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
SMALL_CHUNK = 16 * 1024
HAVE_SPLICE = hasattr(os, "splice") and hasattr(os, "pipe2")
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
# Pipe mode chosen by the operator for debugging ("splice" | "buffer").
MODE = os.environ.get("EP_PIPE_MODE", "splice" if HAVE_SPLICE else "buffer")

_EXPECTED = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT,
             errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBADF)
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP
_LINGER_RST = struct.pack("ii", 1, 0)

_local = threading.local()


def _thread_buffer() -> bytearray:
    """One read buffer per pipe thread, reused across its connections.

    Allocated at the first byte this thread copies in buffer mode, so idle threads and
    splice-mode threads never touch it (it would cost 16-64 KiB of RSS each).
    """
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(SMALL_CHUNK)
    return buf


def _thread_pipes() -> list[tuple[int, int]] | None:
    """Two kernel pipes per pipe thread (one per direction), reused across connections."""
    pipes = getattr(_local, "pipes", None)
    if pipes is None:
        try:
            pipes = [os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC) for _ in range(2)]
        except OSError as exc:  # EMFILE/ENFILE: degrade to the buffer path
            log.debug("no kernel pipe for splice reason=%r; using buffer copy", exc.strerror)
            return None
        _local.pipes = pipes
    return pipes


def _drop_thread_pipes() -> None:
    pipes = getattr(_local, "pipes", None)
    if pipes:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    _local.pipes = None


class _Half:
    """One direction: src -> dst, with what has been read but not yet written."""

    __slots__ = ("dst", "dst_fd", "eof", "name", "pending", "pipe", "shut", "src", "src_fd",
                 "tail")

    def __init__(self, name: str, src: socket.socket, dst: socket.socket) -> None:
        self.name = name
        self.src, self.dst = src, dst
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.pending = 0  # bytes waiting in the kernel pipe (splice mode)
        self.tail = b""  # bytes waiting in user space (buffer mode)
        self.eof = False
        self.shut = False
        self.pipe: tuple[int, int] | None = None

    @property
    def done(self) -> bool:
        return self.shut

    def wants(self) -> tuple[int, int]:
        """(fd, events) this half waits for, or (-1, 0) when it waits for nothing."""
        if self.shut:
            return -1, 0
        if self.pending or self.tail:
            return self.dst_fd, select.POLLOUT
        return self.src_fd, select.POLLIN


class Pipe:
    """Copies bytes both ways between ``client`` and ``upstream`` until both are done."""

    def __init__(self, client: socket.socket, upstream: socket.socket, *, client_addr: str,
                 upstream_addr: str, mode: str | None = None) -> None:
        self.client_sock = client
        self.upstream_sock = upstream
        self.client = client_addr
        self.upstream = upstream_addr
        self.started = time.time()
        self.bytes_up = 0  # client -> upstream
        self.bytes_down = 0  # upstream -> client
        self._closed = False
        self._mode = mode or MODE

    # -- called from other threads -------------------------------------------------

    def close(self) -> None:
        """Force-close from any thread: wakes the pipe thread, which then cleans up."""
        self._closed = True
        for sock in (self.client_sock, self.upstream_sock):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- the pipe thread ------------------------------------------------------------

    def run(self) -> None:
        """Copy until both directions finish, an error occurs, or close() is called."""
        c, u = self.client_sock, self.upstream_sock
        c.setblocking(False)
        u.setblocking(False)
        up = _Half("up", c, u)
        down = _Half("down", u, c)
        if self._mode == "splice":
            pipes = _thread_pipes()
            if pipes is not None:
                up.pipe, down.pipe = pipes[0], pipes[1]
        poller = select.poll()
        registered: dict[int, int] = {}
        reset = False
        try:
            while not self._closed and not (up.done and down.done):
                want: dict[int, int] = {}
                for half in (up, down):
                    fd, ev = half.wants()
                    if fd >= 0:
                        want[fd] = want.get(fd, 0) | ev
                for fd in list(registered):
                    if fd not in want:
                        poller.unregister(fd)
                        del registered[fd]
                for fd, ev in want.items():
                    if registered.get(fd) != ev:
                        if fd in registered:
                            poller.modify(fd, ev)
                        else:
                            poller.register(fd, ev)
                        registered[fd] = ev
                events = poller.poll()
                if self._closed:
                    break
                ready = {fd for fd, _ in events}
                for half in (up, down):
                    fd, _ = half.wants()
                    if fd in ready:
                        self._pump(half)
        except OSError as exc:
            reset = True
            if exc.errno in _EXPECTED:
                log.debug("connection ended client=%s upstream=%s reason=%r", self.client,
                          self.upstream, exc.strerror)
            else:
                log.warning("connection failed client=%s upstream=%s error=%r", self.client,
                            self.upstream, exc)
        finally:
            self._finish(up, down, reset or self._closed)

    def _pump(self, h: _Half) -> None:
        """Move as much as possible in direction ``h`` without blocking."""
        while True:
            if (h.pending or h.tail) and not self._flush(h):
                return  # dst is full: wait for POLLOUT
            if h.eof:
                # Everything read before EOF has been written: pass the half-close on.
                try:
                    h.dst.shutdown(socket.SHUT_WR)
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN:
                        raise
                h.shut = True
                return
            n = self._read(h)
            if n is None:
                return  # nothing more to read now
            if n == 0:
                h.eof = True
                continue
            if h.name == "up":
                self.bytes_up += n
            else:
                self.bytes_down += n

    def _read(self, h: _Half) -> int | None:
        if h.pipe is not None:
            try:
                n = os.splice(h.src_fd, h.pipe[1], CHUNK, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return None
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    log.debug("splice unsupported here reason=%r; using buffer copy",
                              exc.strerror)
                    h.pipe = None  # nothing pending: safe to switch now
                    return self._read(h)
                raise
            h.pending += n
            return n
        buf = _thread_buffer()
        try:
            n = h.src.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return None
        if n:
            h.tail = bytes(buf[:n])
        return n

    @staticmethod
    def _flush(h: _Half) -> bool:
        """Write pending bytes; True when all are out."""
        if h.pipe is not None:
            while h.pending:
                try:
                    n = os.splice(h.pipe[0], h.dst_fd, h.pending, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    return False
                h.pending -= n
            return True
        while h.tail:
            try:
                n = h.dst.send(h.tail)
            except (BlockingIOError, InterruptedError):
                return False
            h.tail = h.tail[n:]
        return True

    def _finish(self, up: _Half, down: _Half, abort: bool) -> None:
        if abort:
            # Propagate the reset so neither peer waits on a half-dead connection.
            for sock in (self.client_sock, self.upstream_sock):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                except OSError:
                    pass
        if up.pending or down.pending:
            # Bytes left in the thread's kernel pipes would leak into the next connection.
            _drop_thread_pipes()
        self.client_sock.close()
        self.upstream_sock.close()
