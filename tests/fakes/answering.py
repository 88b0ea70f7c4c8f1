"""Fake upstreams for the first answer (issue 22): they record what each connection
sends and answer late or never; clients send a ClientHello-shaped record (``hello``)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from extractedprism.config.endpoints import Endpoint


def hello(tag: bytes) -> bytes:
    """A complete TLS ClientHello record (type 22, handshake type 1) carrying ``tag``."""
    body = b"\x03\x03" + tag.ljust(40, b".")
    handshake = b"\x01" + struct.pack(">I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack(">H", len(handshake)) + handshake


class Fake:
    """An upstream on loopback that records what each connection sends.

    ``answer_after``: seconds after a connection's first bytes before it echoes them (and
    everything after); None: it never answers. ``read=False``: it never even reads (a
    frozen process: the kernel accepts and buffers). ``reset_after``: seconds after a
    connection's first bytes before it resets the connection without a word (a crashing
    server; ``answer_after`` is then ignored). ``greet``: bytes it sends as soon as it
    accepts, before reading anything. ``rcvbuf``: its sockets' SO_RCVBUF (a small one
    with ``read=False`` stops a sender after a few KiB). ``mark``: bytes put before its
    answer, so a client can tell which upstream answered it."""

    def __init__(self, answer_after: float | None = 0.0, read: bool = True,
                 reset_after: float | None = None, greet: bytes = b"",
                 rcvbuf: int | None = None, mark: bytes = b"") -> None:
        self.answer_after = answer_after
        self.read = read
        self.reset_after = reset_after
        self.greet = greet
        self.mark = mark
        self.lock = threading.Lock()
        self.got: list[bytearray] = []  # per connection, in accept order
        self.closed = 0  # connections the proxy closed
        self.conns: list[socket.socket] = []
        self.stopped = False
        self.sock = socket.socket()
        if rcvbuf is not None:  # before listen(): accepted sockets inherit it
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.endpoint = Endpoint("127.0.0.1", self.sock.getsockname()[1])
        self.address = str(self.endpoint)
        threading.Thread(target=self._accept, name="test-fake-accept", daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with self.lock:
                    if self.stopped:  # accepted while close() ran: closed here
                        conn.close()
                        return
                    self.conns.append(conn)
                    buf = bytearray()
                    self.got.append(buf)
                if self.greet:
                    conn.sendall(self.greet)
                if self.read:
                    threading.Thread(target=self._serve, args=(conn, buf), daemon=True,
                                     name="test-fake-conn").start()

    def _serve(self, conn: socket.socket, buf: bytearray) -> None:
        answered = False
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                with self.lock:
                    buf += chunk
                if self.reset_after is not None:
                    time.sleep(self.reset_after)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
                    conn.close()
                    break
                if self.answer_after is None:
                    continue
                if not answered:
                    time.sleep(self.answer_after)
                    answered = True
                    conn.sendall(self.mark + bytes(buf))
                else:
                    conn.sendall(chunk)
            conn.shutdown(socket.SHUT_WR)  # pass the client's half-close on, as echo does
        with self.lock:
            self.closed += 1

    def has(self, tag: bytes) -> int:
        """How many of its connections received ``tag``."""
        with self.lock:
            return sum(tag in b for b in self.got)

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            self.stopped = True
            for c in self.conns:
                c.close()
