"""Pipe: the two-way byte copy for one client/upstream pair, run by one pipe thread.

# design
Two relays, chosen once per process by ``--relay`` (relay.py's :func:`resolve`):

* native (``_relay.c``): one blocking C call for the life of the connection, with the
  GIL released throughout, like a blocking ``socket.sendfile``. It polls both sockets and
  splices socket -> the thread's kernel pipe -> socket per direction. With many busy
  connections no readiness event needs its thread to win the GIL back, which is what
  bounded the Python loop (docs/performance.md).
* python (the fallback where the extension cannot load, and the buffer copy for a
  connection that got no kernel pipe): both sockets non-blocking, the thread sleeps in
  ``poll`` and moves bytes with ``os.splice`` through the kernel pipes, or with
  ``recv_into``/``send`` on a small reused buffer. A splice failure that is not about the
  peer (EINVAL on an odd socket type) switches the connection to the buffer path; the
  bytes already in the kernel pipe are flushed first, so nothing is lost or reordered.

One thread serves both directions: half the threads of one per direction, and no
deadlock when both peers write at once. Half-close: EOF from one side is passed on with
``shutdown(SHUT_WR)`` once everything read before it was written; the other direction
keeps flowing. A reset or error on either side ends both (the surviving peer gets a reset
too, via SO_LINGER 0). :meth:`Pipe.close` may be called from any thread (drain,
readiness, shutdown): it shuts both sockets down, which wakes either relay; only the pipe
thread closes file descriptors. A connection that ends with bytes still in a kernel
pipe drops the thread's pipes, or the thread's next connection would receive them.
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
from array import array
from collections.abc import Callable

from extractedprism.datapath import native
from extractedprism.datapath.native import HAVE_SPLICE
from extractedprism.datapath.relay import ANSWERED, PYTHON, Relay

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
BUFFER_SIZE = 32 * 1024  # buffer path only; its pages count against RSS per thread
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)

# The native relay's calls (native.py loads the extension), None without it: a Pipe
# reaches them only with the native relay, which exists only when they do.
_ext = native.EXTENSION
_native: Callable[..., tuple[int, int, int]] | None = None if _ext is None else _ext.relay
_close_pair: Callable[[int, int, bool], None] | None = None if _ext is None else _ext.close_pair
_judged: Callable[..., tuple[int, bytes | None, int, int, int, int]] | None = (
    None if _ext is None else _ext.judged_relay)


_EXPECTED = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT,
             errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBADF)
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_POLLOUT = select.POLLOUT | select.POLLERR | select.POLLHUP
_LINGER_RST = struct.pack("ii", 1, 0)

_local = threading.local()
_EOF_SIDE = {1: "client", 2: "upstream"}  # the native relay's first_eof


def _splice(src: int, dst: int, count: int) -> int:
    """Non-blocking splice; raises BlockingIOError when it would block."""
    return os.splice(src, dst, count, flags=_SPLICE_FLAGS)


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
        pipes = []
        try:
            for _ in range(2):
                pipes.append(os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:  # EMFILE/ENFILE: degrade to the buffer path
            for r, w in pipes:  # the first one, if only the second failed
                os.close(r)
                os.close(w)
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

    __slots__ = ("_closed", "_counts", "_done", "_graceful", "_lock", "_mode", "_pin", "_relay",
                 "client",
                 "client_sock", "end_reason", "ended_by", "started", "upstream",
                 "upstream_sock")

    def __init__(self, client: socket.socket, upstream: socket.socket, *, client_addr: str,
                 upstream_addr: str, relay: Relay = PYTHON, mode: str | None = None,
                 pin: int = 0) -> None:
        self.client_sock = client
        self.upstream_sock = upstream
        self.client = client_addr
        self.upstream = upstream_addr
        self.started = time.time()
        # Live byte counts (client->upstream, upstream->client, and the client->upstream
        # count when the upstream's bytes were last read: what they answer, for the stall
        # check): the native relay writes them while it runs, without the GIL, so readers
        # see live bytes either way. Updated once per read, never per byte.
        self._counts = array("Q", (0, 0, 0))
        self._closed = False
        self._graceful = False  # finish(): no reset when the pipe thread closes
        # Who ended the connection and why (the debug "connection closed" line): the
        # first EOF's side, "proxy" for close(), or "error".
        self.ended_by = ""
        self.end_reason = ""
        # close() from another thread and the pipe thread's own close: once _done is set
        # (under _lock) the sockets are the pipe thread's to close, and close() does
        # nothing, so it never shuts down a descriptor number already reused.
        self._lock = threading.Lock()
        self._done = False
        self._relay = relay  # the process's relay (relay.resolve)
        self._pin = pin  # the pipe thread's --gil-cpu CPU + 1, or 0 (the native relay's pin)
        # The Python loop's copy: "splice" through kernel pipes or "buffer" (tests force
        # "buffer"; it is also the fallback where there is no splice or no spare fd).
        self._mode = mode or ("splice" if HAVE_SPLICE else "buffer")

    @property
    def bytes_up(self) -> int:
        return self._counts[0]

    @property
    def bytes_down(self) -> int:
        return self._counts[1]

    @property
    def up_answered(self) -> int:
        """The client->upstream count when the upstream's latest bytes were read."""
        return self._counts[2]

    # -- called from other threads -------------------------------------------------

    def close(self) -> None:
        """Force-close from any thread: wakes the pipe thread, which then cleans up."""
        self._closed = True
        if not self.ended_by:
            self.ended_by, self.end_reason = "proxy", "closed by extractedprism"
        with self._lock:
            if self._done:
                return
            for sock in (self.client_sock, self.upstream_sock):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def finish(self) -> None:
        """Close from any thread with a FIN both ways and no reset (a rebalance close):
        the client reads a clean EOF and reconnects; the upstream sees its client leave.
        Bytes either peer sends after that are not relayed (chosen only for quiet
        connections)."""
        self._graceful = True
        if not self.ended_by:
            self.ended_by, self.end_reason = "proxy", "rebalanced by extractedprism"
        self.close()

    # -- the pipe thread ------------------------------------------------------------

    def run(self) -> None:
        """Copy until both directions finish, an error occurs, or close() is called."""
        if self._relay.native and self._mode == "splice":
            pipes = _thread_pipes()
            if pipes is not None:
                self._run_native(pipes)
                return
            # No descriptor for a kernel pipe (EMFILE): this connection takes the Python
            # loop's buffer copy, which needs none.
        self._run_python()

    @property
    def _aborted(self) -> bool:
        """Closed by close() (reset both peers), not by finish() (FIN only)."""
        return self._closed and not self._graceful

    def count_sent(self, n: int) -> None:
        """Bytes handed to the upstream outside the relay (the client's first bytes, sent
        by the dial or the first answer)."""
        self._counts[0] += n

    def can_judge(self) -> bool:
        """Can run_judged run here: the native relay with this thread's kernel pipes."""
        return self._relay.native and self._mode == "splice" and _thread_pipes() is not None

    def run_judged(self, timeout_ms: int, first: bytes | None, sent: int = 0
                   ) -> tuple[int, bytes | None]:
        """The first answer's wait (first_answer.wait_answer), then the relay, in one
        native call (only where can_judge()). (ANSWERED, None): relayed as run() does.
        (SILENT or LEFT, first): nothing was relayed, both sockets stay open, and the
        upstream has all of the client's first bytes ``first``. ``sent``: how many of
        ``first`` this upstream had already (take_first)."""
        pipes = _thread_pipes()
        assert _judged is not None and pipes is not None
        (up_r, up_w), (down_r, down_w) = pipes
        c, u = self.client_sock, self.upstream_sock
        found, first, err, left_up, left_down, first_eof = _judged(
            c.fileno(), u.fileno(), (up_r, up_w, down_r, down_w), self._counts, timeout_ms,
            first, self._pin, sent)
        if found != ANSWERED:
            return found, first
        self._native_done(err, left_up, left_down, first_eof)
        return ANSWERED, None

    def _run_native(self, pipes: list[tuple[int, int]]) -> None:
        """One blocking call for the life of the connection, GIL released throughout."""
        assert _native is not None
        (up_r, up_w), (down_r, down_w) = pipes
        c, u = self.client_sock, self.upstream_sock
        self._native_done(*_native(c.fileno(), u.fileno(), (up_r, up_w, down_r, down_w),
                                   self._counts, self._pin))

    def _native_done(self, err: int, left_up: int, left_down: int, first_eof: int) -> None:
        """After the native relay: note who ended it, drop dirty pipes, close both."""
        c, u = self.client_sock, self.upstream_sock
        if first_eof and not self.ended_by:
            self.ended_by, self.end_reason = _EOF_SIDE[first_eof], "eof"
        if left_up or left_down:
            # Bytes left in the thread's kernel pipes would leak into the next connection.
            _drop_thread_pipes()
        if err:
            self._log_failure(OSError(err, os.strerror(err)))
        with self._lock:
            self._done = True
            cfd, ufd = c.detach(), u.detach()
        # Both closes in one GIL-holding call: two fewer GIL hand-offs per connection.
        _close_pair(cfd, ufd, bool(err) or self._aborted)  # type: ignore[misc]

    def _log_failure(self, exc: OSError) -> None:
        if not self.ended_by:
            self.ended_by, self.end_reason = "error", exc.strerror or str(exc)
        if exc.errno in _EXPECTED:
            log.debug("connection ended client=%s upstream=%s reason=%r", self.client,
                      self.upstream, exc.strerror)
        else:
            log.warning("connection failed client=%s upstream=%s error=%r", self.client,
                        self.upstream, exc)

    def _run_python(self) -> None:
        """The fallback: non-blocking sockets and poll, splice or buffer copy.

        Each readiness event costs one read and one write (and a GIL round trip each):
        after a short read the loop goes back to poll instead of reading until EAGAIN,
        because with many busy pipe threads every extra syscall is another GIL hand-off.
        """
        c, u = self.client_sock, self.upstream_sock
        c.setblocking(False)
        u.setblocking(False)
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
            self._log_failure(exc)
        finally:
            self._finish(up, down, reset or self._aborted)

    def _read(self, h: _Half) -> bool:
        """Read what src has (until a short read), writing each chunk straight on.

        Returns True when the direction's state changed (EOF, or dst full), so the
        caller re-registers interest only then.
        """
        while True:
            if h.pipe_w >= 0:
                try:
                    n = _splice(h.src_fd, h.pipe_w, CHUNK)
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
                        h.pending = n - _splice(h.pipe_r, h.dst_fd, n)
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
            counts = self._counts
            if h.up:
                counts[0] += n
            else:
                # What the upstream's bytes answer (the stall check), stored before the
                # count: a sampler that runs between the two (another thread may take the
                # GIL there) and sees these bytes must see what they answer, or it starts a
                # stall clock nothing clears (issue 37, finding 12; _relay.c does the same).
                counts[2] = counts[0]
                counts[1] += n
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
                h.pending -= _splice(h.pipe_r, h.dst_fd, h.pending)
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
            h.dst.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
        h.shut = True

    def _finish(self, up: _Half, down: _Half, abort: bool) -> None:
        if up.pending or down.pending:
            # Bytes left in the thread's kernel pipes would leak into the next connection.
            _drop_thread_pipes()
        self._close_both(abort)

    def _close_both(self, abort: bool) -> None:
        with self._lock:
            self._done = True
        if abort:
            # Propagate the reset so neither peer waits on a half-dead connection.
            for sock in (self.client_sock, self.upstream_sock):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                except OSError:
                    pass
        self.client_sock.close()
        self.upstream_sock.close()
