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

from extractedprism import gilcall

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
BUFFER_SIZE = 32 * 1024  # buffer path only; its pages count against RSS per thread
HAVE_SPLICE = hasattr(os, "splice") and hasattr(os, "pipe2")
# Pipe mode chosen by the operator for debugging ("splice" | "buffer").
MODE = os.environ.get("EP_PIPE_MODE", "splice" if HAVE_SPLICE else "buffer")

_EXPECTED = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT,
             errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBADF)
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP
_LINGER_RST = struct.pack("ii", 1, 0)

_local = threading.local()


# The hot-path syscalls. By default they are the stdlib's, which release the GIL around
# each call. EP_SYSCALLS=gil (keep the GIL for every non-blocking call, through gilcall)
# and EP_SYSCALLS=in (keep it only for the read into the kernel pipe) are for
# experiments: both measured slower with 64 keep-alive connections (more forced GIL
# switches: 5-7 context switches per request against 3) and no faster for new
# connections (docs/performance.md).
_POLICY = os.environ.get("EP_SYSCALLS", "std") if gilcall.AVAILABLE else "std"
# Both splice flavours raise BlockingIOError when they would block.
if _POLICY == "std":
    _splice_in = _splice_out = gilcall.os_splice
    _shutdown_write = gilcall.std_shutdown_write
    _close = gilcall.std_close
else:
    _splice_in = gilcall.splice
    _splice_out = gilcall.splice if _POLICY == "gil" else gilcall.os_splice
    _shutdown_write = gilcall.shutdown_write
    _close = gilcall.close
# Once per connection, for the accepted socket (dialed ones are non-blocking from birth).
_set_nonblocking = (gilcall.set_nonblocking if gilcall.AVAILABLE
                    else gilcall.std_set_nonblocking)


def _thread_buffer() -> bytearray:
    """One read buffer per pipe thread, reused across its connections.

    Allocated at the first byte this thread copies in buffer mode, so idle threads and
    splice-mode threads never touch it (it costs its size in RSS once touched).
    """
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(BUFFER_SIZE)
    return buf


def _thread_pipes() -> list[tuple[int, int]] | None:
    """Two kernel pipes per pipe thread (one per direction), reused across connections.

    Made at the thread's first spliced connection, so parked threads that never served
    one cost no descriptors (the LIFO pool keeps most of them cold).
    """
    pipes = getattr(_local, "pipes", None)
    if pipes is None:
        try:
            pipes = [os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC) for _ in range(2)]
        except OSError as exc:  # EMFILE/ENFILE: degrade to the buffer path
            log.debug("no kernel pipe for splice reason=%r; using buffer copy", exc.strerror)
            return None
        _local.pipes = pipes
    return pipes


def release_thread_resources() -> None:
    """Close this thread's kernel pipes (a pipe thread calls it when it exits)."""
    _drop_thread_pipes()


def _drop_thread_pipes() -> None:
    pipes = getattr(_local, "pipes", None)
    if pipes:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    _local.pipes = None


class _Half:
    """One direction, src -> dst: what was read but not yet written, and EOF state."""

    __slots__ = ("dst", "dst_fd", "eof", "pending", "pipe_r", "pipe_w", "shut", "src",
                 "src_fd", "tail", "up")

    def __init__(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.src, self.dst = src, dst
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.up = up  # client -> upstream
        self.pipe_r = self.pipe_w = -1  # kernel pipe (splice mode), else -1
        self.pending = 0  # bytes waiting in the kernel pipe
        self.tail = b""  # bytes waiting in user space (buffer mode)
        self.eof = False  # src said EOF
        self.shut = False  # EOF passed on to dst: this direction is finished

    @property
    def waiting(self) -> bool:
        """dst was full: wait for POLLOUT on dst, read nothing more from src meanwhile."""
        return bool(self.pending or self.tail)

    @property
    def reading(self) -> bool:
        return not (self.eof or self.pending or self.tail)


class Pipe:
    """Copies bytes both ways between ``client`` and ``upstream`` until both are done."""

    def __init__(self, client: socket.socket, upstream: socket.socket, *, client_addr: str,
                 upstream_addr: str, mode: str | None = None,
                 upstream_nonblocking: bool = False) -> None:
        self.client_sock = client
        self.upstream_sock = upstream
        self.client = client_addr
        self.upstream = upstream_addr
        self.started = time.time()
        self.bytes_up = 0  # client -> upstream
        self.bytes_down = 0  # upstream -> client
        self._closed = False
        # Who ended the connection and why (the debug "connection closed" line): the
        # first EOF's side, "proxy" for close(), or "error".
        self.ended_by = ""
        self.end_reason = ""
        self._mode = mode or MODE
        self._upstream_nonblocking = upstream_nonblocking

    # -- called from other threads -------------------------------------------------

    def close(self) -> None:
        """Force-close from any thread: wakes the pipe thread, which then cleans up."""
        self._closed = True
        if not self.ended_by:
            self.ended_by, self.end_reason = "proxy", "closed by extractedprism"
        for sock in (self.client_sock, self.upstream_sock):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- the pipe thread ------------------------------------------------------------

    def run(self) -> None:
        """Copy until both directions finish, an error occurs, or close() is called.

        Each readiness event costs one read and one write (and a GIL round trip each):
        after a short read the loop goes back to poll instead of reading until EAGAIN,
        because with many busy pipe threads every extra syscall is another GIL hand-off.
        """
        c, u = self.client_sock, self.upstream_sock
        _set_nonblocking(c)
        if not self._upstream_nonblocking:
            _set_nonblocking(u)
        up, down = _Half(c, u, True), _Half(u, c, False)
        if self._mode == "splice":
            pipes = _thread_pipes()
            if pipes is not None:
                (up.pipe_r, up.pipe_w), (down.pipe_r, down.pipe_w) = pipes
        cfd, ufd = up.src_fd, down.src_fd
        poller = select.poll()
        poller.register(cfd, _POLLIN)
        poller.register(ufd, _POLLIN)
        poll = poller.poll
        masks = {cfd: _POLLIN, ufd: _POLLIN}
        by_src = {cfd: up, ufd: down}
        by_dst = {ufd: up, cfd: down}
        reset = False
        try:
            while True:
                events = poll()
                if self._closed:
                    break
                dirty = False
                for fd, ev in events:
                    if ev & _POLLOUT:
                        out = by_dst[fd]
                        if out.pending or out.tail:
                            self._drain(out)
                            dirty = True
                    if not ev & _POLLIN:
                        continue
                    h = by_src[fd]
                    if h.eof or h.pending or h.tail:
                        continue
                    if self._read(h):
                        dirty = True
                if not dirty:
                    continue  # the common case: bytes moved, nothing else changed
                if up.shut and down.shut:
                    break
                for fd in (cfd, ufd):
                    want = (_POLLIN if by_src[fd].reading else 0) | (
                        _POLLOUT if by_dst[fd].waiting else 0)
                    if want != masks[fd]:
                        # An fd we need nothing from is unregistered, or its HUP/ERR
                        # would wake poll in a loop while the other direction finishes.
                        if not want:
                            poller.unregister(fd)
                        elif not masks[fd]:
                            poller.register(fd, want)
                        else:
                            poller.modify(fd, want)
                        masks[fd] = want
        except OSError as exc:
            reset = True
            if not self.ended_by:
                self.ended_by, self.end_reason = "error", exc.strerror or str(exc)
            if exc.errno in _EXPECTED:
                log.debug("connection ended client=%s upstream=%s reason=%r", self.client,
                          self.upstream, exc.strerror)
            else:
                log.warning("connection failed client=%s upstream=%s error=%r", self.client,
                            self.upstream, exc)
        finally:
            self._finish(up, down, reset or self._closed)

    def _read(self, h: _Half) -> bool:
        """Read what src has (until a short read), writing each chunk straight on.

        Returns True when the direction's state changed (EOF, or dst full), so the
        caller re-registers interest only then.
        """
        while True:
            if h.pipe_w >= 0:
                try:
                    n = _splice_in(h.src_fd, h.pipe_w, CHUNK)
                except BlockingIOError:
                    return False
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    # Nothing is pending (we only read when nothing is), so switching to
                    # the buffer path here loses and reorders nothing.
                    log.debug("splice unsupported reason=%r; using buffer copy", exc.strerror)
                    h.pipe_r = h.pipe_w = -1
                    continue
                if n:
                    # Counted as pending before the write: if the write raises, _finish
                    # must know the thread's pipe still holds bytes (or the next
                    # connection on this thread would receive them).
                    h.pending = n
                    try:
                        h.pending = n - _splice_out(h.pipe_r, h.dst_fd, n)
                    except BlockingIOError:
                        pass
                full = n == CHUNK
            else:
                buf = _thread_buffer()
                try:
                    n = h.src.recv_into(buf)
                except (BlockingIOError, InterruptedError):
                    return False
                full = n == len(buf)
                if n:
                    try:
                        sent = h.dst.send(memoryview(buf)[:n])
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    if sent < n:
                        h.tail = bytes(buf[sent:n])
            if n == 0:
                h.eof = True
                if not self.ended_by:
                    self.ended_by, self.end_reason = ("client" if h.up else "upstream"), "eof"
                self._pass_eof(h)
                return True
            if h.up:
                self.bytes_up += n
            else:
                self.bytes_down += n
            if (h.pending and not self._flush(h)) or h.tail:
                return True  # dst is full: wait for POLLOUT
            if not full:
                return False

    def _drain(self, h: _Half) -> None:
        """dst became writable: flush, then pass EOF on or resume reading."""
        if not self._flush(h):
            return
        if h.eof:
            self._pass_eof(h)
        else:
            self._read(h)

    @staticmethod
    def _flush(h: _Half) -> bool:
        """Write pending bytes; True when all are out."""
        while h.pending:
            try:
                h.pending -= _splice_out(h.pipe_r, h.dst_fd, h.pending)
            except BlockingIOError:
                return False
        while h.tail:
            try:
                n = h.dst.send(h.tail)
            except (BlockingIOError, InterruptedError):
                return False
            h.tail = h.tail[n:]
        return True

    @staticmethod
    def _pass_eof(h: _Half) -> None:
        if h.waiting or h.shut:
            return  # after the flush
        try:
            _shutdown_write(h.dst)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
        h.shut = True

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
        _close(self.client_sock)
        _close(self.upstream_sock)
