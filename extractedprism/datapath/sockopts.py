"""Socket options as data, applied in one place, and the upstream dial.

The spec asks for TCP keepalive on both client and upstream connections (probes after
30 s idle, with Go's default probe interval and count: 15 s, 9 probes) and a TCP user
timeout of 30 s on Linux, so a dead peer is noticed within about half a minute even
while data is unacknowledged. TCP_NODELAY keeps small API requests from waiting on
Nagle's algorithm. Options this platform lacks are skipped.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import time

from extractedprism.config.endpoints import Endpoint
from extractedprism.datapath import native

KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 15  # Go's net.Dialer default probe interval
KEEPALIVE_COUNT = 9  # Go's default probe count (Linux default too)
USER_TIMEOUT_MS = 30_000

SockOpt = tuple[int, int, int]
_NONBLOCKING_STREAM = socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC


def _opts() -> list[SockOpt]:
    opts: list[SockOpt] = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
    ]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


# Client-side and upstream-side connections get the same treatment.
CONNECTION_SOCKOPTS: list[SockOpt] = _opts()
_OPTS = tuple(CONNECTION_SOCKOPTS)

# The native relay's GIL-holding connect (see begin_connect), when native.py loaded the
# extension.
_native_connect = None if native.EXTENSION is None else native.EXTENSION.connect


def apply_sockopts(sock: socket.socket, opts: list[SockOpt] = CONNECTION_SOCKOPTS) -> None:
    for level, name, value in opts:
        try:
            sock.setsockopt(level, name, value)
        except OSError:
            # A socket that was reset before we got to it; the copy loop will see it.
            pass


def _ip_family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def addresses(endpoint: Endpoint) -> list[tuple[int, tuple]]:  # type: ignore[type-arg]
    """(family, sockaddr) to try for ``endpoint``, in the resolver's order."""
    if not endpoint.is_hostname:
        # An IP literal needs no resolver round trip on every new connection.
        return [(_ip_family(endpoint.host), (endpoint.host, endpoint.port))]
    infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    return [(family, addr) for family, _, _, _, addr in infos]


def begin_connect(family: int, addr: tuple, native: bool = False  # type: ignore[type-arg]
                  ) -> tuple[socket.socket | None, int]:
    """A non-blocking socket with the connection options, its connect started.

    Returns the socket and connect's errno: 0 (connected), EINPROGRESS (poll for
    POLLOUT, then read SO_ERROR), or a failure (the socket is then None, or the caller
    closes it). ``native``: socket, options and connect in one C call that keeps the GIL
    (none of them blocks), instead of two GIL releases (socket() and connect()).
    """
    if native and _native_connect is not None and (len(addr) == 2 or not addr[3]):
        try:
            fd, err, _, _ = _native_connect(family, addr[0], addr[1], _OPTS)
        except ValueError:
            pass  # not a plain numeric address: the stdlib takes it
        else:
            if fd < 0:
                return None, err
            return socket.socket(family, socket.SOCK_STREAM, 0, fd), err
    sock = socket.socket(family, _NONBLOCKING_STREAM)
    try:
        apply_sockopts(sock)
        return sock, sock.connect_ex(addr)
    except BaseException:
        sock.close()
        raise


def native_target(endpoint: Endpoint) -> tuple[int, str, int] | None:
    """(family, host, port) for the extension's connect, or None: a hostname, a scoped
    IPv6 address (``fe80::1%eth0``: the stdlib resolves the scope id), or no extension."""
    if _native_connect is None or endpoint.is_hostname or "%" in endpoint.host:
        return None
    return _ip_family(endpoint.host), endpoint.host, endpoint.port


def native_connect(target: tuple[int, str, int], client_fd: int = -1
                   ) -> tuple[int, int, bytes | None, int]:
    """The extension's connect with the connection options: (fd, errno, first, sent); with
    ``client_fd``, a connect done at once has also sent the client's first bytes on
    (``first``, ``sent`` as take_first returns them; see _relay.c)."""
    assert _native_connect is not None
    return _native_connect(  # type: ignore[no-any-return]
        target[0], target[1], target[2], _OPTS, client_fd)


def wait_connected(sock: socket.socket, timeout: float) -> None:
    """Wait for a non-blocking connect in progress; raises its failure or TimeoutError."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    if timeout <= 0 or not poller.poll(math.ceil(timeout * 1000)):
        raise TimeoutError(errno.ETIMEDOUT, "timed out")
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


def dial(endpoint: Endpoint, timeout: float, native: bool = False) -> socket.socket:
    """Connect to ``endpoint`` within ``timeout`` (name resolution included).

    Returns a connected, non-blocking socket: the relay wants it so, and a socket made
    non-blocking at birth (SOCK_NONBLOCK: the object's timeout is 0 from the start)
    saves two GIL round trips per connection (settimeout and setblocking each release
    the GIL) over connect-with-timeout.
    """
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    for family, addr in addresses(endpoint):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock, err = begin_connect(family, addr, native)
        if sock is None:
            last = OSError(err, os.strerror(err))
            continue
        try:
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                wait_connected(sock, remaining)
            elif err:
                raise OSError(err, os.strerror(err))
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last if last is not None else OSError(f"no address for {endpoint}")


def describe_error(exc: BaseException) -> str:
    """Short, operator-facing reason for a failed dial or probe."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"name resolution failed: {exc.strerror}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
