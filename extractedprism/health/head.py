"""An HTTP/1.x request head and one connection's state, for the health server's loop.

Owns the head limits (``REQUEST_TIMEOUT_S``, ``MAX_HEAD_BYTES``, ``LINGER_S``), the
head parser (``request_head_end``, ``is_token``, ``take_head``) and :class:`Conn`. Pure
functions and data: run by the loop thread (``health-http``, conn.py) as bytes arrive,
and by request threads (``health-http-request``, through server.py) as they answer.
"""

from __future__ import annotations

import socket

REQUEST_TIMEOUT_S = 5.0  # whole request head; also the write deadline for an answer
MAX_HEAD_BYTES = 32 * 1024  # probes send ~100 bytes; this bounds memory per connection
LINGER_S = 2.0
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def is_token(b: bytes) -> bool:
    return bool(b) and all(c in _TCHAR for c in b)


def request_head_end(buf: bytes | bytearray) -> int:
    """How many leading bytes of ``buf`` form one request head, or 0 while more are needed.

    A request line that cannot start a valid HTTP/1.x request ends the head by itself, so
    that it is answered at once instead of after the read timeout: the client may never
    send the blank line (HTTP/0.9) or any newline at all (a TLS ClientHello). Line ends
    are found as ``http.server`` finds them: a bare LF ends a line too.
    """
    nl = buf.find(b"\n")
    if nl < 0:
        method = bytes(buf).split(b" ", 1)[0]
        return 0 if not method or is_token(method) else len(buf)
    words = bytes(buf[:nl]).split()
    if len(words) != 3 or not is_token(words[0]) or not words[2].startswith(b"HTTP/1."):
        return nl + 1
    ends = [i + n for sep, n in ((b"\n\r\n", 3), (b"\n\n", 2))
            if (i := buf.find(sep, nl)) >= 0]
    return min(ends) if ends else 0


class Conn:
    """One connection, owned by the loop thread except while a request thread answers it.

    ``head`` is the request to answer; ``oversized``: it is the first ``MAX_HEAD_BYTES``
    of a longer one; ``eof``: the client has half-closed, so this is its last request;
    ``out``: the part of the answer still to write, and ``keep``: whether another
    request may follow it."""

    __slots__ = ("buf", "client", "deadline", "eof", "head", "keep", "out", "oversized",
                 "sock")

    def __init__(self, sock: socket.socket, client: str) -> None:
        self.sock = sock
        self.client = client
        self.buf = bytearray()
        self.deadline = 0.0
        self.head = b""
        self.oversized = False
        self.eof = False
        self.out = memoryview(b"")
        self.keep = False


def take_head(conn: Conn) -> bool:
    """Move a complete head (or everything, at EOF or at the size limit) from the
    buffer to ``conn.head``; False while more bytes are needed."""
    if conn.buf[:1] in (b"\r", b"\n"):
        # RFC 9112 2.2: empty lines before a request line are to be ignored.
        del conn.buf[:len(conn.buf) - len(conn.buf.lstrip(b"\r\n"))]
    n = request_head_end(conn.buf)
    if not n and conn.eof and conn.buf.strip():
        n = len(conn.buf)  # a half-closed client still gets an answer
    if not n and len(conn.buf) > MAX_HEAD_BYTES:
        conn.oversized = True
        n = len(conn.buf)
    if not n:
        return False
    conn.head = bytes(conn.buf[:n])
    del conn.buf[:n]
    return True
