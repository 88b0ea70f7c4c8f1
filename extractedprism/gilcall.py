"""Non-blocking syscalls that keep the GIL, for the pipe threads' hot path.

CPython releases the GIL around every socket and os call, even one on a non-blocking
fd that returns in a microsecond. With dozens of busy pipe threads each release is a
chance for another thread to take the GIL, and getting it back costs a futex wait and
often a context switch: measured, 25-35 voluntary context switches per proxied
connection. ``ctypes.PyDLL`` calls keep the GIL, so these wrappers are used only for
calls that cannot block (non-blocking fds, SPLICE_F_NONBLOCK, fcntl, shutdown, and
close of a socket whose linger does not wait); poll(), accept() and connect() still
release it. Where libc or a symbol is missing, the stdlib call is used instead.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import socket
from collections.abc import Callable

_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)

try:
    _libc: ctypes.CDLL | None = ctypes.PyDLL(None, use_errno=True)
except OSError:
    _libc = None


def _fn(name: str, argtypes: list[type], restype: type) -> Callable[..., int] | None:
    fn = getattr(_libc, name, None) if _libc is not None else None
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn  # type: ignore[no-any-return]


_c_splice = _fn("splice", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_uint], ctypes.c_ssize_t)
_c_shutdown = _fn("shutdown", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
_c_close = _fn("close", [ctypes.c_int], ctypes.c_int)
_c_fcntl = _fn("fcntl", [ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_int)
_c_socket = _fn("socket", [ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_int)
AVAILABLE = None not in (_c_splice, _c_shutdown, _c_close, _c_fcntl, _c_socket)
_NONBLOCK_TYPE = getattr(socket, "SOCK_NONBLOCK", 0) | getattr(socket, "SOCK_CLOEXEC", 0)


def _raise(err: int) -> None:
    raise OSError(err, os.strerror(err))


def splice(src: int, dst: int, count: int) -> int:
    """Non-blocking splice; bytes moved (0 at EOF). Raises BlockingIOError when it would
    block, like os.splice, so both can serve the same caller."""
    n = _c_splice(src, None, dst, None, count, _SPLICE_FLAGS)  # type: ignore[misc]
    if n >= 0:
        return n  # type: ignore[no-any-return]
    err = ctypes.get_errno()
    if err in _AGAIN:
        raise BlockingIOError(err, os.strerror(err))
    _raise(err)
    return -1  # unreachable


# The stdlib splice with the pipe's flags bound: no Python frame per call.
os_splice: Callable[[int, int, int], int] = functools.partial(os.splice, flags=_SPLICE_FLAGS)


def shutdown_write(sock: socket.socket) -> None:
    if _c_shutdown(sock.fileno(), socket.SHUT_WR) < 0:  # type: ignore[misc]
        _raise(ctypes.get_errno())


def close(sock: socket.socket) -> None:
    fd = sock.detach()
    if fd >= 0:
        _c_close(fd)  # type: ignore[misc]


def set_nonblocking(sock: socket.socket) -> None:
    """O_NONBLOCK on the fd. A socket object without a timeout then raises
    BlockingIOError on EAGAIN from its own calls, which is what the pipe expects; one
    with a timeout would wait in poll instead, so it goes through setblocking()."""
    if sock.gettimeout() is not None:
        sock.setblocking(False)
        return
    fd = sock.fileno()
    flags = _c_fcntl(fd, fcntl.F_GETFL, 0)  # type: ignore[misc]
    if flags < 0:
        _raise(ctypes.get_errno())
    if not flags & os.O_NONBLOCK and _c_fcntl(fd, fcntl.F_SETFL,  # type: ignore[misc]
                                             flags | os.O_NONBLOCK) < 0:
        _raise(ctypes.get_errno())


def new_nonblocking_socket(family: int) -> socket.socket:
    """A TCP socket whose fd is O_NONBLOCK from birth, made without releasing the GIL.

    The Python object has no timeout, so its calls raise BlockingIOError (or return
    EINPROGRESS from connect_ex) instead of waiting: the caller polls.
    """
    if AVAILABLE and _NONBLOCK_TYPE:
        fd = _c_socket(family, socket.SOCK_STREAM | _NONBLOCK_TYPE, 0)  # type: ignore[misc]
        if fd < 0:
            _raise(ctypes.get_errno())
        return socket.socket(family, socket.SOCK_STREAM, 0, fd)
    sock = socket.socket(family, socket.SOCK_STREAM)
    os.set_blocking(sock.fileno(), False)  # behind the object's back: timeout stays None
    return sock


def std_shutdown_write(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_WR)


def std_close(sock: socket.socket) -> None:
    sock.close()


def std_set_nonblocking(sock: socket.socket) -> None:
    sock.setblocking(False)
