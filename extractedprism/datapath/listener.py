"""The listening socket: bind with the connection options, and the accept wake-up.

Owns open_listener (run by the main thread at start, or not at all when the listener is
taken over from a predecessor), set_accept_wake, and the per-socket helpers the acceptor
thread uses on each accepted client (has_opts, format_addr).

The listener may be shared with another instance (handover.py: a successor takes it
over): accept() wakes every ``ACCEPT_WAKE_S`` (SO_RCVTIMEO on the listener, which Linux
applies to accept) so the acceptor can stop accepting without ``shutdown()``, which
would stop the socket for the successor too. Nothing is lost while both accept: the
connections queued on the socket belong to it, not to either process.
"""

from __future__ import annotations

import socket
import struct

from extractedprism.config.endpoints import is_ip
from extractedprism.datapath.sockopts import CONNECTION_SOCKOPTS, apply_sockopts

# How often a blocked accept() returns to look at the stop flags. Idle cost: one
# wake-up per interval; no cost per connection.
ACCEPT_WAKE_S = 0.25
_RCVTIMEO = struct.pack("ll", 0, int(ACCEPT_WAKE_S * 1_000_000))


def has_opts(sock: socket.socket) -> bool | None:
    """Whether ``sock`` carries every connection option (None: could not tell)."""
    try:
        return all(sock.getsockopt(level, name) == value
                   for level, name, value in CONNECTION_SOCKOPTS)
    except OSError:
        return None  # reset already; ask the next socket


def format_addr(addr: tuple) -> str:  # type: ignore[type-arg]
    """host:port, IPv6 hosts in brackets (how logs and metrics name a peer)."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_listener(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """Bind and listen on host:port (IPv4, IPv6 or a name resolved once).

    The connection options go on the listener: Linux copies them to every accepted
    socket, which saves six setsockopt calls per client connection (the acceptor
    checks the first accepted socket and falls back to setting them per socket).
    """
    if is_ip(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addr: tuple = (host, port)  # type: ignore[type-arg]
    else:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, addr = info[0], info[4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        apply_sockopts(sock)
        sock.bind(addr)
        sock.listen(backlog)
        set_accept_wake(sock)
    except OSError:
        sock.close()
        raise
    return sock


def set_accept_wake(sock: socket.socket) -> None:
    """Make a blocking accept() on ``sock`` return EAGAIN every ``ACCEPT_WAKE_S``.

    Accepted sockets inherit the option; pipe threads use them non-blocking, where it
    has no effect."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RCVTIMEO)
